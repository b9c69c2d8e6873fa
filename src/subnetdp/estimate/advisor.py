"""The strategy advisor: per strategy and coverage on a cluster, whether it fits, its peak
memory, bytes and predicted step time; the fastest that fits is marked.

``advise(base, clusters, memory_gb=, rate=)`` tries ``candidates(base)`` (``OPTIONS``, from the
strategy table: ``strategy.advisor_options``: the baselines ddp, ddp+ac, fsdp, fsdp+ac,
ddp+zero1, ddp+zero2; b-sdp alone and composed with ac, fsdp, fsdp+ac, zero1, zero2; n-sdp and
bb-sdp alone and with fsdp; every SDP option at each of ``coverages``).

Memory is the fast analytic path (``analytic_peak``), not the fake-mode estimator (a real step
under fake tensors: minutes per configuration at paper scale, ``estimate.budget``): the state
(parameters, gradients, optimizer) is ``estimate.memory.analytic_state``'s, exact; saved
activations are the units' counted on the meta device (``subnet.costs``) for the units a rank
runs, plus the fp32 logits the loss keeps; with activation checkpointing a block keeps only
its input, and one block's activations exist again while it is recomputed; temporaries are
the loss's two fp32 logits-sized buffers; FSDP adds the unsharded parameters of the root and
of two blocks (the running one and the prefetched one; n-sdp keeps its held groups gathered
through backward). On llama-tiny this is within a few percent of the fake-mode estimate
(``docs/advisor.md``); what it leaves out is allocator rounding. NCCL's buffers are added per
communicator, for the rank that joins the most holder groups (``spec.comm_mem_mb`` each, or
shared by the groups split from the world one: ``estimate.communicators``); the CLI gives 0
where the collectives are gloo's (``Device.backend``).

Step time is ``estimate.steptime``'s on the cluster, at ``rate`` (``estimate.rates``: measured
or marked assumed).

[Note: matched progress]
Per step, an SDP option at coverage C trains each block on a C share of the data, so its
tokens/s per step flatter it by about 1/C. The table ranks at the paper's FLOP-matched
convention, as the project's studies do (``study.suite``): a ``Strategy.flop_scaled`` option
(b-sdp, n-sdp) takes ``strategy.matched_steps`` = round(S / C) steps for the progress of
ddp's S, every other option S (bb-sdp runs the full forward). ``Advice.matched_s`` is the
time for S = ``PROGRESS_STEPS`` steps' progress; the fastest that fits is the least of it.

Cost: ranks with the same plan row share their groups, collectives, FLOPs and bucket
timeline (``estimate.comm.by_row``), so the work grows with the plan's distinct rows: a
block-level plan has a few (llama-1b on 8,000 ranks: 24), and 1,000 nodes x 8 GPUs answer in
seconds. A neuron-level plan (n-sdp) has one group per rank in every layer pair, so every row
differs and its plan grows with the square of the world: beyond ``NEURON_PLAN_CELLS`` plan
cells (ranks x units) its options are left out, and the table says so (``too_large``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from subnetdp.estimate.cluster import Cluster
from subnetdp.estimate.communicators import communicator_bytes, describe_communicators
from subnetdp.estimate.memory import analytic_state, fsdp_unit_shapes
from subnetdp.estimate.rates import Rate
from subnetdp.estimate.spec import BenchSpec, make_bench_plan, meta_model
from subnetdp.estimate.steptime import (
    Collective,
    StepTime,
    collectives,
    predict_step,
    with_local_steps,
)
from subnetdp.plan.communicators import communicators_per_rank
from subnetdp.strategy import STRATEGIES, advisor_options, matched_steps
from subnetdp.subnet.costs import ModelCosts, recipe_costs
from subnetdp.subnet.neurons import default_groups, select_pairs

GB = 1e9
# what the advisor tries by default (names as ``strategy.parse_label`` reads them); every
# SDP option at each coverage
OPTIONS = advisor_options()
COVERAGES = (0.5, 0.75)
# ranks x units of the largest neuron-level plan the advisor builds (llama-tiny: 8 layer
# pairs, so about 500 ranks; llama-1b: 32 pairs, about 250): beyond it n-sdp's groups,
# one per rank per pair, make its plan and its collectives quadratic in the world
NEURON_PLAN_CELLS = 2_000_000
# S, ddp's steps of the progress the table compares at ([Note: matched progress])
PROGRESS_STEPS = 1000
FLOP_SCALED = " and ".join(n for n, s in STRATEGIES.items() if s.flop_scaled)
# local steps (--sync-every): the advisor's H syncs in at most this share of a step's compute
SYNC_SHARE = 0.1


@dataclass(frozen=True)
class Advice:
    spec: BenchSpec
    peak_bytes: float
    fits: bool
    time: StepTime
    fastest: bool = False
    sync_every: int | None = None  # the smallest H of local steps (``sync_every``'s doc)

    @property
    def steps(self) -> int:
        return progress_steps(self.spec)

    @property
    def matched_s(self) -> float:
        return self.steps * self.time.step_s

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.spec.label, "coverage": self.spec.coverage,
                "peak_GB": self.peak_bytes / GB, "fits": self.fits, "fastest": self.fastest,
                "matched_steps": self.steps, "matched_s": self.matched_s,
                "sync_every": self.sync_every, **self.time.to_dict()}


def progress_steps(spec: BenchSpec) -> int:
    """``spec``'s steps for the progress of ddp's ``PROGRESS_STEPS`` ([Note: matched
    progress])."""
    flop_scaled = spec.is_sdp and spec.strategy_value.flop_scaled
    return matched_steps(PROGRESS_STEPS, spec.coverage) if flop_scaled else PROGRESS_STEPS


def candidates(base: BenchSpec, coverages: tuple[float, ...] = COVERAGES,
               options: tuple[str, ...] = OPTIONS) -> list[BenchSpec]:
    """``base`` as each option; an SDP option once per coverage."""
    out = []
    for option in options:
        spec = base.replace(strategy=option, coverage=1.0)
        if spec.is_sdp:  # composed by flags, as every estimator reads an SDP spec
            rank = spec.rank
            spec = spec.replace(strategy=rank.strategy.name, fsdp=rank.comp.fsdp,
                                ac=rank.comp.ac, zero=rank.comp.zero)
            out += [spec.replace(coverage=c) for c in coverages]
        else:
            out.append(spec)
    return out


def advise(base: BenchSpec, clusters: list[Cluster], *, memory_gb: float, rate: float | Rate,
           coverages: tuple[float, ...] = COVERAGES, options: tuple[str, ...] = OPTIONS,
           backend: str | None = None, overlap: bool = True) -> list[list[Advice]]:
    """Per cluster (all of one size), every candidate of ``base`` (recipe, batch, seq, dtype;
    world = the clusters') with its memory and step time; the fastest that fits marked.
    Memory, plans and collectives do not depend on the links: computed once. ``rate``: model
    FLOP/s per rank (``estimate.rates``); ``backend``: the collectives' (default: the
    device's, ``Device.backend``). The fastest is at matched progress ([Note: matched
    progress])."""
    flops, call_s, terms = ((rate.flops, rate.call_s or 0.0, rate.terms)
                            if isinstance(rate, Rate) else (rate, 0.0, None))
    if memory_gb <= 0:
        raise ValueError(f"--memory-gb must be > 0, got {memory_gb}")
    if len({c.world for c in clusters}) != 1:
        raise ValueError("the clusters of one table must have the same number of ranks")
    base = base.replace(world=clusters[0].world)
    backend = backend or clusters[0].device.backend
    recipe, meta = meta_model(base)
    if recipe.task != "lm":
        raise ValueError(f"the advisor plans language models; {base.recipe} is {recipe.task}")
    costs = recipe_costs(recipe, batch=base.batch, seq=base.seq, model_args=dict(base.model_args))
    known = []
    for spec in candidates(base, coverages, options):
        if too_large(spec, meta, recipe):
            continue
        plan = make_bench_plan(spec, meta, recipe) if spec.is_sdp else None
        known.append((spec, plan, collectives(spec, plan), analytic_peak(spec, costs, plan)))
    tables = []
    for cluster in clusters:
        rows = []
        for spec, plan, colls, peak in known:
            t = predict_step(spec, cluster, rate=flops, backend=backend, costs=costs,
                             overlap=overlap, plan=plan, colls=colls, call_s=call_s,
                             terms=terms)
            rows.append(Advice(spec, peak, peak <= memory_gb * GB, t,
                               sync_every=sync_every(spec, cluster, t, colls, backend)))
        fitting = [a for a in rows if a.fits]
        if fitting:
            best = min(fitting, key=lambda a: a.matched_s)
            rows = [dataclasses.replace(a, fastest=True) if a is best else a for a in rows]
        tables.append(rows)
    return tables


def sync_every(spec: BenchSpec, cluster: Cluster, t: StepTime, colls: list[list[Collective]],
               backend: str) -> int | None:
    """The smallest power-of-two H with which local steps (``--sync-every H``, fp32, whole
    syncs: ``steptime.with_local_steps``) spend at most ``SYNC_SHARE`` of the compute of a
    step on syncs; None where local steps are refused (FSDP, ZeRO shard over holders)."""
    if spec.uses_fsdp or spec.composition().zero:
        return None
    window = with_local_steps(t, spec, cluster, every=1, backend=backend,
                              colls=colls).exposed_comm_s
    budget = SYNC_SHARE * t.compute_s
    return 1 if window <= budget else 2 ** math.ceil(math.log2(window / budget))


def too_large(spec: BenchSpec, meta: Any, recipe: Any) -> bool:
    """Whether ``spec`` is a neuron-level plan over ``NEURON_PLAN_CELLS`` (module docstring)."""
    if not spec.strategy_value.plan_grows_with_world:
        return False
    ps = spec.plan_spec
    kinds = [k for k in ps.neuron_kinds.split(",") if k] if ps.neuron_kinds else None
    pairs = len(select_pairs(meta, recipe.adapter, kinds))
    groups = ps.neuron_groups or default_groups(spec.world, spec.coverage)
    return spec.world * pairs * groups > NEURON_PLAN_CELLS


def left_out(base: BenchSpec, world: int, coverages: tuple[float, ...] = COVERAGES,
             options: tuple[str, ...] = OPTIONS) -> list[str]:
    """The labels ``advise`` leaves out on ``world`` ranks (``too_large``)."""
    base = base.replace(world=world)
    recipe, meta = meta_model(base)
    return [s.label for s in candidates(base, coverages, options) if too_large(s, meta, recipe)]


def analytic_peak(spec: BenchSpec, costs: ModelCosts, plan: Any = None) -> float:
    """The peak of the rank holding the most (module docstring), bytes; ``plan``: the spec's
    (SDP; made when not given)."""
    recipe, meta = meta_model(spec)
    if plan is None and spec.is_sdp:
        plan = make_bench_plan(spec, meta, recipe)
    act_scale = 0.5 if spec.compute_dtype is not None else spec.param_bytes / 4
    config = getattr(meta, "config", None)
    dim, vocab = int(getattr(config, "dim", 0)), int(getattr(config, "vocab_size", 0))
    logits = spec.batch * spec.seq * vocab * 4
    block_input = spec.batch * spec.seq * dim * 4 * act_scale
    # the rank that runs and holds the most (the ranks' shards differ by a row at most)
    r = 0 if plan is None else max(range(spec.world), key=lambda k: (plan.held_size(k), -k))
    runs = _runs(spec, plan, r, len(costs.units))
    units = [(u, f) for u, f in zip(costs.units, runs, strict=True) if f > 0]
    if spec.uses_ac:
        acts = sum(f * block_input for _, f in units) + max(
            (f * u.act_bytes for u, f in units), default=0.0) * act_scale
    else:
        acts = sum(f * u.act_bytes for u, f in units) * act_scale
    acts += costs.shared.act_bytes * act_scale + logits
    state = sum(analytic_state(spec, r, plan).values())
    # NCCL's own buffers, of the rank that joins the most groups: never promise what NCCL
    # takes back ([Note: communicator memory])
    comms = max(communicators_per_rank(plan)) if plan is not None else 1
    return (state + acts + 2 * logits + _gathered(spec, meta, recipe, plan, r)
            + communicator_bytes(comms, spec.comm_mem_mb, shared=spec.comm_split_shared))


def _runs(spec: BenchSpec, plan: Any, rank: int, n_units: int) -> list[float]:
    """Per unit, how much of it ``rank`` runs forward and keeps activations of."""
    s = spec.strategy_value
    if plan is None or s.backward_masked:
        return [1.0] * n_units
    if s.splits_layers:  # a share of every block
        total = sum(u.size for u in plan.units)
        return [sum(plan.units[u].size for u in plan.held_units(rank)) / total] * n_units
    held = set(plan.held_units(rank))
    return [1.0 if u in held else 0.0 for u in range(n_units)]


def _gathered(spec: BenchSpec, meta: Any, recipe: Any, plan: Any, rank: int) -> float:
    """FSDP's unsharded parameters at the peak: the root's, two blocks' (running and
    prefetched; n-sdp: every held group, kept through backward), minus this rank's shards of
    them (already in the state)."""
    if not spec.uses_fsdp:
        return 0.0
    if plan is None:
        from subnetdp.subnet.units import unit_modules

        blocks = [sum(p.numel() for p in b.parameters())
                  for _, b in unit_modules(meta, recipe.adapter)]
        shared = sum(p.numel() for p in meta.parameters()) - sum(blocks)
        held = blocks
    else:
        shapes, shared_shapes = fsdp_unit_shapes(meta, recipe.adapter, plan, spec.strategy_value)
        shared = sum(math.prod(x) for x in shared_shapes)
        held = [sum(math.prod(x) for x in shapes[u]) for u in plan.held_units(rank)]
    keep = held if spec.strategy_value.fsdp_keeps_gathered else sorted(held)[-2:]
    return float((shared + sum(keep)) * spec.gather_bytes)


def format_advice(rows: list[Advice], cluster: Cluster, base: BenchSpec, *,
                  memory_gb: float, rate: Rate, overlap: bool, memory_given: bool = True,
                  skipped: list[str] | None = None) -> str:
    """The table of one cluster: the assumptions (each value not measured for this run marked
    "assumed"), the convention it ranks by, a row per option."""
    memory_mark = "" if memory_given or not cluster.device.memory_assumed else " (assumed)"
    lines = [
        f"{base.recipe} on {cluster.describe()}",
        f"assumptions: {base.dtype}; {rate.describe()}; memory {memory_gb:g} GB per rank"
        f"{memory_mark}; micro-batch {base.batch} x {base.seq} tokens per rank; "
        + describe_communicators(cluster.device.backend, base.comm_mem_mb,
                                 base.comm_split_shared) + "; overlap "
        + ("on (buckets hide behind backward, FSDP prefetches adjacent blocks)" if overlap
           else "off (all communication exposed)"),
        f"ranked at matched progress (the paper's FLOP-matched convention): {FLOP_SCALED} "
        f"take round(S / C) steps for ddp's S, every other option S; 'time s' is S = "
        f"{PROGRESS_STEPS} ddp steps' progress; per-step figures beside it",
        f"{'option':<28} {'fits':>4} {'peak GB':>8} {'ring MB':>9} {'compute s':>10} "
        f"{'comm s':>8} {'step s':>8} {'tokens/s':>10} {'steps':>6} {'time s':>9}",
    ]
    for a in rows:
        t = a.time
        lines.append(f"{a.spec.label:<28} {'yes' if a.fits else 'no':>4} "
                     f"{a.peak_bytes / GB:>8.2f} {max(t.ring_bytes, default=0) / 1e6:>9.1f} "
                     f"{t.compute_s:>10.3f} {t.exposed_comm_s:>8.3f} {t.step_s:>8.3f} "
                     f"{t.tokens_per_s:>10.0f} {a.steps:>6} {a.matched_s:>9.1f}"
                     + ("  <- fastest that fits" if a.fastest else ""))
    if not any(a.fits for a in rows):
        lines.append("nothing fits: lower --batch-size or --seq-len, use --dtype bf16-mixed, "
                     "or add GPUs")
    if skipped:
        lines.append(f"not estimated on {cluster.world} ranks: {', '.join(skipped)} (a "
                     "neuron-level plan has a group per rank in every layer pair: its plan and "
                     f"collectives grow with the square of the ranks; limit {NEURON_PLAN_CELLS:,} "
                     "plan cells)")
    local = [f"{a.spec.label} {a.sync_every}" for a in rows if a.fits and a.sync_every]
    if local:
        lines.append(f"local steps (--sync-every H, docs/strategies.md): the smallest H whose "
                     f"syncs take at most {SYNC_SHARE:.0%} of the compute: " + ", ".join(local))
    lines.append("ring MB: bytes the busiest rank sends per step (counted, estimate.comm); "
                 "comm s: exposed communication; quality is not part of this table")
    return "\n".join(lines)
