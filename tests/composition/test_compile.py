"""``--compile`` (runtime.compile): every block's forward compiled, composed with the strategy,
activation checkpointing and FSDP.

Oracles: the same steps with and without compile end at the same parameters (aot_eager traces
the same ops as eager: equal up to fp32 rounding); after the first step no graph is compiled
again ([Note: no recompilation]: masks and held sets are fixed), counted by dynamo's counters.
In one process over torch's fake process group (rank 0 of 4: collectives return at once, the
same for both runs), which is enough for the reducer strategies; FSDP, whose all-gathers need
real peers, runs as one worker here and in four worker processes under ``long``; so does
backward masking, whose refresh receives into buffers the fake group never fills.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.testing._internal.distributed.fake_pg import FakeStore

import subnetdp.runtime.compile as compile_mod
from subnetdp import parallelize
from subnetdp.plan import make_plan
from subnetdp.strategy import Composition, RankSpec
from subnetdp.subnet.units import describe_units
from tests.composition.test_fsdp_ac_bf16 import _batch, _meta_model, _plan
from tests.dist.harness import run_workers

STEPS = 3


@pytest.fixture(autouse=True)
def _aot_eager(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(compile_mod, "BACKEND", "aot_eager")  # no C++ compiler needed
    yield
    torch._dynamo.reset()


def _train(strategy: str, comp: Composition, plan: Any, rank: int = 0
           ) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Final local parameters, and dynamo's compiled-graph count after each step."""
    torch._dynamo.reset()
    counters.clear()
    recipe, model = _meta_model()
    rank_model = parallelize(model, adapter=recipe.adapter, strategy=RankSpec.of(strategy, comp),
                             plan=plan, device="cpu", seed=0)
    opt = torch.optim.AdamW(rank_model.parameters(), lr=3e-3)
    graphs = []
    for step in range(STEPS):
        x, y = _batch("llama", rank, step)
        logits = rank_model.model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        graphs.append(counters["stats"]["unique_graphs"])
    state = {k: v.detach().clone() for k, v in rank_model.module.state_dict().items()}
    return state, graphs


def _fake_group() -> None:
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())


CASES = [("b-sdp", {"ac": True}), ("n-sdp", {})]


@pytest.mark.parametrize(("strategy", "opts"), CASES, ids=[f"{s}{opts}" for s, opts in CASES])
def test_compiled_equals_eager_without_recompiling(strategy: str, opts: dict[str, Any]) -> None:
    _fake_group()
    try:
        plan = _plan(strategy) if strategy != "ddp" else None
        eager, _ = _train(strategy, Composition(**opts), plan)
        compiled, graphs = _train(strategy, Composition(compile=True, **opts), plan)
    finally:
        dist.destroy_process_group()
    assert graphs[0] >= 1 and graphs[-1] == graphs[0], graphs  # compiled, then reused
    assert not counters["recompiles"]
    assert compiled.keys() == eager.keys()  # no name changed (no _orig_mod)
    for key, ref in eager.items():
        torch.testing.assert_close(compiled[key], ref, rtol=1e-5, atol=1e-6, msg=key)


def _pairs(rank: int, world: int, cases: list[tuple[str, dict[str, Any], Any]]) -> list[Any]:
    """Per case: (eager, compiled, graph counts); DTensor shards as their local tensors."""
    out = []
    for strategy, opts, plan in cases:
        eager, _ = _train(strategy, Composition(**opts), plan, rank)
        compiled, graphs = _train(strategy, Composition(compile=True, **opts), plan, rank)
        out.append([{k: v.to_local() if hasattr(v, "to_local") else v for k, v in s.items()}
                    for s in (eager, compiled)] + [graphs])
    return out


def _check(results: list[Any]) -> None:
    for per_rank in results:
        for eager, compiled, graphs in per_rank:
            assert graphs[0] >= 1 and graphs[-1] == graphs[0], graphs
            assert compiled.keys() == eager.keys()
            for key, ref in eager.items():
                torch.testing.assert_close(compiled[key], ref, rtol=1e-5, atol=1e-6)


def test_compile_composes_with_ddp_and_with_fsdp_one_worker() -> None:
    fsdp_ac = {"fsdp": True, "ac": True}
    _check(run_workers(_pairs, 1, [("ddp", {"ac": True}, None),
                                   ("b-sdp", fsdp_ac, _one_worker_plan())]))


def _one_worker_plan() -> Any:
    recipe, model = _meta_model()
    units, shared = describe_units(model, recipe.adapter)
    return make_plan(world=1, units=units, coverage=1.0, shared_size=shared)


@pytest.mark.long
@pytest.mark.parametrize("strategy", ["b-sdp", "bb-sdp", "n-sdp"])
def test_compile_composes_with_fsdp_and_ac_four_workers(strategy: str) -> None:
    _check(run_workers(_pairs, 4, [(strategy, {"fsdp": True, "ac": True}, _plan(strategy))]))
