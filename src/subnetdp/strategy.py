"""What a rank is built as (the strategy, one table, and its composition: a ``RankSpec``) and
how its plan is made (a ``PlanSpec``), as plain values.

No torch here: the CLI, config validation, plans and reports ask these values instead of
comparing strategy strings, and ``subnetdp.parallelize`` turns them into a rank's model.

A strategy is a *level* (what a unit is: ``none`` = no subnetworks, ``block`` = residual
blocks, ``neuron`` = neuron groups of every layer pair) and a *masking* (``forward``: a worker
runs only what it holds; ``backward``: it runs the full model but trains only what it holds).
A new strategy is one row of ``STRATEGIES``; a new baseline one entry of ``Composition``.
Callers ask the row what it means (``splits_layers``, ``fsdp_keeps_gathered``,
``balanceable``, ...), never which level it is, so that a new level changes this table and
the module that builds its units.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from subnetdp.plan.objectives import DEFAULT_BALANCE

Level = Literal["none", "block", "neuron"]
Masking = Literal["none", "forward", "backward"]


@dataclass(frozen=True)
class Strategy:
    name: str
    level: Level
    masking: Masking
    help: str
    # the compositions ``plan cluster`` tries it with ("" = alone; ``advisor_options``)
    advised: tuple[str, ...] = ()
    # trained by the convergence study (``study.convergence``; nb-sdp: the quality study only)
    long_study: bool = False

    @property
    def is_sdp(self) -> bool:
        """Subnetworks at all (everything but ``ddp``)."""
        return self.level != "none"

    @property
    def neuron_level(self) -> bool:
        """Its level is neuron groups; outside this module ask what it means instead
        (``splits_layers``, ``balanceable``, ``fsdp_keeps_gathered``)."""
        return self.level == "neuron"

    @property
    def splits_layers(self) -> bool:
        """Its units are groups of every layer pair's hidden units (``subnet.neurons``), not
        whole blocks: a rank holds and runs a part of every layer, its layers are physically
        narrower (FSDP: one sub-layer per group), and the plan's units are the groups."""
        return self.neuron_level

    @property
    def plan_grows_with_world(self) -> bool:
        """Its plan splits every layer pair into groups per rank, so the plan's cells grow
        with the square of the world, not with the units."""
        return self.splits_layers

    @property
    def balanceable(self) -> bool:
        """Its units differ in cost, so a plan can balance them (``--scheme balanced``,
        per-rank budgets): block units; a layer's groups are equal, and ddp holds all."""
        return self.is_sdp and not self.splits_layers

    @property
    def fsdp_keeps_gathered(self) -> bool:
        """Under FSDP its held parts stay gathered from forward through backward: one
        all-gather per step, no reshard after forward, no prefetch ([Note: neuron groups] in
        ``runtime.fsdp``); blocks are gathered again for backward."""
        return self.splits_layers

    @property
    def backward_masked(self) -> bool:
        """Full forward on every worker; gradients and optimizer state only for held units."""
        return self.masking == "backward"

    @property
    def drops_blocks(self) -> bool:
        """Non-held blocks are removed from the local model (b-sdp)."""
        return self.level == "block" and self.masking == "forward"

    @property
    def default_output_scaling(self) -> str:
        """n-sdp scales kept hidden units by 1/keep-rate while training (measured: see
        ``subnet.scaling``); nothing else scales."""
        return "keep" if self.neuron_level and self.masking == "forward" else "none"

    @property
    def flop_scaled(self) -> bool:
        """Its forward runs only what a worker holds (about C of DDP's FLOPs per step), so the
        paper's FLOP-matched comparison gives it ``matched_steps`` for DDP's S."""
        return self.masking == "forward"

    @property
    def cost_masking(self) -> str:
        """The plan's cost model (``plan.worker_bytes``): what a worker stores and runs."""
        return "backward" if self.backward_masked else "forward"


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("ddp", "none", "none", "the full model on every worker (torch DDP)",
             long_study=True),
    Strategy("b-sdp", "block", "forward", "a subset of the blocks, forward and backward",
             advised=("", "+ac", "+fsdp", "+fsdp+ac", "+zero1", "+zero2"), long_study=True),
    Strategy("n-sdp", "neuron", "forward",
             "a subset of the neuron groups of every layer pair, physically narrower layers",
             advised=("", "+fsdp"), long_study=True),
    Strategy("bb-sdp", "block", "backward",
             "the full model forward; gradients and optimizer state only for held blocks",
             advised=("", "+fsdp"), long_study=True),
    Strategy("nb-sdp", "neuron", "backward", "as bb-sdp, at neuron level"),
)}
NAMES = tuple(STRATEGIES)
SDP_NAMES = tuple(n for n, s in STRATEGIES.items() if s.is_sdp)

# Precision, the same words everywhere: fp32; bf16-mixed = bf16 compute with fp32 master
# parameters, gradients and optimizer state (FSDP's MixedPrecisionPolicy under FSDP,
# torch.autocast otherwise); bf16 = everything stored and computed in bf16.
DTYPES = ("fp32", "bf16-mixed", "bf16")
# bytes per element of what a worker stores (parameters, gradients, optimizer state): the
# master dtype's (the plan's cost model, ``plan.worker_bytes``)
MASTER_BYTES = {"fp32": 4, "bf16-mixed": 4, "bf16": 2}
REDUCE_DTYPES = ("fp32", "bf16")
OUTPUT_SCALINGS = ("none", "keep")


def matched_steps(steps: int, coverage: float) -> int:
    """Steps of a ``flop_scaled`` method at ``coverage`` for the progress of DDP's ``steps``
    under the paper's FLOP-matched convention: round(S / C)."""
    return round(steps / coverage)


def get_strategy(name: str | Strategy) -> Strategy:
    if isinstance(name, Strategy):
        return name
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(NAMES)}") from None


@dataclass(frozen=True)
class Composition:
    """How a rank is built around its strategy: the parallelism it composes with, precision
    and the reducer's settings. ``parallelize`` reads nothing else.

    ``fsdp``: FSDP2 inside each holder group (with ``ddp``: plain FSDP2 over the world);
    ``ac``: activation checkpointing per block; ``reduce_dtype``: the dtype FSDP averages
    gradients in (None: the master dtype); ``ddp_bucket_view``: torch DDP writes gradients
    straight into its buckets (one gradient copy, like subnetdp's reducer: the fair
    baseline); False is torch's default, a second gradient copy, only ever as a labelled
    extra baseline; ``output_scaling``: None = the strategy's default; ``fsdp_prefetch``:
    SDP + FSDP2 prefetches the adjacent held block (``runtime.fsdp``, [Note: one global
    order]); False issues every all-gather when its block runs; ``zero``: ZeRO-1 (1: optimizer
    state) or ZeRO-2 (2: also the reduced gradients) sharded over each unit's holders
    (``runtime.zero``; with ``ddp``: torch's ZeroRedundancyOptimizer for 1, the holder reducer
    at full coverage for 2); ``ring_reduce_scatter``: FSDP2's reduce-scatter over gloo is a
    ring of point-to-point sends (``runtime.ring``: (h-1)/h of the gradient on the wire, not
    gloo's all-reduce, 2(h-1)/h); ``async_unshard``: FSDP2 over gloo issues its all-gathers
    asynchronously, so that prefetch overlaps compute (``runtime.ring.GlooComms``; FSDP2's
    default blocks on a CPU). False keeps gloo's reduce-scatter or FSDP2's blocking
    all-gathers, only as labelled comparisons; other backends always run FSDP2's defaults."""

    fsdp: bool = False
    ac: bool = False
    dtype: str = "fp32"
    reduce_dtype: str | None = None
    bucket_cap_mb: float = 25.0
    output_scaling: str | None = None
    refresh_every: int = 1
    ddp_bucket_view: bool = True
    fsdp_prefetch: bool = True
    zero: int = 0
    compile: bool = False  # torch.compile per block (runtime.compile)
    ring_reduce_scatter: bool = True
    async_unshard: bool = True

    def check(self, strategy: Strategy) -> None:
        """Refuse combinations that cannot be built, with a message that says what to do."""
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.reduce_dtype is not None and self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"--reduce-dtype must be one of {', '.join(REDUCE_DTYPES)}, got "
                             f"{self.reduce_dtype!r}")
        if self.reduce_dtype is not None and not self.fsdp:
            raise ValueError("--reduce-dtype needs --fsdp (without it gradients are averaged "
                             "in the master dtype)")
        if self.output_scaling not in (None, *OUTPUT_SCALINGS):
            raise ValueError(f"--output-scaling must be one of {', '.join(OUTPUT_SCALINGS)}, "
                             f"got {self.output_scaling!r}")
        if self.output_scaling == "keep" and strategy.default_output_scaling != "keep":
            raise ValueError("--output-scaling keep applies to n-sdp only (forward-masked "
                             "neurons)")
        if self.refresh_every < 1:
            raise ValueError(f"--refresh-every must be >= 1 (1 = exact), got "
                             f"{self.refresh_every}")
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"--bucket-cap-mb must be > 0, got {self.bucket_cap_mb}")
        if self.zero not in (0, 1, 2):
            raise ValueError(f"--zero must be 0, 1 or 2, got {self.zero}")
        if self.zero and self.fsdp:
            raise ValueError("--zero does not combine with --fsdp (FSDP already shards "
                             "parameters, gradients and optimizer state); drop one of them")
        if not self.ddp_bucket_view and (strategy.is_sdp or self.fsdp):
            raise ValueError("ddp_bucket_view=False is torch DDP's default buckets, a ddp "
                             "baseline only")

    def replace(self, **changes: object) -> Composition:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def local_steps_problems(every: int, fragments: int, *, zero: int, fsdp: bool) -> list[str]:
    """What a run (``train.config``) or a benchmark (``estimate.spec.BenchSpec``) with
    ``--sync-every every --sync-fragments fragments`` cannot do, one line each (local steps:
    ``runtime.local_steps``; here, where a check needs no torch)."""
    if every < 1 or fragments < 1 or every % fragments:
        return [f"--sync-every ({every}) must be >= 1 and a multiple of --sync-fragments "
                f"({fragments})"]
    if every == 1:
        return []
    return [f"{name} shards a unit over its holders, who train apart between syncs with "
            f"--sync-every {every}: drop {name}, or --sync-every"
            for name, on in (("--zero", zero), ("--fsdp", fsdp)) if on]


def label(strategy: Strategy, comp: Composition, coverage: float | None = None) -> str:
    """A run's or a benchmark row's name: ``ddp``, ``ddp+ac``, ``fsdp``, ``fsdp+ac``,
    ``ddp (default buckets)``, ``b-sdp+fsdp+ac (C=0.5)``."""
    if not strategy.is_sdp:
        base = "fsdp" if comp.fsdp else "ddp"
        name = base + ("+ac" if comp.ac else "") + (f"+zero{comp.zero}" if comp.zero else "")
        name = name if comp.ddp_bucket_view else f"{name} (default buckets)"
        return _gloo_label(name, comp)
    name = strategy.name + ("+fsdp" if comp.fsdp else "") + ("+ac" if comp.ac else "")
    name += f"+zero{comp.zero}" if comp.zero else ""
    name = name if coverage is None else f"{name} (C={coverage:g})"
    name = name if comp.fsdp_prefetch or not comp.fsdp else f"{name} (no prefetch)"
    return _gloo_label(name, comp)


def _gloo_label(name: str, comp: Composition) -> str:
    if not comp.fsdp:
        return name
    name = name if comp.ring_reduce_scatter else f"{name} (gloo rs)"
    return name if comp.async_unshard else f"{name} (sync unshard)"


BASELINES = ("ddp", "ddp+ac", "fsdp", "fsdp+ac")
# ZeRO baselines: DDP with torch's ZeroRedundancyOptimizer (zero1); the holder reducer at full
# coverage with sharded gradients and state (zero2: torch DDP cannot shard gradients)
ZERO_BASELINES = ("ddp+zero1", "ddp+zero2")


def advisor_options() -> tuple[str, ...]:
    """What ``plan cluster`` tries by default, as ``parse_label`` reads it: every baseline,
    then each strategy's ``advised`` compositions, in table order."""
    return (*BASELINES, *ZERO_BASELINES,
            *(s.name + comp for s in STRATEGIES.values() if s.is_sdp for comp in s.advised))


def parse_label(text: str) -> tuple[Strategy, Composition]:
    """The inverse of ``label`` for names without coverage: ``fsdp+ac`` is ddp with FSDP and
    activation checkpointing, ``b-sdp+fsdp`` is b-sdp composed with FSDP."""
    head, *mods = text.split("+")
    unknown = [m for m in mods if m not in ("fsdp", "ac", "zero1", "zero2")]
    zeros = [int(m[4:]) for m in mods if m.startswith("zero")]
    if unknown or len(set(mods)) != len(mods) or len(zeros) > 1:
        raise ValueError(f"unknown strategy {text!r}; choose one of "
                         f"{', '.join((*BASELINES, *SDP_NAMES))}, optionally with "
                         "+fsdp/+ac/+zero1/+zero2")
    fsdp = head == "fsdp" or "fsdp" in mods
    strategy = get_strategy("ddp" if head == "fsdp" else head)
    if not strategy.is_sdp and head == "ddp" and "fsdp" in mods:
        raise ValueError(f"{text!r}: the FSDP baseline is spelled 'fsdp' (or 'fsdp+ac')")
    comp = Composition(fsdp=fsdp, ac="ac" in mods, zero=zeros[0] if zeros else 0)
    comp.check(strategy)
    return strategy, comp


# The strategy the holder reducer runs a baseline as (everyone holds every block: exactly
# DDP's bucket-view memory and traffic): ``ddp+zero2``, and ddp inside the fake-tensor
# estimator, where torch DDP's C++ reducer cannot run.
HOLDER_REDUCER = STRATEGIES["b-sdp"]


def composition_of(source: Any) -> Composition:
    """The ``Composition`` of a flat config (an object or a mapping) that spells its fields
    by Composition's names (``TrainConfig``, ``BenchSpec``, a run's config.json): the one
    mapping, so that no config drops a field. Fields it lacks keep their defaults."""
    return Composition(**_fields(Composition, source))


def _fields(cls: Any, source: Any) -> dict[str, Any]:
    """``cls``'s fields read by name from an object or a mapping (missing: the default)."""
    get = source.get if isinstance(source, Mapping) else (
        lambda name, default: getattr(source, name, default))
    return {f.name: get(f.name, f.default) for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class RankSpec:
    """What one rank is built as: a strategy and its composition, checked together once (at
    construction). ``parallelize`` and ``SubnetDataParallel`` take it as checked."""

    strategy: Strategy
    comp: Composition = Composition()

    def __post_init__(self) -> None:
        self.comp.check(self.strategy)

    @classmethod
    def of(cls, strategy: str | Strategy, comp: Composition | None = None) -> RankSpec:
        """From a strategy name (the CLI's, a config file's, a public keyword's) or value."""
        return cls(get_strategy(strategy), comp or Composition())

    def label(self, coverage: float | None = None) -> str:
        """The run's or benchmark row's name (``label``); ``coverage`` only shows for SDP."""
        return label(self.strategy, self.comp, coverage if self.strategy.is_sdp else None)


@dataclass(frozen=True)
class PlanSpec:
    """How a run's plan is made (``subnet.planning.build_plan``): from ``plan_file``, or by
    ``scheme`` at ``coverage`` (``capacities``: per-rank shares, a balanced plan instead of
    ``coverage``), balancing ``balance`` (``plan.objectives``), every unit held by at least
    ``min_holders``; n-sdp splits each layer pair into ``neuron_groups`` groups of the pair
    kinds ``neuron_kinds`` (None: defaults), ``rotate`` rotating the window by layer; over
    ``nnodes`` nodes, ``spread_nodes`` puts each unit's holders on two or more nodes
    ([Note: holders across nodes] in plan/nodes.py)."""

    coverage: float = 1.0
    scheme: str = "spread"
    balance: str = DEFAULT_BALANCE
    capacities: tuple[float, ...] | None = None
    min_holders: int = 1
    max_groups: int | None = None  # at most this many distinct holder sets (plan.schemes)
    neuron_groups: int | None = None
    neuron_kinds: str | None = None
    rotate: bool = False
    plan_file: str | None = None
    seed: int = 0
    nnodes: int = 1
    spread_nodes: bool = True

    @classmethod
    def of(cls, source: Any) -> PlanSpec:
        """From a flat config (an object or a mapping) spelling PlanSpec's field names."""
        values = _fields(cls, source)
        if values["capacities"] is not None:
            values["capacities"] = tuple(values["capacities"])
        return cls(**values)

    @property
    def balanced(self) -> bool:
        """Per-rank capacities are always a balanced plan."""
        return self.capacities is not None or self.scheme == "balanced"

    @property
    def spreads_nodes(self) -> bool:
        """Holders are spread over nodes: on by default with several nodes and a second
        holder asked for (``--min-holders 2``); a plan file is taken as written."""
        return (self.spread_nodes and self.nnodes > 1 and self.min_holders >= 2
                and self.plan_file is None and len(set(self.capacities or (1.0,))) == 1)

    @property
    def plan_coverage(self) -> float:
        """The coverage the scheme gets (capacities replace it)."""
        return 1.0 if self.capacities is not None else self.coverage
