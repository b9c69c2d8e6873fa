"""Issue 42, item 2: everything a build makes is freed when dropped.

Oracle: rank 0's model and optimizer are built (``parallelize``: every strategy, composed
with FSDP2, ZeRO, activation checkpointing, ``--compile``), stepped or not, and dropped; after
``gc.collect()`` every module, the wrapper, the optimizer and every parameter are gone
(weak references), and no tensor with memory (``gc.get_objects()``) is left that was not
alive before. Three builds per case: the first (one step) may fill torch's process-wide
caches, and may leave nothing there but device-mesh rank tables (DTensor's redistribution
planners keep their meshes) and empty tensors (compile's constants); the next two, one
without a step and one with, leave no tensor at all, so repeated builds stay flat.

In one process: the SDP strategies and FSDP over torch's fake process group (rank 0 of 4,
collectives return at once), torch DDP, whose reducer reads its collectives' results, over a
one-rank gloo group, as the checkpoint round trip (``subnetdp.save``/``load``, whose
collectives read what the others wrote).
"""

from __future__ import annotations

import gc
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import subnetdp
import subnetdp.runtime.compile as compile_mod
from subnetdp.models import get_recipe
from subnetdp.parallelize import parallelize
from subnetdp.runtime.rank import RankModel
from subnetdp.strategy import Composition, PlanSpec, RankSpec
from subnetdp.subnet.planning import build_plan
from tests.dist.tensors import describe, live_tensors, nbytes, settled

# llama-tiny, small (the composition tests' shape, 2 layers); resnet18-fmnist narrow: its
# BatchNorm weights are the parameters nb-sdp holds in part without held_grad's slicing
LLAMA = {"dim": 32, "n_layers": 2, "n_heads": 4, "vocab_size": 64, "max_seq_len": 16,
         "ffn_hidden": 48}
RESNET = {"width": 4}

# (strategy, composition, recipe, world): world 1 is a gloo group, else the fake group
CASES: list[tuple[str, dict[str, Any], str, int]] = [
    ("ddp", {}, "llama-tiny", 1),
    ("ddp", {"ac": True, "compile": True}, "llama-tiny", 1),
    ("ddp", {"zero": 1}, "llama-tiny", 1),
    ("ddp", {"zero": 2}, "llama-tiny", 4),
    ("ddp", {"fsdp": True}, "llama-tiny", 4),
    ("b-sdp", {}, "llama-tiny", 4),
    ("n-sdp", {}, "llama-tiny", 4),
    ("bb-sdp", {}, "llama-tiny", 4),
    ("nb-sdp", {}, "llama-tiny", 4),
    ("nb-sdp", {}, "resnet18-fmnist", 4),
    ("b-sdp", {"fsdp": True, "ac": True}, "llama-tiny", 4),
    ("nb-sdp", {"fsdp": True}, "llama-tiny", 4),
    ("b-sdp", {"zero": 1}, "llama-tiny", 4),
    ("nb-sdp", {"zero": 2}, "llama-tiny", 4),
    ("n-sdp", {"ac": True, "compile": True}, "llama-tiny", 4),
]


def _id(case: tuple[str, dict[str, Any], str, int]) -> str:
    strategy, opts, recipe, _ = case
    return "+".join([strategy, *(f"{k}{v if v is not True else ''}" for k, v in opts.items()),
                     *(["resnet"] if recipe != "llama-tiny" else [])])


@pytest.fixture(autouse=True)
def _aot_eager(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(compile_mod, "BACKEND", "aot_eager")  # no C++ compiler needed
    yield
    torch._dynamo.reset()


def _group(world: int) -> None:
    if world == 1:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    else:
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())


def _build(strategy: str, opts: dict[str, Any], recipe_name: str
           ) -> tuple[RankModel, torch.optim.Optimizer]:
    recipe = get_recipe(recipe_name)
    with torch.device("meta"):
        model = recipe.build_model(**(LLAMA if recipe.task == "lm" else RESNET))
    spec, world = RankSpec.of(strategy, Composition(**opts)), dist.get_world_size()
    cover = PlanSpec(coverage=min(1.0, 2 / world))  # 2 holders per block (world 1: the one)
    plan = (build_plan(model, recipe.adapter, spec.strategy, cover, world=world)
            if spec.strategy.is_sdp else None)
    rank = parallelize(model, adapter=recipe.adapter, strategy=spec, plan=plan)
    return rank, rank.optimizer(torch.optim.AdamW, lr=1e-3)


def _step(rank: RankModel, opt: torch.optim.Optimizer, recipe_name: str) -> None:
    g = torch.Generator().manual_seed(0)
    if recipe_name == "llama-tiny":
        tokens = torch.randint(0, LLAMA["vocab_size"], (2, 9), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
    else:
        x, y = torch.randn(2, 1, 28, 28, generator=g), torch.randint(0, 10, (2,), generator=g)
    logits = rank.model(x)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _weak(rank: RankModel, opt: torch.optim.Optimizer) -> list[weakref.ref[Any]]:
    """Weak references to what a build made: wrapper, modules, optimizer, parameters."""
    objs = [rank, rank.model, rank.module, opt, *rank.module.modules(),
            *rank.module.parameters(), *rank.parameters()]
    return [weakref.ref(o) for o in objs]


def _cycle(case: tuple[str, dict[str, Any], str, int], steps: int) -> list[weakref.ref[Any]]:
    strategy, opts, recipe, _ = case
    rank, opt = _build(strategy, opts, recipe)
    for _ in range(steps):
        _step(rank, opt, recipe)
    return _weak(rank, opt)


def _new(before: set[int]) -> list[torch.Tensor]:
    return [t for t in live_tensors() if id(t) not in before]


def _none(tensors: list[torch.Tensor]) -> bool:
    return not tensors


def _mesh_table(t: torch.Tensor, *besides: object) -> bool:
    """Only device meshes hold ``t`` (a mesh's rank table, which DTensor's redistribution
    planners, cached for the process by torch, keep)."""
    holders = [r for r in gc.get_referrers(t) if all(r is not b for b in besides)]
    return bool(holders) and all(isinstance(r, DeviceMesh) for r in holders)


def _alive(refs: list[weakref.ref[Any]]) -> list[str]:
    gc.collect()
    return sorted({type(o).__name__ for r in refs if (o := r()) is not None})


def _check_dropped(cycle: Any) -> None:
    """``cycle(steps)`` builds, steps, drops and returns weak references: the first call may
    leave torch's caches (device-mesh rank tables, compile's empty constants), the next ones
    nothing at all."""
    gc.collect()
    gc.freeze()  # what lived before is left out of every collection and count: fast
    try:
        before = {id(t) for t in live_tensors()}
        refs = cycle(1)
        assert not _alive(refs), f"alive after the first build: {_alive(refs)}"
        def first_left() -> list[torch.Tensor]:
            new = _new(before)
            return [t for t in new if nbytes(t) and not _mesh_table(t, new)]

        left = settled(first_left, _none)
        assert not left, f"the first build left {describe(left)}"
        del left
        warm = {id(t) for t in live_tensors()}
        for steps in (0, 1):
            refs = cycle(steps)
            assert not _alive(refs), f"alive after a build with {steps} steps: {_alive(refs)}"
            left = settled(lambda: _new(warm), _none)
            assert not left, f"a build with {steps} steps left {describe(left)}"
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_a_dropped_build_frees_everything(case: tuple[str, dict[str, Any], str, int]) -> None:
    _group(case[3])
    try:
        _check_dropped(lambda steps: _cycle(case, steps))
    finally:
        dist.destroy_process_group()


def _round_trip(folder: str, steps: int) -> list[weakref.ref[Any]]:
    """b-sdp + ZeRO-1 (its buckets include those held alone, so one rank has some): step,
    save, a second build restored from it, step again."""
    rank, opt = _build("b-sdp", {"zero": 1}, "llama-tiny")
    _step(rank, opt, "llama-tiny")
    assert isinstance(rank, subnetdp.SubnetDataParallel)
    subnetdp.save(folder, rank, opt, step=1, keep=1)
    again, opt2 = _build("b-sdp", {"zero": 1}, "llama-tiny")
    assert isinstance(again, subnetdp.SubnetDataParallel)
    subnetdp.load(folder, again, opt2)
    for _ in range(steps):
        _step(again, opt2, "llama-tiny")
    return _weak(rank, opt) + _weak(again, opt2)


def test_a_checkpoint_round_trip_frees_everything() -> None:
    _group(1)
    try:
        with tempfile.TemporaryDirectory() as folder:
            _check_dropped(lambda steps: _round_trip(folder, steps))
    finally:
        dist.destroy_process_group()
