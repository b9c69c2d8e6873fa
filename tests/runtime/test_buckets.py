"""The reducer's global bucket layout (runtime.reducer.global_buckets), on meta models."""

from __future__ import annotations

import pytest
import torch

from subnetdp.models import get_recipe
from subnetdp.runtime.reducer import global_buckets
from subnetdp.strategy import get_strategy
from subnetdp.subnet.match import match_plan
from subnetdp.subnet.pieces import full_pieces, reduction_order
from subnetdp.subnet.planning import plan_for


def _layout(strategy: str, world: int, coverage: float, cap: int = 25 * 2**20):
    recipe = get_recipe("llama-tiny")
    with torch.device("meta"):
        model = recipe.build_model()
    strat = get_strategy(strategy)
    plan = plan_for(model, recipe.adapter, strat, world=world, coverage=coverage)
    groups = match_plan(plan, model, recipe.adapter, strat) if strat.neuron_level else None
    order = reduction_order(full_pieces(model, [u.name for u in plan.units], groups))
    return plan, order, global_buckets(order, plan, bucket_cap_bytes=cap)


@pytest.mark.parametrize("strategy", ["b-sdp", "n-sdp"])
@pytest.mark.parametrize("cap", [25 * 2**20, 2**18])
def test_every_piece_once_with_its_holders_and_the_cap(strategy: str, cap: int) -> None:
    plan, order, specs = _layout(strategy, 4, 0.5, cap)
    names = [n for s in specs for n in s.names]
    assert sorted(names) == sorted(p.name for p in order)  # each reduced piece exactly once
    everyone = tuple(range(plan.world))
    for s in specs:
        for p in s.pieces:
            assert s.holders == (everyone if p.unit is None else tuple(plan.holders(p.unit)))
        # a bucket goes over the cap only when one piece alone does
        assert s.numel * s.dtype.itemsize <= cap or len(s.pieces) == 1
    # within a holder set, pieces keep the reduction order (backward's)
    pos = {p.name: i for i, p in enumerate(order)}
    for s in specs:
        assert [pos[n] for n in s.names] == sorted(pos[n] for n in s.names)


def test_neuron_level_sends_one_bucket_per_holder_set() -> None:
    """n-sdp interleaves each layer pair's group slices with tiny shared norm weights; packing
    by holder set across layers gives each rank one bucket per holder set it is in (it used
    to get 49 on this model: a cut at every change of holder set)."""
    _, _, specs = _layout("n-sdp", 4, 0.5)
    for rank in range(4):
        mine = [s for s in specs if rank in s.holders]
        assert len(mine) == len({s.holders for s in mine}) == 3


def test_buckets_are_listed_by_their_last_piece() -> None:
    _, order, specs = _layout("n-sdp", 4, 0.5, cap=2**18)
    pos = {p.name: i for i, p in enumerate(order)}
    lasts = [max(pos[n] for n in s.names) for s in specs]
    assert lasts == sorted(lasts)
