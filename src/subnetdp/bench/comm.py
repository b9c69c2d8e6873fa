"""Analytic communication per rank per step, for every strategy, by collective and by group.

- SDP and DDP: one all-reduce of each held parameter's gradient over its holders (DDP: the
  world); nothing for a unit held alone. Payload is the gradient bytes; ring traffic per rank is
  2·(c−1)/c × payload (``plan.worker_bytes`` gives the totals; here they are split by group).
- FSDP2 (ZeRO-3): per step, every block's parameters are all-gathered twice (forward, and again
  in backward since blocks reshard after forward) and the root's once (FSDP2 keeps the root
  unsharded between forward and backward); every gradient is reduce-scattered once. Payload is
  the unsharded (padded) bytes of each collective; a ring all-gather or reduce-scatter sends
  (c−1)/c × payload per rank. Activation checkpointing adds no collective (the recomputation runs
  while the block is unsharded for backward).

``tests/dist/test_bench_measure.py`` checks SDP and DDP against the bytes counted by instrumented
runs; the FSDP figures are not checked against a count yet.
"""

from __future__ import annotations

import math
from typing import Any

from subnetdp.bench.strategies import BenchSpec, make_bench_plan, meta_model
from subnetdp.metrics.comm import allreduce_record, group_key
from subnetdp.plan import Plan
from subnetdp.subnet.units import unit_modules


def analytic_comm(spec: BenchSpec) -> list[dict[str, Any]]:
    """Per rank, the same record shape as ``metrics.comm.comm_record``."""
    recipe, meta = meta_model(spec)
    if spec.strategy.startswith("fsdp"):
        return [_fsdp_rank(spec, meta, recipe) for _ in range(spec.world)]
    plan = make_bench_plan(spec, meta, recipe)
    return [_allreduce_rank(plan, r, spec.param_bytes) for r in range(spec.world)]


def _allreduce_rank(plan: Plan, rank: int, width: int) -> dict[str, Any]:
    groups: dict[tuple[int, ...], int] = {}
    if plan.world > 1:
        groups[tuple(range(plan.world))] = plan.shared_size * width
    for u in plan.held_units(rank):
        holders = tuple(plan.holders(u))
        if len(holders) >= 2:
            groups[holders] = groups.get(holders, 0) + plan.units[u].size * width
    return allreduce_record({k: float(v) for k, v in groups.items()})


def _padded_numel(shape: tuple[int, ...], world: int) -> int:
    if not shape:
        return world
    return math.ceil(shape[0] / world) * world * math.prod(shape[1:])


def _fsdp_rank(spec: BenchSpec, meta: Any, recipe: Any) -> dict[str, Any]:
    w, width = spec.world, spec.param_bytes
    blocks = {name for name, _ in unit_modules(meta, recipe.adapter)}
    block_elems = root_elems = 0
    for name, p in meta.named_parameters():
        n = _padded_numel(tuple(p.shape), w)
        if any(name.startswith(b + ".") for b in blocks):
            block_elems += n
        else:
            root_elems += n
    share = (w - 1) / w if w > 1 else 0.0
    gather = float((2 * block_elems + root_elems) * width) if w > 1 else 0.0
    scatter = float((block_elems + root_elems) * width) if w > 1 else 0.0
    by_coll = {"all_gather": {"payload": gather, "ring": share * gather},
               "reduce_scatter": {"payload": scatter, "ring": share * scatter}}
    payload, ring = gather + scatter, share * (gather + scatter)
    return {
        "comm/bytes_per_step": payload,
        "comm/ring_bytes_per_step": ring,
        "by_collective": by_coll if w > 1 else {},
        "by_group": {group_key(tuple(range(w))): {"size": w, "payload": payload, "ring": ring}}
        if w > 1 else {},
    }


def worst_comm(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The rank that sends the most (ring traffic), which sets the pace of a step."""
    return max(records, key=lambda r: r["comm/ring_bytes_per_step"])
