"""Step time of one training step on a cluster, from counted FLOPs and counted bytes.

``predict_step(spec, cluster, rate=)`` adds three parts, all per step:

- **Compute**: each rank's forward and backward FLOPs, counted on the meta device
  (``subnet.costs``: per unit and shared), over ``rate`` (the device's sustained model FLOP/s:
  peak × MFU). A rank runs the shared part and the units it runs: every unit (ddp, fsdp), its
  held blocks (b-sdp), its held fraction of every split layer (n-sdp: narrower layers), or
  every block forward and, backward, the input gradients of all and the weight gradients of
  its held ones only (bb-sdp, nb-sdp: 2 FLOPs per parameter and token are a weight
  gradient). Activation checkpointing adds the forward of the checkpointed blocks again.
  Collectives wait for the slowest rank: compute is the slowest rank's (stragglers).
- **Communication**: every collective of every rank, with exactly the bytes of
  ``estimate.comm`` (``collectives``; ``tests/estimate/test_steptime.py`` checks the sums), on
  an α-β ring: a rank sends ``2(h-1)/h`` of an all-reduce's payload and ``(h-1)/h`` of an
  all-gather's or reduce-scatter's to its successor in the group, in ``2(h-1)`` or ``h-1``
  steps of latency α each. Each send loads the link it crosses (``estimate.cluster``: a rank's
  own intra-node link, a node's shared one, or the NICs out of and into a node); the bytes on
  a link add up over every rank and group (groups sharing a link serialise), and a phase takes
  as long as its busiest link needs plus the latency steps of the rank with the most. Wire
  bytes can exceed the counted ones: gloo runs ``reduce_scatter_tensor`` as an all-reduce of the
  whole tensor (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``: clone, all-reduce, keep
  one chunk), so ``WIRE`` doubles its share on gloo; FSDP runs ``runtime.ring``'s ring instead
  (``BenchSpec.ring_reduce_scatter``, the default: ``RING_REDUCE_SCATTER_WIRE``). Backward
  masking's refresh (bb-sdp, nb-sdp) is point to point: each unit's owner sends it to every
  non-holder (``_with_refresh``), beyond ``estimate.comm``'s collective bytes.
- **Overlap**: what hides behind compute. Bucketed all-reduces (DDP, SDP's reducer, ZeRO's
  reduce-scatters) are launched asynchronously, in order, as buckets complete during backward:
  a bucket is ready when backward has produced its last gradient (backward runs the output
  head first, then the blocks last to first; the shared parameters, the tied embedding among
  them, are ready only at the end; torch DDP's first bucket holds the first 1 MiB), and the
  link carries the buckets one after the other; what is still on the link when backward ends
  is exposed (``bucket_exposed``). So DDP's large last bucket and SDP's world bucket are on the
  critical path. FSDP's all-gathers and reduce-scatters pipeline against forward and backward
  when adjacent blocks are prefetched (``fsdp_prefetch``, subnetdp's default) on backends with
  side streams (NCCL); on gloo they block (``FSDP_BLOCKING``): all of them are exposed.
  ZeRO's all-gathers of updated parameters and ddp+zero1's broadcasts (one per parameter
  tensor, as torch's ZeroRedundancyOptimizer sends them) run after the optimizer step: exposed.
- **Shaped links**: a link with a token bucket (``Link.burst``: the emulated links' tbf) sends
  the first ``burst`` bytes after each idle gap at once; blocking calls separated by compute
  each start after such a gap.

- **Host time per FSDP call** (``call_s``): each FSDP module's gather and reduce-scatter
  costs hook, copy-in/out and rendezvous time that neither the FLOP rate nor the bytes
  contain; measured on a model of tiny FSDP modules (``estimate.calibrate``'s
  ``fsdp_call_s``) and added to compute once per call (n-sdp+fsdp before its parts were
  grouped per block: about a hundred calls per step on llama-tiny).

- **What else the FLOP rate misses** (``terms``: ``ComputeTerms``): n-sdp's narrowed layers
  run slower per FLOP than the full model's (narrower matrix products; the unnarrowed work
  does not shrink) and a checkpointed step's recompute differs from its FLOPs; each a ratio
  of FLOP rates measured on bare models (``estimate.calibrate``), applied to the rate.

The model is calibrated, never fitted to the step times it predicts: ``rate`` from a matmul
and a compute-only training step, ``call_s`` from tiny FSDP modules and ``terms`` from the
narrowed and the checkpointed model (``estimate.calibrate``), α and β of a link from a
ping-pong and a large transfer (the emulated benchmark's probe).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from subnetdp.estimate.cluster import Cluster
from subnetdp.estimate.comm import analytic_comm, by_row, gather_scatter_elems
from subnetdp.estimate.spec import BenchSpec, make_bench_plan, meta_model
from subnetdp.plan import Plan
from subnetdp.subnet.costs import ModelCosts, UnitCost, recipe_costs
from subnetdp.subnet.units import unit_modules

# per backend, wire bytes / counted ring bytes of a collective kind (1 when absent)
WIRE: dict[str, dict[str, float]] = {"gloo": {"reduce_scatter": 2.0}, "nccl": {}}
# FSDP's reduce-scatter over gloo with runtime.ring (spec.ring_reduce_scatter): as counted;
# ZeRO's (runtime.zero) stays gloo's own
RING_REDUCE_SCATTER_WIRE = 1.0
# backends on which FSDP2's all-gathers and reduce-scatters block the training thread: torch
# issues them with async_op=False on side streams (FSDPParamGroup.unshard_async_op,
# foreach_reduce); a CPU has no streams, so each gloo call completes before the next op
# starts: nothing overlaps, and prefetching only reorders the calls
FSDP_BLOCKING = frozenset({"gloo"})
DDP_FIRST_BUCKET = 1 << 20  # torch DDP's first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES)


@dataclass(frozen=True)
class Collective:
    """One kind of collective of one rank over one group, per step."""

    kind: str  # all_reduce | all_gather | reduce_scatter | broadcast | send (point to point)
    group: tuple[int, ...]
    payload: float  # bytes handed to the collective, per step (estimate.comm's)
    calls: int  # launches per step (buckets, FSDP modules): latency
    phase: str  # forward | backward | after (the optimizer step)
    fsdp: bool = False  # issued by FSDP (else by a bucketed reducer or the optimizer)

    @property
    def ring_share(self) -> float:
        """Fraction of the payload a rank sends in a ring (a send: all of it, to
        ``group[1]``)."""
        h = len(self.group)
        if self.kind == "send":
            return 1.0
        return (2 if self.kind == "all_reduce" else 1) * (h - 1) / h

    @property
    def ring_bytes(self) -> float:
        return self.payload * self.ring_share

    def steps(self, wire: float) -> int:
        """Latency steps of one call: a ring all-reduce has 2(h-1), the rest h-1 (gloo's
        reduce-scatter is an all-reduce: ``wire`` 2)."""
        h = len(self.group) - 1
        return 2 * h if self.kind == "all_reduce" or wire > 1 else h


def collectives(spec: BenchSpec, plan: Plan | None = None) -> list[list[Collective]]:
    """Per rank, its collectives with ``estimate.comm``'s bytes: FSDP's (all-gathered,
    reduce-scattered) elements per group, forward gathers = the reduce-scattered elements
    (each FSDP module once), backward gathers = the rest; otherwise the all-reduce (or ZeRO's
    reduce-scatter + all-gather, or ddp+zero1's all-reduce + broadcast) of each group. Ranks
    of one plan row share one list (``estimate.comm.by_row``); ``plan``: the spec's (SDP),
    when the caller has it."""
    elems = gather_scatter_elems(spec, plan)
    if elems is not None:
        calls = _fsdp_modules(spec, plan)
        gb, rb = spec.gather_bytes, spec.reduce_bytes
        out: dict[int, list[Collective]] = {}
        for per_group in elems:
            if id(per_group) in out:
                continue
            colls = []
            for group, (g, s) in sorted(per_group.items()):
                if len(group) < 2:
                    continue
                n = calls.get(group, 1)
                colls += [Collective("all_gather", group, float(s * gb), n, "forward", True),
                          Collective("reduce_scatter", group, float(s * rb), n, "backward",
                                     True)]
                if g > s:
                    colls.append(Collective("all_gather", group, float((g - s) * gb), n,
                                            "backward", True))
            out[id(per_group)] = colls
        return _with_refresh(spec, plan, [out[id(e)] for e in elems])
    records = analytic_comm(spec, plan)
    groups: dict[str, tuple[int, ...]] = {}  # one tuple per group: a world of 8,000 is big
    lists: dict[int, list[Collective]] = {}
    # ddp+zero1: torch's ZeroRedundancyOptimizer broadcasts parameter by parameter
    # (``_broadcast_params_from_rank`` without ``parameters_as_bucket_view``): one call each
    tensors = (sum(1 for _ in meta_model(spec, check_seq=False)[1].parameters())
               if any("broadcast" in rec["by_collective"] for rec in records[:1]) else 1)
    for rec in records:
        if id(rec) not in lists:
            lists[id(rec)] = _rank_collectives(spec, rec, groups, tensors)
    return _with_refresh(spec, plan, [lists[id(rec)] for rec in records])


def _with_refresh(spec: BenchSpec, plan: Plan | None,
                  lists: list[list[Collective]]) -> list[list[Collective]]:
    """``lists`` with backward masking's refresh (bb-sdp, nb-sdp; ``runtime.refresh``): before
    the forward after every ``refresh_every``-th step, each unit's owner (its lowest-ranked
    holder) sends the unit's parameters to every rank that does not hold it, point to point
    and blocking. Per owner one send per receiver (exposed, after the optimizer step); the
    other ranks of the owner's plan row keep the shared list. Point to point: outside
    ``estimate.comm``'s collective bytes."""
    if not (spec.is_sdp and spec.strategy_value.backward_masked):
        return lists
    if plan is None:
        recipe, meta = meta_model(spec, check_seq=False)
        plan = make_bench_plan(spec, meta, recipe)
    sends: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for u in range(plan.num_units):
        holders = set(plan.holders(u))
        nbytes = plan.units[u].size * spec.param_bytes / spec.refresh_every
        for dst in range(spec.world):
            if dst not in holders:
                sends[plan.owner(u)][dst] += nbytes
    out = list(lists)
    for owner, per_dst in sends.items():
        out[owner] = lists[owner] + [Collective("send", (owner, dst), b, 1, "after")
                                     for dst, b in sorted(per_dst.items())]
    return out


def _rank_collectives(spec: BenchSpec, rec: dict[str, Any],
                      groups: dict[str, tuple[int, ...]], tensors: int) -> list[Collective]:
    """One rank's collectives from its ``analytic_comm`` record (no FSDP); ``tensors``: the
    broadcasts of ddp+zero1, one per parameter tensor."""
    cap = spec.bucket_cap_mb * 2**20
    colls = []
    by_coll = rec["by_collective"]
    for key, g in rec["by_group"].items():
        if key not in groups:
            groups[key] = tuple(int(r) for r in key.split(","))
        group = groups[key]
        if "broadcast" in by_coll:  # ddp+zero1: DDP's all-reduce, then the broadcasts
            ar = by_coll["all_reduce"]["payload"]
            colls += [Collective("all_reduce", group, ar, _buckets(ar, cap, first=True),
                                 "backward"),
                      Collective("broadcast", group, g["payload"] - ar, tensors, "after")]
        elif "reduce_scatter+all_gather" in by_coll:  # ZeRO in holder groups
            n = _buckets(g["payload"], cap)
            colls += [Collective("reduce_scatter", group, g["payload"], n, "backward"),
                      Collective("all_gather", group, g["payload"], n, "after")]
        else:
            first = not spec.is_sdp  # torch DDP's small first bucket
            colls.append(Collective("all_reduce", group, g["payload"],
                                    _buckets(g["payload"], cap, first=first), "backward"))
    return colls


def _buckets(payload: float, cap: float, *, first: bool = False) -> int:
    if first and payload > DDP_FIRST_BUCKET:
        return 1 + math.ceil((payload - DDP_FIRST_BUCKET) / cap)
    return max(1, math.ceil(payload / cap))


def _fsdp_modules(spec: BenchSpec, plan: Plan | None) -> dict[tuple[int, ...], int]:
    """FSDP modules per group (each one collective call per gather or reduce-scatter): the
    world's root (shared parameters) plus, per holder group, its blocks (the FSDP baselines:
    every block over the world); n-sdp's, one per block and holder group of the parts it
    holds (``runtime.fsdp`` [Note: one FSDP module per block and holder group]; under
    activation checkpointing one per part: counted per unit here, a lower bound)."""
    recipe, meta = meta_model(spec, check_seq=False)
    if plan is None or not spec.is_sdp:
        plan = make_bench_plan(spec, meta, recipe)
    world = tuple(range(spec.world))
    out: dict[tuple[int, ...], int] = defaultdict(int)
    out[world] = 1
    s = spec.strategy_value
    if spec.is_sdp and s.splits_layers and not s.backward_masked and not spec.uses_ac:
        blocks = [name + "." for name, _ in unit_modules(meta, recipe.adapter)]
        cases = {(next((b for b in blocks if plan.units[u].name.startswith(b)), None),
                   plan.holders(u)) for u in range(plan.num_units)}
        for _, holders in cases:
            out[holders] += 1
        return dict(out)
    for u in range(plan.num_units):
        holders = world if not spec.is_sdp else plan.holders(u)
        out[holders] += 1
    return dict(out)


@dataclass(frozen=True)
class RankFlops:
    forward: float
    backward: float
    recompute: float  # activation checkpointing: the checkpointed blocks' forward again
    # per unit, its backward (+ recompute) FLOPs on this rank, and the shared part's backward
    unit_backward: tuple[float, ...] = ()
    shared_backward: float = 0.0

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute

    def unit_ready(self) -> list[float]:
        """Per unit, the fraction of this rank's backward done when the unit's gradients are
        complete: the output head (shared) runs first, then the blocks last to first."""
        total = self.shared_backward + sum(self.unit_backward) or 1.0
        done, out = self.shared_backward, [0.0] * len(self.unit_backward)
        for u in reversed(range(len(self.unit_backward))):
            done += self.unit_backward[u]
            out[u] = done / total
        return out


def held_fraction(flops: RankFlops, costs: ModelCosts) -> float:
    """The share of the units' forward FLOPs ``flops``'s rank runs (n-sdp: its held width)."""
    units = sum(u.fwd_flops for u in costs.units)
    return (flops.forward - costs.shared.fwd_flops) / units if units else 1.0


@dataclass(frozen=True)
class ComputeTerms:
    """What the FLOP rate misses, each measured by ``estimate.calibrate`` on bare models
    against the full model's step (1.0: not measured, the FLOP rate alone):

    - ``narrow_efficiency``: the FLOP rate of n-sdp's narrowed rank (``narrow_held`` of every
      layer's width) over the full model's: narrower matrix products run slower per FLOP, and
      the unnarrowed work (norms, embedding, the optimizer over the shared part) does not
      shrink. At another held fraction h: linear in h between 1 (h = 1) and the measured point,
      the measured value below it.
    - ``ac_efficiency``: the FLOP rate of the step with every block checkpointed (its FLOPs
      counting the recompute) over the full model's: recompute saves activations again and
      runs the non-matmul work twice.
    """

    narrow_held: float = 1.0
    narrow_efficiency: float = 1.0
    ac_efficiency: float = 1.0

    def narrow(self, held: float) -> float:
        """The rate factor of a rank whose layers are narrowed to ``held`` of their width."""
        if self.narrow_held >= 1.0 or held >= 1.0:
            return 1.0
        t = min(1.0, (1.0 - held) / (1.0 - self.narrow_held))
        return 1.0 + t * (self.narrow_efficiency - 1.0)


def rank_flops(spec: BenchSpec, costs: ModelCosts, plan: Plan | None) -> list[RankFlops]:
    """Per rank, the FLOPs of one step (module docstring; one shared object per plan row).
    ``plan`` None: a baseline (every rank runs everything)."""
    tokens = spec.batch * (costs.seq or 1)
    s = spec.strategy_value
    units = costs.units
    total_unit = sum(u.params for u in units) or 1

    def wgrad(u: UnitCost) -> float:
        # a weight gradient is 2 FLOPs per parameter and token (lm); convolutions reuse
        # weights over positions: half the backward, as for a linear layer
        return min(u.bwd_flops / 2, 2 * u.params * tokens) if costs.seq else u.bwd_flops / 2

    def of_rank(r: int) -> RankFlops:
        if plan is None or not s.is_sdp:
            held = [1.0] * len(units)
        elif s.splits_layers:  # held fraction of every split layer
            frac = sum(plan.units[u].size for u in plan.held_units(r)) / total_unit
            held = [frac] * len(units)
        else:
            held_set = set(plan.held_units(r))
            held = [1.0 if i in held_set else 0.0 for i in range(len(units))]
        fwd = bwd = rec = 0.0
        unit_bwd = []
        for u, h in zip(units, held, strict=True):
            if s.backward_masked:  # full forward; input gradients everywhere
                f, b = float(u.fwd_flops), u.bwd_flops - (1 - h) * wgrad(u)
            else:
                f, b = h * u.fwd_flops, h * u.bwd_flops
            again = f if spec.uses_ac else 0.0  # the recompute
            fwd, bwd, rec = fwd + f, bwd + b, rec + again
            unit_bwd.append(b + again)
        return RankFlops(fwd + costs.shared.fwd_flops, bwd + costs.shared.bwd_flops, rec,
                         tuple(unit_bwd), costs.shared.bwd_flops)

    if plan is None or not s.is_sdp:
        return [of_rank(0)] * spec.world
    return by_row(plan, of_rank)


def pipelined(comm: float, compute: float, n: int) -> float:
    """Exposed time of ``comm`` cut into ``n`` equal pieces that pipeline with ``compute``
    (also cut in n): the first piece waits alone, each of the other n-1 hides behind one
    piece of compute: comm/n + (n-1)/n · max(0, comm - compute)."""
    if comm <= 0:
        return 0.0
    n = max(1, n)
    return comm / n + (n - 1) / n * max(0.0, comm - compute)


def bucket_exposed(comm: float, compute: float, buckets: list[tuple[float, float]]) -> float:
    """Exposed time of ``comm`` (the link time of all ``buckets``) after ``compute`` (the
    backward): ``buckets`` are (ready, share) in launch order, ``ready`` the fraction of the
    backward done when the bucket can launch, ``share`` its fraction of ``comm``. A bucket
    starts when it is ready and the one before it has left the link."""
    if comm <= 0 or not buckets:
        return 0.0
    total = sum(share for _, share in buckets) or 1.0
    end = 0.0
    for ready, share in buckets:
        end = max(end, ready * compute) + comm * share / total
    return max(0.0, end - compute)


def reduce_buckets(spec: BenchSpec, costs: ModelCosts, plan: Plan | None, flops: RankFlops,
                   colls: list[Collective], wire: dict[str, float]) -> list[tuple[float, float]]:
    """One rank's bucketed reductions as (ready, wire bytes) in launch order
    (``bucket_exposed``). Each collective's payload is spread over the parameters of its
    group, in reduction order (blocks last to first, the shared parameters at the end),
    and cut into buckets as the reducers do (torch DDP: a 1 MiB first bucket; then
    ``bucket_cap_mb``); a bucket is ready when its last parameter is."""
    ready = flops.unit_ready()
    cap = spec.bucket_cap_mb * 2**20
    world = tuple(range(spec.world))
    units = costs.units
    out: list[tuple[float, float]] = []
    for c in colls:
        if c.phase != "backward" or c.fsdp:
            continue
        if plan is None or not spec.is_sdp or spec.strategy_value.splits_layers:
            mine = list(range(len(units)))  # every unit has a piece in the group
        else:
            mine = [u for u in range(len(units)) if plan.holders(u) == c.group]
        pieces = [(float(units[u].params), ready[u]) for u in reversed(mine)]
        if c.group == world:
            pieces.append((float(costs.shared.params), 1.0))
        if not pieces:
            continue
        per = c.payload / (sum(p for p, _ in pieces) or 1.0)  # payload bytes per parameter
        link = c.ring_share * wire.get(c.kind, 1.0)  # bytes a rank sends per payload byte
        first = c.kind == "all_reduce" and not spec.is_sdp  # torch DDP
        limit, size = (float(DDP_FIRST_BUCKET) if first else cap), 0.0
        for params, t in pieces:
            size += params * per
            while size >= limit:  # the bucket closes here
                out.append((t, limit * link))
                size, limit = size - limit, cap
        if size > 0:
            out.append((pieces[-1][1], size * link))
    return sorted(out, key=lambda b: b[0])


@dataclass
class StepTime:
    compute_s: float  # the slowest rank's compute
    comm_s: dict[str, float]  # per phase, if nothing overlapped
    exposed_s: dict[str, float]  # per phase, on the critical path
    ring_bytes: list[float]  # per rank, counted (estimate.comm's ring bytes)
    wire_bytes: list[float]  # per rank, what the backend sends
    flops: list[RankFlops] = field(default_factory=list)
    tokens: int = 0  # per step, all ranks

    @property
    def step_s(self) -> float:
        return self.compute_s + sum(self.exposed_s.values())

    @property
    def exposed_comm_s(self) -> float:
        return sum(self.exposed_s.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    def to_dict(self) -> dict[str, Any]:
        return {"step_s": self.step_s, "compute_s": self.compute_s,
                "exposed_comm_s": self.exposed_comm_s, "comm_s": dict(self.comm_s),
                "exposed_s": dict(self.exposed_s), "tokens_per_s": self.tokens_per_s,
                "ring_bytes_per_rank": max(self.ring_bytes, default=0.0),
                "wire_bytes_per_rank": max(self.wire_bytes, default=0.0)}


def predict_step(spec: BenchSpec, cluster: Cluster, *, rate: float, backend: str = "nccl",
                 costs: ModelCosts | None = None, overlap: bool = True,
                 plan: Plan | None = None,
                 colls: list[list[Collective]] | None = None, call_s: float = 0.0,
                 terms: ComputeTerms | None = None) -> StepTime:
    """The model's step time of ``spec`` on ``cluster`` (``cluster.world`` must be
    ``spec.world``) at ``rate`` model FLOP/s per rank; ``costs``: the recipe's at the spec's
    batch and sequence (measured when not given); ``overlap=False``: every collective on the
    critical path. ``plan`` (SDP) and ``colls`` (``collectives(spec)``): computed once by a
    caller that predicts one spec on several clusters. ``call_s``: the host time of one FSDP
    collective call beyond its bytes (hooks, copy-in/out, the holders' rendezvous), measured
    by ``estimate.calibrate`` (``fsdp_call_s``): part of compute, once per call. ``terms``:
    the rest of what the FLOP rate misses (``ComputeTerms``), measured by the same tool."""
    if cluster.world != spec.world:
        raise ValueError(f"the cluster has {cluster.world} ranks, the spec {spec.world}")
    if rate <= 0:
        raise ValueError(f"the FLOP rate must be > 0, got {rate}")
    if costs is None or (plan is None and spec.is_sdp):
        recipe, meta = meta_model(spec, check_seq=False)
        if costs is None:
            costs = recipe_costs(recipe, batch=spec.batch, seq=spec.seq,
                                 model_args=dict(spec.model_args))
        if plan is None and spec.is_sdp:
            plan = make_bench_plan(spec, meta, recipe)
    flops = rank_flops(spec, costs, plan)
    slowest = max(flops, key=lambda f: f.total)
    rate *= _efficiency(spec, terms or ComputeTerms(), held_fraction(slowest, costs))
    fwd_s, bwd_s = slowest.forward / rate, (slowest.backward + slowest.recompute) / rate
    colls = colls if colls is not None else collectives(spec)
    if call_s:  # what the FLOP rate misses: FSDP's host time per call (module docstring)
        fwd_s += call_s * _calls(_part(colls, lambda c: c.fsdp and c.phase == "forward"))
        bwd_s += call_s * _calls(_part(colls, lambda c: c.fsdp and c.phase == "backward"))
    wire = WIRE.get(backend, {})
    if spec.uses_fsdp and spec.ring_reduce_scatter and backend == "gloo":
        wire = {**wire, "reduce_scatter": RING_REDUCE_SCATTER_WIRE}
    comm: dict[str, float] = {}
    exposed: dict[str, float] = {}
    _fsdp_phases(spec, cluster, colls, wire, backend, (fwd_s, bwd_s), overlap, comm, exposed)
    # bucketed reductions during backward (DDP, SDP's reducer, ZeRO's reduce-scatters): one
    # idle gap (forward) before the first
    reducer = _part(colls, lambda c: not c.fsdp and c.phase == "backward")
    if any(reducer):
        t = comm["backward reduce"] = _phase_time(cluster, reducer, wire, gaps=1, gap_s=fwd_s)
        cases = {(id(f), id(cs)): (f, cs) for f, cs in zip(flops, colls, strict=True)}
        exposed["backward reduce"] = t if not overlap else max(
            bucket_exposed(t, bwd_s, reduce_buckets(spec, costs, plan, f, cs, wire))
            for f, cs in cases.values())
    # after the optimizer step (ZeRO's gathers, ddp+zero1's broadcasts, backward masking's
    # refresh before the next forward): exposed
    for name, kinds in (("gather", ("all_gather",)), ("reduce", ("broadcast", "all_reduce",
                                                                  "reduce_scatter")),
                        ("refresh", ("send",))):
        after = _part(colls, lambda c, kinds=kinds: c.phase == "after" and c.kind in kinds)
        if any(after):
            comm[f"after {name}"] = exposed[f"after {name}"] = _phase_time(cluster, after, wire)
    tokens = spec.world * spec.batch * (costs.seq or 1)
    rows = {id(cs): cs for cs in colls}.values()  # one list per plan row
    ring = {id(cs): sum(c.ring_bytes for c in cs if c.kind != "send") for cs in rows}
    sent = {id(cs): sum(c.ring_bytes * wire.get(c.kind, 1.0) for c in cs) for cs in rows}
    return StepTime(
        compute_s=fwd_s + bwd_s, comm_s=comm, exposed_s=exposed,
        ring_bytes=[ring[id(cs)] for cs in colls], wire_bytes=[sent[id(cs)] for cs in colls],
        flops=flops, tokens=tokens)


def _efficiency(spec: BenchSpec, terms: ComputeTerms, held: float) -> float:
    """The factor on the FLOP rate of ``spec``'s slowest rank (``ComputeTerms``): n-sdp's
    narrowed layers (forward-masked neuron splits; backward masking runs every layer whole)
    and activation checkpointing."""
    s = spec.strategy_value
    narrowed = s.is_sdp and s.splits_layers and not s.backward_masked
    return ((terms.narrow(held) if narrowed else 1.0)
            * (terms.ac_efficiency if spec.uses_ac else 1.0))


def with_local_steps(st: StepTime, spec: BenchSpec, cluster: Cluster, *, every: int,
                     fragments: int = 1, wire_ratio: float = 1.0, backend: str = "nccl",
                     colls: list[list[Collective]] | None = None) -> StepTime:
    """``st`` (``predict_step``'s, same ``spec`` and ``cluster``) with local steps
    (``--sync-every H``, ``runtime.local_steps``), per step amortised over a window: the
    inner steps compute only; each of the F fragment syncs all-reduces 1/F of the bytes of
    one synchronous step's reducer (times ``wire_ratio``: the outer dtype's bytes over the
    parameters'), after the optimizer step and blocking it, so none hides behind backward."""
    if every < 1 or fragments < 1 or every % fragments:
        raise ValueError(f"the sync window ({every}) must be >= 1 and a multiple of the "
                         f"fragments ({fragments})")
    colls = colls if colls is not None else collectives(spec)
    rows: dict[int, list[Collective]] = {}  # one list per plan row, as collectives' are
    for cs in colls:
        rows.setdefault(id(cs), [dataclasses.replace(
            c, payload=c.payload * wire_ratio / fragments,
            calls=math.ceil(c.calls / fragments), phase="after") for c in cs
            if not c.fsdp and c.phase == "backward"])
    share = [rows[id(cs)] for cs in colls]
    window = fragments * _phase_time(cluster, share, WIRE.get(backend, {})) if any(share) else 0
    per_step = window / every
    return dataclasses.replace(
        st, comm_s={"sync": per_step}, exposed_s={"sync": per_step},
        ring_bytes=[b * wire_ratio / every for b in st.ring_bytes],
        wire_bytes=[b * wire_ratio / every for b in st.wire_bytes])


def _part(colls: list[list[Collective]], pred: Any) -> list[list[Collective]]:
    """Per rank, its collectives that satisfy ``pred``; ranks of one plan row share a list."""
    lists: dict[int, list[Collective]] = {}
    for cs in colls:
        if id(cs) not in lists:
            lists[id(cs)] = [c for c in cs if pred(c)]
    return [lists[id(cs)] for cs in colls]


def _calls(per_rank: list[list[Collective]]) -> int:
    """The most calls any rank launches."""
    return max((sum(c.calls for c in cs) for cs in {id(cs): cs for cs in per_rank}.values()),
               default=0)


def _fsdp_phases(spec: BenchSpec, cluster: Cluster, colls: list[list[Collective]],
                 wire: dict[str, float], backend: str, compute: tuple[float, float],
                 overlap: bool, comm: dict[str, float], exposed: dict[str, float]) -> None:
    """FSDP's gathers and reduce-scatters into ``comm`` and ``exposed`` (``predict_step``'s
    per phase); ``compute``: the forward and backward seconds."""
    fwd_s, bwd_s = compute
    # on gloo FSDP2's calls block the training thread, except the all-gathers that
    # runtime.ring's GlooComms issues asynchronously (BenchSpec.async_unshard)
    scatters_block = backend in FSDP_BLOCKING
    gathers_block = scatters_block and not spec.async_unshard
    # FSDP: forward gathers; backward gathers and reduce-scatters (one call per module each)
    fsdp_fwd = _part(colls, lambda c: c.fsdp and c.phase == "forward")
    gathers = _part(colls, lambda c: c.fsdp and c.phase == "backward" and c.kind == "all_gather")
    scatters = _part(colls, lambda c: c.fsdp and c.phase == "backward" and c.kind != "all_gather")
    if gathers_block:  # each module's calls follow the previous module's compute, all exposed
        joined = {id(g): g + s for g, s in zip(gathers, scatters, strict=True)}
        fsdp_bwd = [joined[id(g)] for g in gathers]
        for key, per_rank, n, window in (
                ("forward gather", fsdp_fwd, _calls(fsdp_fwd), fwd_s),
                ("backward", fsdp_bwd, max(_calls(gathers), _calls(scatters)), bwd_s)):
            if any(per_rank):
                comm[key] = exposed[key] = _phase_time(cluster, per_rank, wire, gaps=n,
                                                       gap_s=window / n)
    else:  # gathers pipeline with compute: NCCL's streams, or gloo's async gathers
        if any(fsdp_fwd):
            c = comm["forward gather"] = _phase_time(cluster, fsdp_fwd, wire)
            exposed["forward gather"] = (pipelined(c, fwd_s, _calls(fsdp_fwd))
                                         if overlap and spec.fsdp_prefetch else c)
        g = _phase_time(cluster, gathers, wire) if any(gathers) else 0.0
        r = _phase_time(cluster, scatters, wire) if any(scatters) else 0.0
        if any(gathers):
            comm["backward gather"] = g
        if any(scatters):
            comm["backward scatter"] = r
        if g or r:
            n = max(_calls(gathers), _calls(scatters))
            if scatters_block:  # the gathers pipeline, each reduce-scatter waits
                exposed["backward"] = r + (pipelined(g, bwd_s, n)
                                           if overlap and spec.fsdp_prefetch else g)
            else:
                exposed["backward"] = (g + r if not overlap else pipelined(g + r, bwd_s, n)
                                       if spec.fsdp_prefetch else g + pipelined(r, bwd_s, n))


def _phase_time(cluster: Cluster, per_rank: list[list[Collective]], wire: dict[str, float],
                *, gaps: int = 0, gap_s: float = 0.0) -> float:
    """Seconds for every rank's ``per_rank`` collectives: the busiest link's bytes over its
    bandwidth, plus the latency steps of the rank that has the most. ``gaps`` idle gaps of
    ``gap_s`` each precede calls: after each, a shaped link (``Link.burst``) passes up to its
    refilled bucket at once."""
    load: dict[tuple[str, int], float] = defaultdict(float)
    rings: dict[int, tuple[dict[int, int], float]] = {}  # per group: successors, α
    # per list of collectives (one per plan row): (successors, wire bytes) of each, and the
    # latency of the whole list
    rows: dict[int, tuple[list[tuple[dict[int, int], float]], float]] = {}
    for rank, colls in enumerate(per_rank):
        if id(colls) not in rows:
            rows[id(colls)] = _row_rings(cluster, colls, wire, rings)
        a = cluster.node(rank)
        for succ, nbytes in rows[id(colls)][0]:
            b = cluster.node(succ[rank])
            if a != b:  # out of this node's NICs, into the successor's
                load["out", a] += nbytes
                load["in", b] += nbytes
            else:
                load[("node", a) if cluster.shared_intra else ("rank", rank)] += nbytes
    nic = cluster.intra if cluster.inter is None else dataclasses.replace(
        cluster.inter, bandwidth=cluster.inter.bandwidth * cluster.nics)
    busiest = 0.0
    for key, nbytes in load.items():
        link = cluster.intra if key[0] in ("node", "rank") else nic
        if gaps:
            nbytes -= gaps * min(link.burst, link.bandwidth * gap_s, nbytes / gaps)
        busiest = max(busiest, nbytes / link.bandwidth)
    return busiest + max((latency for _, latency in rows.values()), default=0.0)


def _row_rings(cluster: Cluster, colls: list[Collective], wire: dict[str, float],
               rings: dict[int, tuple[dict[int, int], float]],
               ) -> tuple[list[tuple[dict[int, int], float]], float]:
    """One rank's collectives as (its group's successors, bytes it sends on the wire), and
    its latency: the steps of every call at its group's α. ``rings``: per group, filled."""
    out, latency = [], 0.0
    for c in colls:
        f = wire.get(c.kind, 1.0)
        if id(c.group) not in rings:
            rings[id(c.group)] = _ring(cluster, c.group)
        succ, alpha = rings[id(c.group)]
        out.append((succ, c.ring_bytes * f))
        latency += c.calls * c.steps(f) * alpha
    return out, latency


def _ring(cluster: Cluster, group: tuple[int, ...]) -> tuple[dict[int, int], float]:
    """A group's ring: each member's successor, and the latency of one step (the NICs' when
    the group spans nodes)."""
    succ = dict(zip(group, group[1:] + group[:1], strict=True))
    # a node holds consecutive ranks: the group stays on one node iff its ends do
    crosses = cluster.node(min(group)) != cluster.node(max(group))
    return succ, (cluster.inter.latency if crosses and cluster.inter else cluster.intra.latency)
