"""Peak memory of one training step at full scale, without the hardware.

``estimate_memory(spec)`` runs real training steps of ``spec`` for one rank at a time inside
``FakeTensorMode`` (tensors carry shapes and dtypes, no storage) over torch's *fake* process
group (collectives return at once, so one process plays any rank of any world), under
``MemTracker``, which categorises every live storage as parameter, buffer, gradient, optimizer
state, activation or temporary. The numbers are therefore those of the real code path
(subnetwork materialisation, reducer buckets, FSDP2 all-gathers, checkpoint recomputation), not a
formula; what they do not include is allocator rounding/caching. Communicator buffers, which
NCCL allocates outside torch, are the ``communicators`` category: this rank's communicators
(``plan.communicators``) x ``spec.comm_mem_mb`` ([Note: communicator memory]).

Steady state: the first step allocates optimizer state and reducer buckets; the reported peak is
that of the *second* step (the tracker's running peak is restarted between the two).

SDP ranks hold different units, so every distinct row of the plan (by the multiset of unit
sizes held; composed with FSDP, by the multiset of (unit size, holders, this rank's shard) and
its shard of the shared parameters) is estimated separately; ranks with the same row share the
result. Baselines are symmetric (FSDP2's rank 0 holds the largest, padded, shard), so rank 0
stands for all.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from subnetdp.estimate.communicators import communicator_bytes
from subnetdp.estimate.spec import (
    BenchSpec,
    Built,
    build_rank,
    example_batch,
    lm_step,
    make_bench_plan,
    meta_model,
    optimizer_states,
    train_step,
    vocab_size,
)
from subnetdp.metrics.memory import CATEGORIES
from subnetdp.parallelize import storage_dtype
from subnetdp.plan import Plan, worker_bytes
from subnetdp.plan.communicators import communicators_per_rank
from subnetdp.strategy import HOLDER_REDUCER, Strategy
from subnetdp.subnet.adapter import UnitAdapter
from subnetdp.subnet.match import match_plan
from subnetdp.subnet.pieces import Piece, full_pieces
from subnetdp.subnet.units import unit_modules

GiB = float(1 << 30)


@dataclass(frozen=True)
class RankEstimate:
    """One rank's step: ``peak_bytes`` with its ``breakdown`` (categories at the peak), and
    ``state``: parameter, gradient and optimizer bytes this rank holds after ``opt.step()``
    (exact, for comparison with ``analytic``)."""

    rank: int
    peak_bytes: int
    breakdown: dict[str, int]
    state: dict[str, int]
    analytic: dict[str, int]
    same_as: int | None = None  # the rank whose estimate this copies (identical plan row)


@dataclass
class MemoryEstimate:
    spec: BenchSpec
    per_rank: list[RankEstimate] = field(default_factory=list)

    @property
    def worst(self) -> RankEstimate:
        return max(self.per_rank, key=lambda r: (r.peak_bytes, -r.rank))

    @property
    def peak_bytes(self) -> int:
        return self.worst.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        w = self.worst
        return {
            "spec": asdict(self.spec),
            "label": self.spec.label,
            "peak_bytes": w.peak_bytes,
            "memory/peak_active(GiB)": w.peak_bytes / GiB,
            "worst_rank": w.rank,
            "breakdown": dict(w.breakdown),
            "state": dict(w.state),
            "analytic": dict(w.analytic),
            "per_rank": [asdict(r) for r in self.per_rank],
        }


def estimate_memory(spec: BenchSpec, *, ranks: list[int] | None = None) -> MemoryEstimate:
    """Estimate ``spec`` for ``ranks`` (default: every rank, one run per distinct plan row)."""
    if dist.is_initialized():
        raise RuntimeError("estimate_memory needs a process without a process group: it "
                           "creates the fake one itself; run it outside distributed workers")
    recipe, meta = meta_model(spec)
    plan = make_bench_plan(spec, meta, recipe) if spec.is_sdp else None
    wanted = list(range(spec.world)) if ranks is None else list(ranks)
    # rank -> representative rank with the same row (baselines: rank 0 for everyone)
    sigs = _row_signatures(spec, plan) if plan is not None else [()] * spec.world
    rep = {r: sigs.index(sigs[r]) for r in wanted}
    done: dict[int, RankEstimate] = {}
    for r in sorted(set(rep.values())):
        done[r] = _estimate_rank(spec, r)
    out = MemoryEstimate(spec)
    comms = communicators_per_rank(plan) if plan is not None else [1] * spec.world
    for r in wanted:
        base = done[rep[r]]
        analytic = base.analytic if r == base.rank else analytic_state(spec, r, plan)
        # communicators differ between ranks of the same row: added per rank, after the step
        comm = communicator_bytes(comms[r], spec.comm_mem_mb, shared=spec.comm_split_shared)
        breakdown = {**base.breakdown, "communicators": comm,
                     "total": base.breakdown["total"] + comm}
        out.per_rank.append(RankEstimate(r, breakdown["total"], breakdown, base.state, analytic,
                                         same_as=None if r == base.rank else base.rank))
    return out


def heaviest_rank(spec: BenchSpec) -> int:
    """The rank holding the most parameters (lowest such rank): the one to estimate when only
    the worst rank matters and rows differ (n-sdp's groups differ by one slot)."""
    if not spec.is_sdp:
        return 0
    recipe, meta = meta_model(spec)
    plan = make_bench_plan(spec, meta, recipe)
    if spec.fsdp:  # most held (activations, gathers), then the largest shards (state)
        layout = FsdpLayout(spec, plan)
        return max(range(plan.world),
                   key=lambda r: (plan.held_size(r), layout.trained_elems(r), -r))
    return max(range(plan.world), key=lambda r: (plan.held_size(r), -r))


def _row_signatures(spec: BenchSpec, plan: Plan) -> list[tuple[Any, ...]]:
    """Per rank, what its estimate depends on; equal signatures, equal estimates."""
    if spec.fsdp:
        layout = FsdpLayout(spec, plan)
        return [layout.signature(r) for r in range(plan.world)]
    sizes = [tuple(sorted(plan.units[u].size for u in plan.held_units(r)))
             for r in range(plan.world)]
    if spec.composition().zero:  # the shards depend on the rank's place in each group
        return [(s, tuple(zero_state(spec, r, plan).values())) for r, s in enumerate(sizes)]
    return list(sizes)


def _estimate_rank(spec: BenchSpec, rank: int) -> RankEstimate:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=spec.world, store=FakeStore())
    try:
        recipe, meta = meta_model(spec)  # real meta tensors: fake mode then allocates fakes
        vocab = vocab_size(spec) if recipe.task == "lm" else None
        with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
            # the reducer compares data_ptr()s, which fake tensors lack (views are attached
            # before forward, so the comparison's outcome does not change the memory)
            warnings.simplefilter("ignore", UserWarning)
            built = build_rank(spec, fake=True, prebuilt=(recipe, meta))
            batch = example_batch(spec, vocab=vocab)
            if recipe.task == "lm":  # one [batch, seq + 1] tensor, sliced inside the step,
                tokens = torch.cat([batch[0], batch[1][:, -1:]], dim=1)  # as bench.step does
                step: Callable[..., Any] = partial(lm_step, built, tokens)
            else:
                step = partial(train_step, built, *batch)
            state: dict[str, int] = {}
            peak = _second_step_peak(built, step, state)
    finally:
        dist.destroy_process_group()
    breakdown = _categories(peak.get(torch.device("cpu"), {}))
    plan = built.plan if spec.is_sdp else None
    return RankEstimate(rank, breakdown["total"], breakdown, state,
                        analytic_state(spec, rank, plan))


def _second_step_peak(built: Built, step: Callable[..., Any], state: dict[str, int]) -> Any:
    from subnetdp.metrics.memory import make_tracker

    tracker = make_tracker()  # copes with backward masking's frozen parameters
    tracker.track_external(*built.rank.tracked_modules(), built.optimizer)
    with tracker:
        step()
        tracker.reset_mod_stats()  # per-module stats refuse a second iteration otherwise
        # MemTracker has no public "reset peak"; restart it exactly as __enter__ starts it.
        tracker._peak_mem_snap = tracker.get_tracker_snapshot()
        tracker._peak_mem = {d: s["Total"] for d, s in tracker._peak_mem_snap.items()}
        step(after_step=lambda: state.update(held_state_bytes(built)))
        peak = tracker.get_tracker_snapshot("peak")
    tracker._WINFO.clear()  # drop the weak references' callbacks now (see metrics.memory)
    return peak


def _categories(snap: dict[Any, int]) -> dict[str, int]:
    from subnetdp.metrics.memory import _breakdown

    return _breakdown(snap) if snap else dict.fromkeys(CATEGORIES, 0)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), or the tensor itself."""
    return getattr(t, "_local_tensor", t)


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def held_state_bytes(built: Built) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state (per-parameter tensors; AdamW's
    scalar step counters excluded; SGD's momentum buffers) this rank holds right now."""
    # Stored parameters (backward masking stores the full model) vs trained ones (gradients).
    stored = list(built.rank.module.parameters())
    params = list(built.rank.parameters())
    from subnetdp.runtime.wrapper import SubnetDataParallel

    if isinstance(built.rank, SubnetDataParallel) and built.rank.zero:
        # ZeRO (runtime.zero): the gradients are the reducer's buffers and shards, and
        # narrowed pieces' slices have copies of their own
        stored += built.rank.zero_copies()
        grads = sum(_nbytes(g) for g in built.rank.grad_buffers())
    else:
        grads = sum(_nbytes(p.grad) for p in params if p.grad is not None)
    opt_bytes = 0
    for st in built.optimizer.state.values():
        opt_bytes += sum(_nbytes(v) for v in st.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {
        "params": sum(_nbytes(p) for p in stored),
        "grads": grads,
        "optimizer": opt_bytes,
    }


def analytic_state(spec: BenchSpec, rank: int, plan: Plan | None) -> dict[str, int]:
    """What ``state`` must be: ``plan.worker_bytes`` for SDP, the full model for DDP, and the
    rank's dim-0 shard of every parameter for FSDP2 (``ceil(d0 / world)`` rows per rank); SDP
    composed with FSDP: ``FsdpLayout`` (each held unit sharded over its holders, shared
    parameters over the world). Master (storage) dtype throughout, also under mixed precision."""
    width = spec.param_bytes
    if plan is not None and spec.fsdp:
        return FsdpLayout(spec, plan).state(rank)
    if spec.composition().zero:
        return zero_state(spec, rank, plan)
    if plan is not None:
        wb = worker_bytes(plan, rank, param_bytes=width,
                          optimizer_states=optimizer_states(spec.recipe),
                          masking=spec.strategy_value.cost_masking)
        return {"params": wb.params, "grads": wb.grads, "optimizer": wb.optimizer}
    _, meta = meta_model(spec)
    if spec.uses_fsdp:
        elems = sum(fsdp_shard_numel(tuple(p.shape), spec.world, rank)
                    for p in meta.parameters())
    else:
        elems = sum(p.numel() for p in meta.parameters())
    return {"params": elems * width, "grads": elems * width,
            "optimizer": optimizer_states(spec.recipe) * elems * width}


def zero_state(spec: BenchSpec, rank: int, plan: Plan | None) -> dict[str, int]:
    """ZeRO inside holder groups (``runtime.zero``): the reducer's buckets over this rank's
    pieces (``runtime.reducer.global_buckets``), each padded to a multiple of its c holders:
    optimizer state for the rank's real slice of each, gradients of a slice each (ZeRO-2) or
    the padded buckets (ZeRO-1, whose slices are views of them); parameters whole, plus a copy
    of the slice of every narrowed (non-contiguous) piece. ``plan`` None: the ddp+zero
    stand-in, everyone holding everything (``parallelize``)."""
    from subnetdp.plan import make_plan
    from subnetdp.runtime.reducer import global_buckets
    from subnetdp.subnet.pieces import reduction_order
    from subnetdp.subnet.units import describe_units

    recipe, meta = meta_model(spec)
    strategy = spec.strategy_value
    if plan is None:
        units, shared = describe_units(meta, recipe.adapter)
        plan = make_plan(world=spec.world, units=units, coverage=1.0, shared_size=shared)
        strategy = HOLDER_REDUCER
    width, zero = spec.param_bytes, spec.composition().zero
    wb = worker_bytes(plan, rank, param_bytes=width, masking=strategy.cost_masking,
                      optimizer_states=optimizer_states(spec.recipe))
    pieces = full_pieces(meta, [u.name for u in plan.units],
                         match_plan(plan, meta, recipe.adapter, strategy))
    specs = global_buckets(reduction_order(pieces), plan,
                           bucket_cap_bytes=int(spec.bucket_cap_mb * 2**20))
    held = set(plan.held_units(rank))
    partly = {p.key for p in pieces if p.unit is not None and p.unit not in held}

    def copied(p: Piece) -> bool:
        """Whether the piece's slice needs a copy: it is not its own contiguous tensor (a
        narrowed layer under forward masking, a fully held sliced one under backward masking,
        or a backward-masking slice parameter cut along an inner dimension)."""
        if p.dim is None:
            return False
        if not strategy.backward_masked or p.key not in partly:
            return True
        return any(n > 1 for n in p.shape[: p.dim])

    real = grads = copies = 0
    for b in specs:
        if rank not in b.holders:
            continue
        c, k = len(b.holders), b.holders.index(rank)
        size = math.ceil(b.numel / c)
        real += max(0, min(b.numel, (k + 1) * size) - k * size)
        grads += size if zero == 2 else size * c
        off = 0
        for p in b.pieces:
            if copied(p):
                copies += max(0, min(off + p.numel, (k + 1) * size, b.numel)
                              - max(off, k * size))
            off += p.numel
    return {"params": wb.params + copies * width, "grads": grads * width,
            "optimizer": optimizer_states(spec.recipe) * real * width}


class FsdpLayout:
    """Where an SDP+FSDP rank's parameter elements are (``runtime.fsdp.shard_blocks``): each
    held unit's FSDP parameters cut along dim 0 over the unit's holders (the rank's position
    in the sorted holder tuple is its mesh coordinate), the shared parameters over the world;
    under backward masking the non-held units stay whole, frozen, and (mixed precision) stored
    in the compute dtype. A unit's FSDP parameters are its block's (block level) or, under
    n-sdp, its neuron group's slice of every layer it splits (``runtime.grouped``'s parts)."""

    def __init__(self, spec: BenchSpec, plan: Plan) -> None:
        recipe, meta = meta_model(spec)
        self.spec, self.plan = spec, plan
        self.shapes, self.shared = fsdp_unit_shapes(meta, recipe.adapter, plan,
                                                    spec.strategy_value)

    def unit_shard(self, u: int, rank: int) -> int:
        holders = sorted(self.plan.holders(u))
        i = holders.index(rank)
        return sum(fsdp_shard_numel(s, len(holders), i) for s in self.shapes[u])

    def shared_shard(self, rank: int) -> int:
        return sum(fsdp_shard_numel(s, self.plan.world, rank) for s in self.shared)

    def trained_elems(self, rank: int) -> int:
        """Elements with gradients and optimizer state: held shards + the shared shard."""
        held = sum(self.unit_shard(u, rank) for u in self.plan.held_units(rank))
        return held + self.shared_shard(rank)

    def frozen_elems(self, rank: int) -> int:
        """Non-held units kept whole under backward masking (0 under forward masking)."""
        if not self.spec.strategy_value.backward_masked:
            return 0
        held = set(self.plan.held_units(rank))
        return sum(math.prod(s) for u, shapes in enumerate(self.shapes) if u not in held
                   for s in shapes)

    def state(self, rank: int) -> dict[str, int]:
        width = self.spec.param_bytes
        frozen_dtype = self.spec.compute_dtype or storage_dtype(self.spec.composition())
        trained = self.trained_elems(rank)
        return {"params": trained * width + self.frozen_elems(rank) * frozen_dtype.itemsize,
                "grads": trained * width,
                "optimizer": optimizer_states(self.spec.recipe) * trained * width}

    def signature(self, rank: int) -> tuple[Any, ...]:
        held = sorted((self.plan.units[u].size, len(self.plan.holders(u)),
                       self.unit_shard(u, rank)) for u in self.plan.held_units(rank))
        return (tuple(held), self.shared_shard(rank))


def fsdp_unit_shapes(
    meta: nn.Module, adapter: UnitAdapter, plan: Plan, strategy: Strategy,
) -> tuple[list[list[tuple[int, ...]]], list[tuple[int, ...]]]:
    """The parameter shapes FSDP shards per unit (over its holders) and over the world."""
    if strategy.splits_layers:
        pieces = full_pieces(meta, [u.name for u in plan.units],
                             match_plan(plan, meta, adapter, strategy))
        shapes: list[list[tuple[int, ...]]] = [[] for _ in plan.units]
        shared = []
        for piece in pieces:
            if not piece.is_param or piece.tied_to is not None:
                continue
            if piece.unit is None:
                shared.append(piece.shape)
            else:
                shapes[piece.unit].append(piece.shape)
        return shapes, shared
    blocks = unit_modules(meta, adapter)
    if len(blocks) != plan.num_units:
        raise ValueError(f"{strategy.name}: plan units are not the model's blocks")
    in_block = {id(p) for _, block in blocks for p in block.parameters()}
    return ([[tuple(p.shape) for p in block.parameters()] for _, block in blocks],
            [tuple(p.shape) for p in meta.parameters() if id(p) not in in_block])


def fsdp_shard_numel(shape: tuple[int, ...], world: int, rank: int) -> int:
    """Elements of ``rank``'s FSDP2 shard: dim 0 cut into chunks of ``ceil(d0 / world)``."""
    if not shape:
        return 1 if rank == 0 else 0
    chunk = math.ceil(shape[0] / world)
    rows = max(0, min(shape[0], (rank + 1) * chunk) - rank * chunk)
    return rows * math.prod(shape[1:])


def ddp_default_bucket_bytes(spec: BenchSpec) -> int:
    """The extra memory of torch DDP's default ``gradient_as_bucket_view=False``: flat buckets
    that copy every gradient, alive for the whole run (see strategies' Note: fair DDP)."""
    _, meta = meta_model(spec)
    return sum(p.numel() for p in meta.parameters()) * spec.param_bytes
