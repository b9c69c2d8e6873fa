"""Activation checkpointing leaves BatchNorm's running statistics as they are without it.

Oracle: for every strategy and composition that runs a BatchNorm model (the ResNet recipe), the
full model after a few steps with ``ac`` equals the one without, bit for bit, buffers included;
and every ``num_batches_tracked`` counts each training batch once (the recomputation in
backward must not count it again, issue 28 item 1).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from subnetdp.models import get_recipe
from subnetdp.parallelize import parallelize
from subnetdp.strategy import Composition, get_strategy, label
from subnetdp.subnet.planning import plan_for
from tests.dist.harness import run_workers

pytestmark = pytest.mark.dist

WORLD = 2
STEPS = 3
CASES = [("ddp", False), ("ddp", True),  # the DDP and FSDP baselines
         *((name, fsdp) for name in ("b-sdp", "n-sdp", "bb-sdp", "nb-sdp")
           for fsdp in (False, True))]


def _train(rank: int, strategy: str, comp: Composition) -> dict[str, torch.Tensor] | None:
    recipe = get_recipe("resnet18-fmnist")
    with torch.device("meta"):
        model = recipe.build_model(width=4)
    plan = plan_for(model, recipe.adapter, get_strategy(strategy), world=WORLD, coverage=0.5)
    rm = parallelize(model, adapter=recipe.adapter, strategy=strategy, plan=plan, comp=comp)
    opt = rm.optimizer(torch.optim.SGD, lr=0.1)
    rm.model.train()
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 1, 28, 28, generator=g), torch.randint(0, 10, (4,), generator=g)
        nn.functional.cross_entropy(rm.model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return rm.full_state_dict()


def _every_case(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for strategy, fsdp in CASES:
        for ac in (False, True):
            comp = Composition(fsdp=fsdp, ac=ac)
            out[label(get_strategy(strategy), comp)] = _train(rank, strategy, comp)
    return out


def test_ac_leaves_batchnorm_statistics_alone() -> None:
    states = run_workers(_every_case, WORLD, timeout=600)[0]  # the full states are on rank 0
    for strategy, fsdp in CASES:
        off = states[label(get_strategy(strategy), Composition(fsdp=fsdp))]
        on = states[label(get_strategy(strategy), Composition(fsdp=fsdp, ac=True))]
        counts = {k: int(v) for k, v in on.items() if k.endswith("num_batches_tracked")}
        assert counts and set(counts.values()) == {STEPS}, (strategy, fsdp, counts)
        assert off.keys() == on.keys()
        differ = [k for k in off if not torch.equal(off[k], on[k])]
        assert not differ, (strategy, fsdp, differ)
