"""A heterogeneous plan (balanced scheme, per-rank capacities 1 : 0.5 : 0.5 : 0.5): ranks hold
unequal numbers of units and units unequal numbers of holders; the 4-process run still equals
the hand-averaged single-process reference, holder copies stay identical and the bytes sent
equal the plan's analytic figures."""

from __future__ import annotations

import pytest
import torch

from subnetdp.plan import make_plan, worker_bytes
from subnetdp.subnet.units import describe_units
from tests.dist.harness import run_workers
from tests.dist.test_runtime import _reference, _train_sdp
from tests.dist.toy import TOY_ADAPTER, Toy

pytestmark = pytest.mark.dist
STEPS = 3


def test_heterogeneous_plan_matches_reference() -> None:
    with torch.device("meta"):
        units, shared = describe_units(Toy(), TOY_ADAPTER)
    plan = make_plan(world=4, units=units, coverage=1.0, scheme="balanced",
                     capacities=[1.0, 0.5, 0.5, 0.5], shared_size=shared)
    counts = [len(plan.held_units(r)) for r in range(4)]
    assert counts[0] == plan.num_units and max(counts[1:]) < plan.num_units
    assert len(set(plan.holder_counts())) > 1  # units with unequal holder counts
    results = run_workers(_train_sdp, 4, plan, STEPS)
    ref = _reference(plan, STEPS)
    for rank, res in enumerate(results):
        assert res["held"] == plan.held_units(rank)
        wb = worker_bytes(plan, rank)
        assert res["params_held"] * 4 == wb.params
        assert res["bytes"] == [wb.allreduce_payload] * STEPS
        for step in range(STEPS):
            for name, value in res["history"][step].items():
                torch.testing.assert_close(value, ref[step][name], rtol=0, atol=1e-6)
    for u in range(plan.num_units):
        first, *others = plan.holders(u)
        for h in others:
            for name, value in results[first]["history"][-1].items():
                if name.startswith(f"blocks.{u}."):
                    assert torch.equal(value, results[h]["history"][-1][name])
