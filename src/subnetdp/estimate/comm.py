"""Analytic communication per rank per step, for every strategy, by collective and by group.

- SDP and DDP: one all-reduce of each held parameter's gradient over its holders (DDP: the
  world); nothing for a unit held alone. Payload is the gradient bytes; ring traffic per rank is
  2·(c−1)/c × payload (``plan.worker_bytes`` gives the totals; here they are split by group).
  With ZeRO (``zero``, ddp+zero1/2) the all-reduce becomes a reduce-scatter of the gradient and
  an all-gather of the updated parameters over the same group: the same payload, each sending
  (c−1)/c of it, together the same 2·(c−1)/c.
- FSDP2 (ZeRO-3): per step, every block's parameters are all-gathered twice (forward, and again
  in backward since blocks reshard after forward) and the root's once (FSDP2 keeps the root
  unsharded between forward and backward); every gradient is reduce-scattered once. Payload is
  the unsharded (padded) bytes of each collective; a ring all-gather or reduce-scatter sends
  (c−1)/c × payload per rank. Activation checkpointing adds no collective (the recomputation runs
  while the block is unsharded for backward).
- SDP composed with FSDP2 (``b-sdp+fsdp``, ``bb-sdp+fsdp``): the same per held unit, over its
  holder group instead of the world (its mesh): all-gathered twice and reduce-scattered once,
  padded to ``ceil(d0 / c) · c`` rows for c holders; nothing for a unit held alone. The shared
  parameters are the root's: gathered once and reduce-scattered once over the world. (Backward
  masking's refresh is point to point and, as for plain bb-sdp, not part of these figures.)
- Mixed precision (``bf16-mixed``): all-gathers carry the compute dtype (bf16), reductions the
  master dtype (fp32: DDP/SDP gradients are fp32; FSDP's ``reduce_dtype`` is fp32).

Ranks with the same plan row (the same held units, so the same groups) get one record object,
shared: the cost grows with the plan's distinct rows, not with the world (a cluster of
thousands of ranks has a handful of rows). The records are read-only.

``tests/estimate/test_measured.py`` checks SDP and DDP against the bytes counted by instrumented
runs, and SDP+FSDP against the per-group traffic the wrapper reports (from its FSDP modules'
sizes, unpadded: within 1%); the FSDP2 baselines' figures are not checked against a count.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

from subnetdp.estimate.memory import fsdp_unit_shapes
from subnetdp.estimate.spec import BenchSpec, make_bench_plan, meta_model
from subnetdp.metrics.comm import allreduce_record, group_key, ring_bytes
from subnetdp.plan import Plan
from subnetdp.subnet.units import unit_modules

_T = TypeVar("_T")


def analytic_comm(spec: BenchSpec, plan: Plan | None = None) -> list[dict[str, Any]]:
    """Per rank, the same record shape as ``metrics.comm.comm_record`` (one shared object per
    plan row); ``plan``: the spec's, when the caller has it."""
    elems = gather_scatter_elems(spec, plan)
    if elems is not None:
        records: dict[int, dict[str, Any]] = {}
        return [records.get(id(e)) or records.setdefault(id(e), _gather_scatter_record(spec, e))
                for e in elems]
    recipe, meta = meta_model(spec, check_seq=False)  # gradient traffic: any sequence
    if not spec.is_sdp and spec.composition().zero == 1:
        return [_zero_redundancy_rank(spec, meta)] * spec.world
    plan = plan if plan is not None else make_bench_plan(spec, meta, recipe)
    collective = "reduce_scatter+all_gather" if spec.composition().zero else "all_reduce"
    return by_row(plan, lambda r: _allreduce_rank(plan, r, spec.reduce_bytes, collective))


def by_row(plan: Plan, per_rank: Callable[[int], _T]) -> list[_T]:
    """``per_rank(r)`` for every rank, computed once per distinct plan row (the ranks holding
    the same units) and shared by the ranks of that row."""
    seen: dict[tuple[bool, ...], _T] = {}
    return [seen[row] if row in seen else seen.setdefault(row, per_rank(r))
            for r, row in enumerate(plan.matrix)]


def gather_scatter_elems(spec: BenchSpec, plan: Plan | None = None,
                         ) -> list[dict[tuple[int, ...], tuple[int, int]]] | None:
    """FSDP anywhere: per rank, per group, the (all-gathered, reduce-scattered) elements of one
    step (``_gather_scatter_record`` turns them into bytes; one shared object per plan row);
    None without FSDP."""
    if not spec.uses_fsdp:
        return None
    recipe, meta = meta_model(spec, check_seq=False)
    if not spec.is_sdp:  # the FSDP baselines
        return [_fsdp_elems(spec, meta, recipe)] * spec.world
    plan = plan if plan is not None else make_bench_plan(spec, meta, recipe)
    shapes = fsdp_unit_shapes(meta, recipe.adapter, plan, spec.strategy_value)
    sizes: dict[tuple[int, int], int] = {}  # (unit, holders): padded elements
    return by_row(plan, lambda r: _sdp_fsdp_elems(spec, plan, shapes, r, sizes))


def _allreduce_rank(plan: Plan, rank: int, width: int,
                    collective: str = "all_reduce") -> dict[str, Any]:
    groups: dict[tuple[int, ...], int] = {}
    if plan.world > 1:
        groups[tuple(range(plan.world))] = plan.shared_size * width
    for u in plan.held_units(rank):
        holders = tuple(plan.holders(u))
        if len(holders) >= 2:
            groups[holders] = groups.get(holders, 0) + plan.units[u].size * width
    return allreduce_record({k: float(v) for k, v in groups.items()}, collective=collective)


def _zero_redundancy_rank(spec: BenchSpec, meta: Any) -> dict[str, Any]:
    """ddp+zero1 (torch DDP + ZeroRedundancyOptimizer): DDP's all-reduce of every gradient,
    then every parameter broadcast from the rank that updated it ((w−1)/w of it per rank in a
    ring)."""
    w = spec.world
    if w < 2:
        return allreduce_record({})
    everyone = tuple(range(w))
    payload = float(sum(p.numel() for p in meta.parameters()) * spec.param_bytes)
    rec = allreduce_record({everyone: payload})
    sent = (w - 1) / w * payload
    group = rec["by_group"][group_key(everyone)]
    group.update(payload=2 * payload, ring=group["ring"] + sent)
    rec["by_collective"]["broadcast"] = {"payload": payload, "ring": sent}
    rec["comm/bytes_per_step"] += payload
    rec["comm/ring_bytes_per_step"] += sent
    return rec


def _padded_numel(shape: tuple[int, ...], world: int) -> int:
    if not shape:
        return world
    return math.ceil(shape[0] / world) * world * math.prod(shape[1:])


def _fsdp_elems(spec: BenchSpec, meta: Any,
                recipe: Any) -> dict[tuple[int, ...], tuple[int, int]]:
    w = spec.world
    blocks = {name for name, _ in unit_modules(meta, recipe.adapter)}
    block_elems = root_elems = 0
    for name, p in meta.named_parameters():
        n = _padded_numel(tuple(p.shape), w)
        if any(name.startswith(b + ".") for b in blocks):
            block_elems += n
        else:
            root_elems += n
    everyone = tuple(range(w))
    return {everyone: (2 * block_elems + root_elems, block_elems + root_elems)}


def _sdp_fsdp_elems(
    spec: BenchSpec, plan: Plan,
    unit_shapes: tuple[list[list[tuple[int, ...]]], list[tuple[int, ...]]], rank: int,
    sizes: dict[tuple[int, int], int],
) -> dict[tuple[int, ...], tuple[int, int]]:
    """Per group: (gathered elements, reduce-scattered elements) of one step on ``rank``:
    blocks are gathered twice (forward, and again for backward after resharding), n-sdp's
    parts once (kept gathered through backward, [Note: neuron groups] in runtime.fsdp).
    ``sizes``: the padded elements of (unit, holder count), shared by the ranks."""
    shapes, shared_shapes = unit_shapes  # fsdp_unit_shapes
    gathers = 1 if spec.strategy_value.fsdp_keeps_gathered else 2
    everyone = tuple(range(plan.world))
    shared = sum(_padded_numel(s, plan.world) for s in shared_shapes)
    elems: dict[tuple[int, ...], tuple[int, int]] = {everyone: (shared, shared)}
    for u in plan.held_units(rank):
        holders = plan.holders(u)
        if len(holders) < 2:
            continue
        if (u, len(holders)) not in sizes:
            sizes[u, len(holders)] = sum(_padded_numel(s, len(holders)) for s in shapes[u])
        n = sizes[u, len(holders)]
        g, s = elems.get(holders, (0, 0))
        elems[holders] = (g + gathers * n, s + n)
    return elems


def _gather_scatter_record(spec: BenchSpec,
                           elems: dict[tuple[int, ...], tuple[int, int]]) -> dict[str, Any]:
    """The comm record of all-gathers and reduce-scatters of ``elems[group]`` = (gathered,
    reduce-scattered) elements per step; a ring collective sends (c−1)/c × payload per rank."""
    by_group: dict[str, Any] = {}
    gather = scatter = gather_ring = scatter_ring = 0.0
    for ranks, (g, s) in sorted(elems.items()):
        c = len(ranks)
        if c < 2:
            continue
        gp, sp = float(g * spec.gather_bytes), float(s * spec.reduce_bytes)
        share = ring_bytes(1.0, c) / 2  # (c - 1) / c
        gather, scatter = gather + gp, scatter + sp
        gather_ring, scatter_ring = gather_ring + share * gp, scatter_ring + share * sp
        by_group[group_key(ranks)] = {"size": c, "payload": gp + sp,
                                      "ring": share * (gp + sp)}
    by_coll = {"all_gather": {"payload": gather, "ring": gather_ring},
               "reduce_scatter": {"payload": scatter, "ring": scatter_ring}} if by_group else {}
    return {
        "comm/bytes_per_step": gather + scatter,
        "comm/ring_bytes_per_step": gather_ring + scatter_ring,
        "by_collective": by_coll,
        "by_group": by_group,
    }


def worst_comm(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The rank that sends the most (ring traffic), which sets the pace of a step."""
    return max(records, key=lambda r: r["comm/ring_bytes_per_step"])
