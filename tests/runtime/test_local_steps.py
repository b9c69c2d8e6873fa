"""Local steps on holder groups (SDP x DiLoCo, runtime.local_steps) against an independent
single-process reference: N virtual workers, each with its own full-model copy and its own
AdamW, train H steps on their subnetworks (tests/dist/reference.py's masking, no subnetdp
runtime); the pseudo-gradients are then averaged by hand over each element's holders and
``torch.optim.SGD(nesterov=True)`` takes the outer step. Also: the counted bytes equal the
plan's analytic ones (at fp32 and bf16, whole and streamed in fragments)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from subnetdp import parallelize
from subnetdp.plan import make_plan, worker_bytes
from subnetdp.runtime.local_steps import MOMENTUM, LocalSteps, due_fragments, fragments_of
from subnetdp.subnet.build import build_full_model
from subnetdp.subnet.units import describe_units
from tests.dist.harness import run_workers
from tests.dist.neuron_ref import lm_loss, small_batch, small_llama, small_plan
from tests.dist.reference import VirtualWorkers, assert_pieces_match
from tests.dist.toy import TOY_ADAPTER, Toy, toy_batch, toy_loss

pytestmark = pytest.mark.dist
SEED, EVERY, STEPS, MID = 7, 4, 8, 6  # two outer steps; MID is inside the second window
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _case(strategy: str) -> tuple[Any, Any, Any, Any]:
    """(meta model, adapter, batch(w, step), loss) of a case."""
    if strategy != "n-sdp":
        with torch.device("meta"):
            return Toy(), TOY_ADAPTER, toy_batch, toy_loss
    from subnetdp.models import get_recipe

    return small_llama(), get_recipe("llama-tiny").adapter, small_batch, lm_loss


def _plan(strategy: str) -> Any:
    if strategy == "n-sdp":
        return small_plan(4, 0.5, groups=4)
    with torch.device("meta"):
        units, shared = describe_units(Toy(), TOY_ADAPTER)
    return make_plan(world=4, units=units, coverage=1.0 if strategy == "ddp" else 0.5,
                     shared_size=shared)


def _train(rank: int, world: int, strategy: str, plan: Any, fragments: int = 1,
           dtype: torch.dtype | None = None) -> dict[str, Any]:
    model, adapter, batch, loss = _case(strategy)
    sdp = parallelize(model, adapter=adapter, strategy=strategy, plan=plan, seed=SEED)
    opt = _adamw(sdp.parameters())
    outer = LocalSteps(sdp.sync_layout(), plan, opt, sdp.comm_stats, rank=rank, every=EVERY,
                       fragments=fragments, dtype=dtype)
    out: dict[str, Any] = {"bytes": []}
    for step in range(1, STEPS + 1):
        x, y = batch(rank, step)
        with outer.inner(sdp.model):
            loss(sdp.model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        outer.after_step()
        out["bytes"].append(sdp.comm_stats.last_step_bytes)
        if step == MID:
            out["mid"] = sdp.shard_state(owned_only=False)
    out["final"] = sdp.shard_state(owned_only=False)
    out["momentum"] = sdp.shard_state(
        {k: opt.state[p][MOMENTUM] for p, k, _ in sdp.param_places()}, owned_only=False)
    return out


def _reference(strategy: str, plan: Any) -> dict[str, Any]:
    """The algorithm by hand, one process: each virtual worker's copy, its AdamW on what it
    holds, the pseudo-gradient averaged over holders, torch's Nesterov SGD as the outer step."""
    meta, adapter, batch, loss = _case(strategy)
    full = build_full_model(meta, adapter, seed=SEED)
    copies = [copy.deepcopy(full) for _ in range(plan.world)]
    workers = [VirtualWorkers(m, adapter, plan, strategy) for m in copies]
    names = [n for n, _ in full.named_parameters()]
    masks = [{n: workers[w].param_mask(w, n, p) for n, p in full.named_parameters()}
             for w in range(plan.world)]
    inner = [_adamw(m.parameters()) for m in copies]
    anchors = [nn.Parameter(p.detach().clone()) for p in full.parameters()]
    outer = torch.optim.SGD(anchors, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    mid: list[dict[str, torch.Tensor]] = []
    for step in range(1, STEPS + 1):
        for w, m in enumerate(copies):
            with workers[w].as_worker(w):
                x, y = batch(w, step)
                loss(m(x), y).backward()
            before = [p.detach().clone() for p in m.parameters()]
            inner[w].step()
            inner[w].zero_grad(set_to_none=True)
            with torch.no_grad():  # what a worker does not hold, it does not have: unchanged
                for n, p, b in zip(names, m.parameters(), before, strict=True):
                    p.copy_(torch.where(masks[w][n].bool(), p, b))
        if step == MID:
            mid = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in copies]
        if step % EVERY:
            continue
        for i, (n, a) in enumerate(zip(names, anchors, strict=True)):
            ps = [list(m.parameters())[i] for m in copies]
            total = sum((a.detach() - p.detach()) * masks[w][n] for w, p in enumerate(ps))
            a.grad = total / sum(masks[w][n] for w in range(plan.world))
        outer.step()
        with torch.no_grad():
            for m in copies:
                for p, a in zip(m.parameters(), anchors, strict=True):
                    p.copy_(a)
    return {"final": dict(zip(names, [a.detach() for a in anchors], strict=True)),
            "momentum": {n: outer.state[a]["momentum_buffer"]
                         for n, a in zip(names, anchors, strict=True)},
            "mid": mid}


@pytest.mark.parametrize("strategy", ["ddp", "b-sdp", "n-sdp"])
def test_four_processes_match_the_hand_written_algorithm(strategy: str) -> None:
    plan = _plan(strategy)
    results = run_workers(_train, 4, strategy, plan)
    ref = _reference(strategy, plan)
    tol = {"atol": 2e-5, "rtol": 1e-4}
    for rank, res in enumerate(results):
        assert assert_pieces_match(res["final"], ref["final"], **tol) > 0
        assert assert_pieces_match(res["momentum"], ref["momentum"], **tol) > 0
        # mid-window every worker trained alone: its copy is its own, not its peers'
        assert assert_pieces_match(res["mid"], ref["mid"][rank], **tol) > 0
        # gradients never crossed workers; each sync sent the plan's per-step bytes
        analytic = worker_bytes(plan, rank).allreduce_payload
        assert res["bytes"] == [0, 0, 0, analytic] * 2
    # holders that trained apart differ mid-window, and agree after the sync (ddp: DiLoCo)
    shared = "norm.weight"  # the final norm: every worker holds it
    assert not torch.equal(results[0]["mid"][shared], results[1]["mid"][shared])
    assert torch.equal(results[0]["final"][shared], results[1]["final"][shared])


def test_streamed_fragments_and_bf16_send_the_analytic_bytes() -> None:
    """F = 2 fragments sync at staggered steps and together send one window's bytes; bf16
    halves them. Counted per collective by the run, against the plan's analytic figure."""
    plan = _plan("b-sdp")
    streamed = run_workers(_train, 4, "b-sdp", plan, 2, torch.bfloat16)
    for rank, res in enumerate(streamed):
        analytic = worker_bytes(plan, rank, param_bytes=2).allreduce_payload
        per_step = res["bytes"]
        assert per_step[0] == per_step[2] == 0 and per_step[1] > 0 and per_step[3] > 0
        assert sum(per_step[:EVERY]) == analytic
        assert per_step[EVERY:] == per_step[:EVERY]


def test_fragments_cut_by_bytes_and_sync_staggered() -> None:
    with torch.device("meta"):
        from subnetdp.subnet.pieces import full_pieces, reduction_order

        order = reduction_order(full_pieces(Toy(), [f"blocks.{i}" for i in range(8)]))
    cut = fragments_of(order, 4)
    assert [p for f in cut for p in f] == list(order)  # consecutive runs of the global order
    sizes = [sum(p.numel for p in f) for f in cut]
    assert max(sizes) < 2 * min(sizes)
    assert [due_fragments(s, 8, 4) for s in range(1, 9)] == [
        [], [0], [], [1], [], [2], [], [3]]
    assert [due_fragments(s, 4, 1) for s in range(1, 9)] == [[], [], [], [0]] * 2
    with pytest.raises(ValueError, match="multiple of the fragments"):
        LocalSteps(None, None, None, None, rank=0, every=6, fragments=4)  # type: ignore[arg-type]
