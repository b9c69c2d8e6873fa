"""``parallelize``: the one builder of a rank's model, its fair DDP, and the double-wrap guard."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from subnetdp.models import get_recipe
from subnetdp.parallelize import parallelize
from subnetdp.strategy import NAMES, Composition, get_strategy
from subnetdp.subnet.planning import plan_for
from tests.dist.harness import run_workers

pytestmark = pytest.mark.dist

ARGS = {"n_layers": 4, "dim": 32, "n_heads": 2, "n_kv_heads": 2, "vocab_size": 64,
        "ffn_hidden": 64, "max_seq_len": 16}


def _rank(world: int, strategy: str, comp: Composition) -> Any:
    recipe = get_recipe("llama-tiny")
    with torch.device("meta"):
        model = recipe.build_model(**ARGS)
    plan = plan_for(model, recipe.adapter, get_strategy(strategy), world=world, coverage=0.5)
    return parallelize(model, adapter=recipe.adapter, strategy=strategy, plan=plan, comp=comp)


def _step(rank: Any, seed: int) -> torch.Tensor:
    x = torch.randint(0, ARGS["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(seed))
    logits = rank.model(x[:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    return loss.detach()


def _ddp_buckets(r: int, world: int, bucket_view: bool) -> dict[str, Any]:
    rank = _rank(world, "ddp", Composition(ddp_bucket_view=bucket_view))
    _step(rank, r)
    buffers = rank.grad_buffers()
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers]
    grads = [p.grad for p in rank.parameters()]
    inside = [any(lo <= g.data_ptr() < hi for lo, hi in spans) for g in grads if g is not None]
    return {"view": rank.model.gradient_as_bucket_view, "inside": inside,
            "bucket_elems": sum(b.numel() for b in buffers),
            "param_elems": sum(p.numel() for p in rank.parameters())}


@pytest.mark.parametrize("bucket_view", [True, False])
def test_ddp_is_the_fair_one_unless_asked(bucket_view: bool) -> None:
    """The default DDP keeps one gradient copy: every ``.grad`` lives in a bucket that
    ``grad_buffers`` reports (so memory tracking counts it); torch's default buckets are a
    second copy beside ``.grad``."""
    for res in run_workers(_ddp_buckets, 2, bucket_view):
        assert res["view"] is bucket_view
        assert res["bucket_elems"] == res["param_elems"]
        assert all(res["inside"]) if bucket_view else not any(res["inside"])


def _every_strategy(r: int, world: int) -> dict[str, Any]:
    out = {}
    for name in NAMES:
        rank = _rank(world, name, Composition())
        loss = _step(rank, r)
        norm = rank.clip_grad_norm_(1.0)
        state = rank.full_state_dict()
        out[name] = {"loss": float(loss), "norm": float(norm),
                     "keys": sorted(state) if state is not None else None,
                     "held": rank.params_held, "trained": rank.params_trained,
                     "places": len(rank.param_places()),
                     "params": len(list(rank.parameters())),
                     "bytes": rank.comm_stats.total_bytes}
    return out


def test_every_strategy_has_one_rank_interface() -> None:
    """The same calls work on every strategy's rank model; the full state has the full model's
    keys on rank 0 only; counted bytes are positive; the first step's loss is the same for
    every strategy that runs the full model forward (same name-seeded init)."""
    results = run_workers(_every_strategy, 2)
    recipe = get_recipe("llama-tiny")
    with torch.device("meta"):
        keys = sorted(recipe.build_model(**ARGS).state_dict())
    for r, res in enumerate(results):
        for name, v in res.items():
            assert v["keys"] == (keys if r == 0 else None), name
            assert v["places"] == v["params"] and v["bytes"] > 0, name
            assert v["trained"] <= v["held"], name
        # ddp and backward masking run the same full model on the same batch
        assert res["bb-sdp"]["loss"] == pytest.approx(res["ddp"]["loss"], abs=1e-6)
        assert res["nb-sdp"]["loss"] == pytest.approx(res["ddp"]["loss"], abs=1e-6)
    assert results[0]["b-sdp"]["held"] < results[0]["ddp"]["held"]


def _wrap_in_ddp(r: int, world: int) -> str:
    rank = _rank(world, "b-sdp", Composition())
    try:
        nn.parallel.DistributedDataParallel(rank.model)
    except TypeError as e:
        # nothing was broadcast: this rank's blocks are still its own
        return str(e)
    return "wrapped"


def test_wrapping_in_ddp_is_refused_with_what_to_do() -> None:
    for message in run_workers(_wrap_in_ddp, 2):
        assert "do not wrap it in DistributedDataParallel" in message
        assert "accelerator.prepare()" in message


def _pure_bf16_images(r: int, world: int) -> dict[str, Any]:
    recipe = get_recipe("resnet18-fmnist")
    x = torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(r))  # float32
    out = {}
    for name, comp in [("ddp", Composition(dtype="bf16")), ("n-sdp", Composition(dtype="bf16")),
                       ("b-sdp", Composition(dtype="bf16", fsdp=True))]:
        with torch.device("meta"):
            model = recipe.build_model(width=4)
        plan = plan_for(model, recipe.adapter, get_strategy(name), world=world, coverage=0.5)
        rank = parallelize(model, adapter=recipe.adapter, strategy=name, plan=plan, comp=comp)
        logits = rank.model(x)
        logits.float().sum().backward()
        out[name] = (logits.dtype, {p.grad.dtype for p in rank.parameters()
                                    if p.grad is not None})
    return out


def test_pure_bf16_casts_a_float_batch() -> None:
    """``--dtype bf16`` image runs: the float32 batch is cast to the bf16 weights' dtype (it
    failed in the first conv, "Input type (torch.FloatTensor) and weight type
    (CPUBFloat16Type) should be the same"), under DDP, SDP and FSDP alike."""
    for res in run_workers(_pure_bf16_images, 2):
        for name, (logits, grads) in res.items():
            assert logits == torch.bfloat16 and grads == {torch.bfloat16}, name
