"""Swin-T, WideResNet-18 and a user's own model (through ``auto_adapter``) under ddp, b-sdp and
n-sdp with several gloo workers: after a few SGD steps every rank's parameters (in full-model
coordinates) equal those of the single-process reference of tests/dist/reference.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from subnetdp.models import get_recipe
from subnetdp.plan import make_layered_plan, make_plan
from subnetdp.runtime import SubnetDataParallel
from subnetdp.subnet.adapter import UnitAdapter
from subnetdp.subnet.auto import auto_adapter
from subnetdp.subnet.build import build_full_model
from subnetdp.subnet.neurons import describe_neuron_units
from subnetdp.subnet.units import describe_units
from tests.dist.harness import run_workers
from tests.dist.reference import assert_pieces_match, reference_history

pytestmark = pytest.mark.dist
STEPS, SEED = 2, 5


class UserBlock(nn.Module):
    """A user's residual block called by keyword that returns a tuple (stream, extra)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, hidden: torch.Tensor, *, gain: float = 1.0) -> tuple[torch.Tensor, Any]:
        update = self.fc2(F.gelu(self.fc1(self.norm(hidden))))
        return hidden + gain * update, update.detach()


class UserNet(nn.Module):
    def __init__(self, d: int = 12, n: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(6, d)
        self.stack = nn.ModuleList(UserBlock(d) for _ in range(n))
        self.out = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.stack:
            h = block(hidden=h, gain=0.5)[0]
        return self.out(h)


# name -> (build on the current device, adapter, input shape of one sample)
def _case(name: str) -> tuple[Any, UnitAdapter, tuple[int, ...]]:
    if name == "swin-t-32":  # 2 stages: shifted windows in both (16 and 8 tokens, window 4)
        r = get_recipe("swin-t-cifar100")
        args = {"embed_dim": 8, "depths": [2, 2], "num_heads": [2, 4], "num_classes": 10}
        return (lambda: r.build_model(**args)), r.adapter, (3, 32, 32)
    if name == "swin-t-28":  # 14 -> 7 -> 4 (odd side padded by patch merging)
        r = get_recipe("swin-t-fmnist")
        args = {"embed_dim": 8, "depths": [2, 1, 1], "num_heads": [2, 2, 4]}
        return (lambda: r.build_model(**args)), r.adapter, (1, 28, 28)
    if name == "wrn18":
        r = get_recipe("wrn18-fmnist")
        return (lambda: r.build_model(width=2)), r.adapter, (1, 28, 28)
    assert name == "user"
    with torch.device("meta"):
        adapter = auto_adapter(UserNet())  # finds "stack"
    return UserNet, adapter, (6,)


def _batch(shape: tuple[int, ...]):
    def batch(w: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100 * step + w)
        return torch.randn(4, *shape, generator=g) * (1 + w), torch.randint(0, 4, (4,),
                                                                             generator=g)
    return batch


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)


def _plan(name: str, strategy: str, world: int):
    build, adapter, _ = _case(name)
    with torch.device("meta"):
        model = build()
    if strategy == "n-sdp":
        units, shared, layers = describe_neuron_units(model, adapter, groups=world)
        return make_layered_plan(world=world, units=units, layers=layers, coverage=0.5,
                                 shared_size=shared)
    units, shared = describe_units(model, adapter)
    return make_plan(world=world, units=units, coverage=1.0 if strategy == "ddp" else 0.5,
                     shared_size=shared)


def _train(rank: int, world: int, name: str, strategy: str, plan) -> dict[str, Any]:
    build, adapter, shape = _case(name)
    with torch.device("meta"):
        model = build()
    wrapped: nn.Module
    if strategy == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(
            build_full_model(model, adapter, seed=SEED))
    else:
        wrapped = SubnetDataParallel(model, plan=plan, adapter=adapter, strategy=strategy,
                                     device="cpu", init_seed=SEED)
    opt = _sgd(wrapped.parameters())
    batch = _batch(shape)
    for step in range(STEPS):
        x, y = batch(rank, step)
        F.cross_entropy(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()
    if isinstance(wrapped, SubnetDataParallel):
        return {"pieces": wrapped.shard_state(owned_only=False),
                "held": wrapped.params_held, "bytes": wrapped.comm_stats.last_step_bytes}
    params = {k: v.detach().clone() for k, v in wrapped.module.named_parameters()}
    return {"pieces": params, "held": sum(v.numel() for v in params.values()), "bytes": None}


CASES = [
    ("swin-t-32", "ddp", 2), ("swin-t-32", "b-sdp", 4), ("swin-t-32", "n-sdp", 2),
    ("swin-t-28", "b-sdp", 3), ("swin-t-28", "n-sdp", 4),
    ("wrn18", "ddp", 2), ("wrn18", "b-sdp", 4), ("wrn18", "n-sdp", 3),
    ("user", "ddp", 2), ("user", "b-sdp", 3),
]


@pytest.mark.parametrize(("name", "strategy", "world"), CASES)
def test_matches_single_process_reference(name: str, strategy: str, world: int) -> None:
    plan = _plan(name, strategy, world)
    results = run_workers(_train, world, name, strategy, plan)
    build, adapter, shape = _case(name)
    with torch.device("meta"):
        full = build()
    full = build_full_model(full, adapter, seed=SEED)
    total = sum(p.numel() for p in full.parameters())
    ref = reference_history(full, adapter, plan, strategy, batch=_batch(shape),
                            loss=F.cross_entropy, optimizer=_sgd, steps=STEPS)[-1]
    for res in results:
        assert assert_pieces_match(res["pieces"], ref, atol=2e-5, rtol=1e-4) > 0
        if strategy == "ddp":
            assert res["held"] == total
        else:  # a subnetwork: fewer parameters held and sent than the full model
            assert res["held"] < total
            assert 0 < res["bytes"] < 4 * total
