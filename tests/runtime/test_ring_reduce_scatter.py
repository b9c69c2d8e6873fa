"""The gloo ring reduce-scatter (runtime.ring) against gloo's built-in one, on inputs laid
out as FSDP2 lays them out (uneven parameters padded to a multiple of the group size)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    _get_dim0_padded_size,
    foreach_reduce_scatter_copy_in,
)

from subnetdp import torch_compat
from subnetdp.estimate.cluster import DEVICES, Cluster, Link
from subnetdp.estimate.spec import BenchSpec, build_rank, lm_step
from subnetdp.estimate.steptime import collectives, predict_step
from subnetdp.models import get_recipe
from subnetdp.runtime.ring import RingReduceScatter
from subnetdp.subnet.costs import recipe_costs
from tests.dist.harness import run_workers

# uneven first dims: FSDP2 pads every parameter's dim 0 to a multiple of h
SHAPES = [(5, 3), (7,), (1, 4), (10, 2)]


def _flat(grads: list[torch.Tensor], h: int, dtype: torch.dtype) -> torch.Tensor:
    numel = sum(_get_dim0_padded_size(g.size(), h).numel() for g in grads)
    flat = torch.empty(numel, dtype=dtype)
    foreach_reduce_scatter_copy_in([g.to(dtype) for g in grads], flat, h)
    return flat


def _compare(rank: int, world: int) -> list[tuple[int, str, str, torch.Tensor, torch.Tensor]]:
    out = []
    for members in ([0, 1], [1, 2, 3], list(range(world))):  # h = 2, 3, 4
        group = dist.new_group(members)  # every rank takes part in creating every group
        if rank not in members:
            continue
        h = len(members)
        g = torch.Generator().manual_seed(rank)
        grads = [torch.randn(s, generator=g) * 10 ** (i - 2) for i, s in enumerate(SHAPES)]
        for dtype in (torch.float32, torch.bfloat16):
            for name, op in (("avg", dist.ReduceOp.AVG), ("sum", dist.ReduceOp.SUM)):
                flat = _flat(grads, h, dtype)
                before = flat.clone()
                ring, ref = (torch.full((flat.numel() // h,), float("nan"), dtype=dtype)
                             for _ in range(2))
                RingReduceScatter()(ring, flat, group, op)
                assert torch.equal(flat, before)  # the input is left as it was
                torch_compat.reduce_scatter_single(ref, flat, op=op, group=group)
                out.append((h, str(dtype), name, ring, ref))
    return out


def test_ring_matches_gloo_reduce_scatter() -> None:
    results = run_workers(_compare, 4)
    seen = set()
    for per_rank in results:
        for h, dtype, op, ring, ref in per_rank:
            seen.add((h, dtype, op))
            if h == 2:  # one addition per element, which commutes: bit for bit
                assert torch.equal(ring, ref), (h, dtype, op)
            else:  # h-1 additions in another order than gloo's: fp32 (bf16) rounding apart
                tol = 1e-6 if dtype == "torch.float32" else 2e-2
                torch.testing.assert_close(ring, ref, rtol=tol, atol=tol * 10), (h, dtype, op)
    assert {h for h, _, _ in seen} == {2, 3, 4}


MODEL = (("dim", 30), ("ffn_hidden", 44), ("max_seq_len", 16), ("n_heads", 3),
         ("n_layers", 2), ("vocab_size", 61))  # dims not multiples of 4: padded shards


def _train(rank: int, world: int) -> dict[str, tuple[list[float], int, int]]:
    calls = {"ring": 0, "async gather": 0}
    ring_call = RingReduceScatter.__call__
    # FSDP2 calls torch 2.13's name where it exists, all_gather_into_tensor before
    gather_name = "all_gather_single" if hasattr(dist, "all_gather_single") else \
        "all_gather_into_tensor"
    gather_any: Any = getattr(dist, gather_name)

    def counted(self: RingReduceScatter, *args: Any, **kw: Any) -> Any:
        calls["ring"] += 1
        return ring_call(self, *args, **kw)

    def gather_spy(*args: Any, async_op: bool = False, **kw: Any) -> Any:
        calls["async gather"] += async_op
        return gather_any(*args, async_op=async_op, **kw)

    # forked worker only
    RingReduceScatter.__call__ = counted  # type: ignore[method-assign]
    setattr(dist, gather_name, gather_spy)
    out = {}
    for strategy, fsdp in (("fsdp", False), ("b-sdp", True)):
        for gloo in (True, False):  # ring and async all-gathers, or FSDP2's gloo defaults
            spec = BenchSpec("llama-tiny", strategy, world, 2, 16, coverage=0.5, fsdp=fsdp,
                             model_args=MODEL, ring_reduce_scatter=gloo, async_unshard=gloo)
            built = build_rank(spec)
            g = torch.Generator().manual_seed(rank)
            before = dict(calls)
            losses = [lm_step(built, torch.randint(0, 61, (2, 17), generator=g))
                      for _ in range(3)]
            out[spec.label] = (losses, calls["ring"] - before["ring"],
                               calls["async gather"] - before["async gather"])
    return out


def test_training_with_the_ring_equals_training_without() -> None:
    """fsdp and b-sdp+fsdp train the same with runtime.ring's reduce-scatter and async
    all-gathers as with FSDP2's gloo defaults."""
    results = run_workers(_train, 4)
    off = " (gloo rs) (sync unshard)"
    for per_rank in results:
        assert set(per_rank) == {"fsdp", f"fsdp{off}", "b-sdp+fsdp (C=0.5)",
                                 f"b-sdp+fsdp (C=0.5){off}"}
        for label in ("fsdp", "b-sdp+fsdp (C=0.5)"):
            (ring, rings, asyncs), (gloo, no_rings, no_asyncs) = (per_rank[label],
                                                                  per_rank[label + off])
            # both ran, and only where asked for
            assert rings > 0 and asyncs > 0 and no_rings == no_asyncs == 0
            # three AdamW steps apart only by the reduce-scatters' summation order
            assert ring == pytest.approx(gloo, rel=1e-5)


def test_model_wire_bytes_follow_the_ring() -> None:
    """estimate.steptime on gloo: with the ring FSDP's wire bytes are the counted ring bytes;
    with gloo's reduce-scatter (an all-reduce) its reduce-scatters count twice."""
    tiny = BenchSpec("llama-tiny", "b-sdp", 4, 2, 32, coverage=0.5, fsdp=True,
                     model_args=(("n_layers", 4),))
    cluster = Cluster(1, 4, DEVICES["cpu"], Link(1e6), shared_intra=True)
    colls = collectives(tiny)
    costs = recipe_costs(get_recipe("llama-tiny"), batch=2, seq=32, model_args={"n_layers": 4})
    ring, gloo = (predict_step(s, cluster, rate=1e12, backend="gloo", costs=costs,
                               colls=colls).wire_bytes
                  for s in (tiny, tiny.replace(ring_reduce_scatter=False)))
    assert ring == pytest.approx([sum(c.ring_bytes for c in cs) for cs in colls])
    assert gloo == pytest.approx([sum(c.ring_bytes * (2 if c.kind == "reduce_scatter" else 1)
                                      for c in cs) for cs in colls])
    assert all(g > r for g, r in zip(gloo, ring, strict=True))
