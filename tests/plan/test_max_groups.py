"""``--max-groups`` (plan.schemes.make_plan): at most K distinct holder sets, units tiled into
K holder patterns; refused where it cannot apply, before any worker starts."""

from __future__ import annotations

import pytest

from subnetdp.plan import PlanError, make_plan
from subnetdp.plan.communicators import communicators_per_rank
from subnetdp.train.config import TrainConfig


@pytest.mark.parametrize("scheme", ["spread", "random"])
def test_units_tile_k_holder_patterns(scheme: str) -> None:
    free = make_plan(world=8, units=24, coverage=0.69, scheme=scheme)
    assert len(free.holder_sets()) > 8
    for k in (1, 4, 8):
        plan = make_plan(world=8, units=24, coverage=0.69, scheme=scheme, max_groups=k)
        assert len(plan.holder_sets()) <= k
        assert all(plan.holders(u) == plan.holders(u % k) for u in range(24))
        assert max(communicators_per_rank(plan)) <= k + 1
    assert make_plan(world=8, units=24, coverage=0.69, scheme=scheme,
                     max_groups=24).matrix == free.matrix


def test_refused_where_it_cannot_apply() -> None:
    with pytest.raises(PlanError, match="--max-groups must be >= 1"):
        make_plan(world=4, units=8, coverage=0.5, max_groups=0)
    with pytest.raises(PlanError, match="balanced"):
        make_plan(world=4, units=8, coverage=0.5, scheme="balanced", max_groups=2)
    with pytest.raises(ValueError, match="--max-groups"):
        TrainConfig(scheme="balanced", max_groups=2).validate("lm")
    TrainConfig(max_groups=2).validate("lm")
