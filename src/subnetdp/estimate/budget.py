"""Memory-budget planner: which strategies and coverages fit in ``memory_gb`` per worker.

Options are ranked by predicted quality first: coverage 1 (``ddp``, ``fsdp``, with or without
activation checkpointing: the full model trains on every worker) before any SDP coverage, and
higher coverage before lower (the paper's quality follows coverage). Ties go to the option
that sends fewer bytes per step, then to the one with the smaller peak.

Every figure is the fake-mode estimator's (``estimate.py``), so a search costs a few estimates,
not a sweep: memory grows with coverage, so for each SDP strategy a binary search over the k
units per worker finds the largest coverage that fits with about log2(U) estimates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from subnetdp.estimate.comm import analytic_comm, worst_comm
from subnetdp.estimate.memory import estimate_memory
from subnetdp.estimate.spec import BenchSpec, meta_model
from subnetdp.strategy import BASELINES, SDP_NAMES

GiB = float(1 << 30)
GB = 1e9


@dataclass(frozen=True)
class Option:
    spec: BenchSpec
    peak_bytes: int
    comm_ring_bytes: float
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.spec.strategy, "fsdp": self.spec.fsdp, "ac": self.spec.ac,
                "coverage": self.spec.coverage,
                "label": self.spec.label, "peak_bytes": self.peak_bytes,
                "peak_GB": self.peak_bytes / GB, "comm/ring_bytes_per_step": self.comm_ring_bytes,
                "fits": self.fits}


Estimator = Callable[[BenchSpec], int]


def _estimate_peak(spec: BenchSpec) -> int:
    # the worst rank sets the budget; the planner needs it only, so estimate every distinct row
    return estimate_memory(spec).peak_bytes


def _num_units(spec: BenchSpec) -> int:
    from subnetdp.estimate.spec import make_bench_plan

    recipe, meta = meta_model(spec)
    plan = make_bench_plan(spec.replace(coverage=1.0), meta, recipe)
    # neuron level: units per layer are the groups (= world); block level: the blocks
    neuron = spec.strategy_value.neuron_level
    return min(spec.world, plan.num_units) if neuron else plan.num_units


def plan_budget(
    base: BenchSpec, memory_gb: float, *, strategies: tuple[str, ...] | None = None,
    estimator: Estimator = _estimate_peak, fsdp: bool = False, ac: bool = False,
) -> list[Option]:
    """Options for ``base`` (recipe, world, batch, seq, dtype), best first; each SDP strategy
    contributes its highest fitting coverage (or its lowest tried one, marked not fitting).
    ``fsdp``/``ac`` compose the SDP strategies (baselines keep theirs: ``fsdp+ac``...)."""
    if memory_gb <= 0:
        raise ValueError(f"--memory-gb must be > 0, got {memory_gb}")
    budget = int(memory_gb * GB)
    chosen = strategies or (*BASELINES, *SDP_NAMES)
    options: list[Option] = []
    for strategy in chosen:
        spec = base.replace(strategy=strategy, coverage=1.0)
        if not spec.is_sdp:
            options.append(_option(spec, estimator(spec), budget))
        else:
            spec = spec.replace(fsdp=fsdp, ac=ac)
            options.append(_best_coverage(spec, budget, estimator))
    return sorted(options, key=lambda o: (not o.fits, -o.spec.coverage, o.comm_ring_bytes,
                                          o.peak_bytes))


def _option(spec: BenchSpec, peak: int, budget: int) -> Option:
    ring = worst_comm(analytic_comm(spec))["comm/ring_bytes_per_step"]
    return Option(spec, peak, ring, peak <= budget)


def _best_coverage(spec: BenchSpec, budget: int, estimator: Estimator) -> Option:
    """Binary search for the largest k (units per worker, k/U coverage) whose peak fits."""
    from subnetdp.plan import min_units_per_worker

    units = _num_units(spec)
    # below this k some unit has no holder, or the spread plan cannot be connected
    lo = min_units_per_worker(spec.world, units, connected=True)
    hi = units  # invariant: every k < lo fits (or is impossible), every k > hi does not
    peaks: dict[int, int] = {}

    def peak(k: int) -> int:
        if k not in peaks:
            peaks[k] = estimator(spec.replace(coverage=k / units))
        return peaks[k]

    best = 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if peak(mid) <= budget:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    k = best or min_units_per_worker(spec.world, units, connected=True)
    return _option(spec.replace(coverage=k / units), peak(k), budget)


def format_options(options: list[Option], base: BenchSpec, memory_gb: float) -> str:
    lines = [
        f"budget {memory_gb:g} GB per worker: {base.recipe}, {base.world} workers, micro-batch "
        f"{base.batch} x {base.seq} tokens, {base.dtype}; best predicted quality first",
        f"{'option':<26} {'fits':>4} {'peak GB':>9} {'ring MB/step':>13}",
    ]
    for o in options:
        lines.append(f"{o.spec.label:<26} {'yes' if o.fits else 'no':>4} "
                     f"{o.peak_bytes / GB:>9.2f} {o.comm_ring_bytes / 1e6:>13.1f}")
    if not any(o.fits for o in options):
        lines.append("nothing fits: lower --batch-size or --seq-len, use bf16-mixed or bf16, "
                     "compose with --fsdp/--ac, or add workers")
    return "\n".join(lines)
