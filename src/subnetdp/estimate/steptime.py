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
  (``BenchSpec.ring_reduce_scatter``, the default: ``RING_REDUCE_SCATTER_WIRE``).
- **Overlap**: what hides behind compute. Bucketed all-reduces (DDP, SDP's reducer, ZeRO's
  reduce-scatters) launch as buckets fill during backward: with n buckets, the last bucket's
  share is exposed and the rest hides behind backward as far as backward lasts
  (``pipelined``). FSDP's all-gathers in forward, and its all-gathers and reduce-scatters in
  backward, pipeline the same way against forward and backward compute when adjacent blocks
  are prefetched (``fsdp_prefetch``, subnetdp's default); without prefetch every all-gather
  is on the critical path. ZeRO's all-gathers of updated parameters and ddp+zero1's broadcasts
  run after the optimizer step: exposed.

The model is calibrated, never fitted to the step times it predicts: ``rate`` from a matmul
and a compute-only training step (``estimate.calibrate``), α and β of a link from a ping-pong
and a large transfer (the emulated benchmark's probe).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from subnetdp.estimate.cluster import Cluster
from subnetdp.estimate.comm import analytic_comm, gather_scatter_elems
from subnetdp.estimate.spec import BenchSpec, make_bench_plan, meta_model
from subnetdp.plan import Plan
from subnetdp.subnet.costs import ModelCosts, UnitCost, recipe_costs

# per backend, wire bytes / counted ring bytes of a collective kind (1 when absent)
WIRE: dict[str, dict[str, float]] = {"gloo": {"reduce_scatter": 2.0}, "nccl": {}}
# FSDP's reduce-scatter over gloo with runtime.ring (spec.ring_reduce_scatter): as counted;
# ZeRO's (runtime.zero) stays gloo's own
RING_REDUCE_SCATTER_WIRE = 1.0
DDP_FIRST_BUCKET = 1 << 20  # torch DDP's first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES)


@dataclass(frozen=True)
class Collective:
    """One kind of collective of one rank over one group, per step."""

    kind: str  # all_reduce | all_gather | reduce_scatter | broadcast
    group: tuple[int, ...]
    payload: float  # bytes handed to the collective, per step (estimate.comm's)
    calls: int  # launches per step (buckets, FSDP modules): latency
    phase: str  # forward | backward | after (the optimizer step)

    @property
    def ring_share(self) -> float:
        """Fraction of the payload a rank sends in a ring."""
        h = len(self.group)
        return (2 if self.kind == "all_reduce" else 1) * (h - 1) / h

    @property
    def ring_bytes(self) -> float:
        return self.payload * self.ring_share

    def steps(self, wire: float) -> int:
        """Latency steps of one call: a ring all-reduce has 2(h-1), the rest h-1 (gloo's
        reduce-scatter is an all-reduce: ``wire`` 2)."""
        h = len(self.group) - 1
        return 2 * h if self.kind == "all_reduce" or wire > 1 else h


def collectives(spec: BenchSpec) -> list[list[Collective]]:
    """Per rank, its collectives with ``estimate.comm``'s bytes: FSDP's (all-gathered,
    reduce-scattered) elements per group, forward gathers = the reduce-scattered elements
    (each FSDP module once), backward gathers = the rest; otherwise the all-reduce (or ZeRO's
    reduce-scatter + all-gather, or ddp+zero1's all-reduce + broadcast) of each group."""
    elems = gather_scatter_elems(spec)
    if elems is not None:
        calls = _fsdp_modules(spec)
        gb, rb = spec.gather_bytes, spec.reduce_bytes
        out = []
        for per_group in elems:
            colls = []
            for group, (g, s) in sorted(per_group.items()):
                if len(group) < 2:
                    continue
                n = calls.get(group, 1)
                colls += [Collective("all_gather", group, float(s * gb), n, "forward"),
                          Collective("reduce_scatter", group, float(s * rb), n, "backward")]
                if g > s:
                    colls.append(Collective("all_gather", group, float((g - s) * gb), n,
                                            "backward"))
            out.append(colls)
        return out
    cap = spec.bucket_cap_mb * 2**20
    out = []
    for rec in analytic_comm(spec):
        colls = []
        by_coll = rec["by_collective"]
        for key, g in rec["by_group"].items():
            group = tuple(int(r) for r in key.split(","))
            if "broadcast" in by_coll:  # ddp+zero1: DDP's all-reduce, then the broadcasts
                ar = by_coll["all_reduce"]["payload"]
                colls += [Collective("all_reduce", group, ar, _buckets(ar, cap, first=True),
                                     "backward"),
                          Collective("broadcast", group, g["payload"] - ar, 1, "after")]
            elif "reduce_scatter+all_gather" in by_coll:  # ZeRO in holder groups
                n = _buckets(g["payload"], cap)
                colls += [Collective("reduce_scatter", group, g["payload"], n, "backward"),
                          Collective("all_gather", group, g["payload"], n, "after")]
            else:
                first = not spec.is_sdp  # torch DDP's small first bucket
                colls.append(Collective("all_reduce", group, g["payload"],
                                        _buckets(g["payload"], cap, first=first), "backward"))
        out.append(colls)
    return out


def _buckets(payload: float, cap: float, *, first: bool = False) -> int:
    if first and payload > DDP_FIRST_BUCKET:
        return 1 + math.ceil((payload - DDP_FIRST_BUCKET) / cap)
    return max(1, math.ceil(payload / cap))


def _fsdp_modules(spec: BenchSpec) -> dict[tuple[int, ...], int]:
    """FSDP modules per group (each one collective call per gather or reduce-scatter): the
    world's root (shared parameters) plus, per holder group, its blocks (the FSDP baselines:
    every block over the world)."""
    recipe, meta = meta_model(spec, check_seq=False)
    plan = make_bench_plan(spec, meta, recipe)
    world = tuple(range(spec.world))
    out: dict[tuple[int, ...], int] = defaultdict(int)
    out[world] = 1
    for u in range(plan.num_units):
        holders = world if not spec.is_sdp else tuple(sorted(plan.holders(u)))
        out[holders] += 1
    return dict(out)


@dataclass(frozen=True)
class RankFlops:
    forward: float
    backward: float
    recompute: float  # activation checkpointing: the checkpointed blocks' forward again

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute


def rank_flops(spec: BenchSpec, costs: ModelCosts, plan: Plan | None) -> list[RankFlops]:
    """Per rank, the FLOPs of one step (module docstring). ``plan`` None: a baseline (every
    rank runs everything)."""
    tokens = spec.batch * (costs.seq or 1)
    s = spec.strategy_value
    units = costs.units
    total_unit = sum(u.params for u in units) or 1

    def wgrad(u: UnitCost) -> float:
        # a weight gradient is 2 FLOPs per parameter and token (lm); convolutions reuse
        # weights over positions: half the backward, as for a linear layer
        return min(u.bwd_flops / 2, 2 * u.params * tokens) if costs.seq else u.bwd_flops / 2

    out = []
    for r in range(spec.world):
        if plan is None or not s.is_sdp:
            held = [1.0] * len(units)
        elif s.neuron_level:  # held fraction of every split layer
            frac = sum(plan.units[u].size for u in plan.held_units(r)) / total_unit
            held = [frac] * len(units)
        else:
            held_set = set(plan.held_units(r))
            held = [1.0 if i in held_set else 0.0 for i in range(len(units))]
        fwd = bwd = rec = 0.0
        for u, h in zip(units, held, strict=True):
            if s.backward_masked:  # full forward; input gradients everywhere
                fwd += u.fwd_flops
                bwd += u.bwd_flops - (1 - h) * wgrad(u)
                rec += u.fwd_flops if spec.uses_ac else 0.0
            else:
                fwd += h * u.fwd_flops
                bwd += h * u.bwd_flops
                rec += h * u.fwd_flops if spec.uses_ac else 0.0
        out.append(RankFlops(fwd + costs.shared.fwd_flops, bwd + costs.shared.bwd_flops, rec))
    return out


def pipelined(comm: float, compute: float, n: int) -> float:
    """Exposed time of ``comm`` cut into ``n`` equal pieces that pipeline with ``compute``
    (also cut in n): the first piece waits alone, each of the other n-1 hides behind one
    piece of compute: comm/n + (n-1)/n · max(0, comm - compute)."""
    if comm <= 0:
        return 0.0
    n = max(1, n)
    return comm / n + (n - 1) / n * max(0.0, comm - compute)


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
                 colls: list[list[Collective]] | None = None) -> StepTime:
    """The model's step time of ``spec`` on ``cluster`` (``cluster.world`` must be
    ``spec.world``) at ``rate`` model FLOP/s per rank; ``costs``: the recipe's at the spec's
    batch and sequence (measured when not given); ``overlap=False``: every collective on the
    critical path. ``plan`` (SDP) and ``colls`` (``collectives(spec)``): computed once by a
    caller that predicts one spec on several clusters."""
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
    fwd_s, bwd_s = slowest.forward / rate, (slowest.backward + slowest.recompute) / rate
    colls = colls if colls is not None else collectives(spec)
    wire = WIRE.get(backend, {})
    if spec.uses_fsdp and spec.ring_reduce_scatter and backend == "gloo":
        wire = {**wire, "reduce_scatter": RING_REDUCE_SCATTER_WIRE}
    comm: dict[str, float] = {}
    calls: dict[str, int] = {}
    for phase in ("forward", "backward", "after"):
        for kinds, name in ((("all_gather",), "gather"), (("all_reduce", "reduce_scatter",
                                                             "broadcast"), "reduce")):
            part = [[c for c in cs if c.phase == phase and c.kind in kinds] for cs in colls]
            if any(part):
                key = f"{phase} {name}"
                comm[key] = _phase_time(cluster, part, wire)
                calls[key] = max(sum(c.calls for c in cs) for cs in part)
    exposed = _exposed(comm, calls, fwd_s, bwd_s, spec) if overlap else dict(comm)
    tokens = spec.world * spec.batch * (costs.seq or 1)
    return StepTime(
        compute_s=fwd_s + bwd_s, comm_s=comm, exposed_s=exposed,
        ring_bytes=[sum(c.ring_bytes for c in cs) for cs in colls],
        wire_bytes=[sum(c.ring_bytes * wire.get(c.kind, 1.0) for c in cs) for cs in colls],
        flops=flops, tokens=tokens)


def _exposed(comm: dict[str, float], calls: dict[str, int], fwd_s: float, bwd_s: float,
             spec: BenchSpec) -> dict[str, float]:
    """Per phase, the part of ``comm`` on the critical path (module docstring): backward's
    gathers and reductions share one window, backward's compute."""
    out = {}
    prefetch = spec.fsdp_prefetch
    if "forward gather" in comm:  # FSDP's forward all-gathers
        c = comm["forward gather"]
        out["forward gather"] = pipelined(c, fwd_s, calls["forward gather"]) if prefetch else c
    gather, reduce = comm.get("backward gather", 0.0), comm.get("backward reduce", 0.0)
    n = max(calls.get("backward gather", 0), calls.get("backward reduce", 0))
    if prefetch:
        hidden = pipelined(gather + reduce, bwd_s, n)
    else:  # every all-gather waits; the reductions still pipeline
        hidden = gather + pipelined(reduce, bwd_s, n)
    if gather or reduce:
        out["backward"] = hidden
    for key in ("after gather", "after reduce"):  # after the optimizer step: exposed
        if key in comm:
            out[key] = comm[key]
    return out


def _phase_time(cluster: Cluster, per_rank: list[list[Collective]],
                wire: dict[str, float]) -> float:
    """Seconds for every rank's ``per_rank`` collectives: the busiest link's bytes over its
    bandwidth, plus the latency steps of the rank that has the most."""
    load: dict[tuple[str, int], float] = defaultdict(float)
    bandwidth: dict[tuple[str, int], float] = {}
    latency = 0.0
    for rank, colls in enumerate(per_rank):
        mine = 0.0
        for c in colls:
            f = wire.get(c.kind, 1.0)
            group = list(c.group)
            succ = group[(group.index(rank) + 1) % len(group)]
            crosses = len({cluster.node(r) for r in group}) > 1
            for link, bw in _links(cluster, rank, succ):
                load[link] += c.ring_bytes * f
                bandwidth[link] = bw
            alpha = cluster.inter.latency if crosses and cluster.inter else cluster.intra.latency
            mine += c.calls * c.steps(f) * alpha
        latency = max(latency, mine)
    busiest = max((load[k] / bandwidth[k] for k in load), default=0.0)
    return busiest + latency


def _links(cluster: Cluster, src: int, dst: int) -> list[tuple[tuple[str, int], float]]:
    a, b = cluster.node(src), cluster.node(dst)
    if a == b:
        return [(("node", a) if cluster.shared_intra else ("rank", src),
                 cluster.intra.bandwidth)]
    assert cluster.inter is not None
    nic = cluster.inter.bandwidth * cluster.nics
    return [(("out", a), nic), (("in", b), nic)]
