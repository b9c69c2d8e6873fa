"""Memory-budget planner: which strategies and coverages fit in ``memory_gb`` per worker.

Options are ranked by predicted quality first: coverage 1 (``ddp``, ``fsdp``, with or without
activation checkpointing: the full model trains on every worker) before any SDP coverage, and
higher coverage before lower (the paper's quality follows coverage). Ties go to the option
that sends fewer bytes per step, then to the one with the smaller peak.

Every figure is the fake-mode estimator's (``estimate.py``), so a search costs a few estimates,
not a sweep: memory grows with coverage, so for each SDP strategy a binary search over the k
units per worker finds the largest coverage that fits with about log2(U) estimates. Each
estimate is a real step under fake tensors (seconds for llama-tiny; 1.5 to 3.5 minutes for
llama-1b at 8 workers on a shared 2-core machine, at most 20 of them for every strategy), so
the search memoises them by their full spec and reports each one as it finishes
(``Estimates``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

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
T = TypeVar("T")


class Estimates(Generic[T]):
    """``fn`` (an estimator) memoised by the full spec for one search, announcing each new
    estimate on ``log`` with its time and, once the caller sets ``left`` (an upper bound of
    the estimates still to come), how many may remain."""

    def __init__(self, fn: Callable[[BenchSpec], T],
                 log: Callable[[str], None] | None = None) -> None:
        self.fn = fn
        self.log = log
        self.known: dict[BenchSpec, T] = {}
        self.left: int | None = None

    def __call__(self, spec: BenchSpec) -> T:
        if spec in self.known:
            return self.known[spec]
        t0 = time.perf_counter()
        self.known[spec] = result = self.fn(spec)
        if self.left is not None:
            self.left = max(0, self.left - 1)
        if self.log is not None:
            more = "" if self.left is None else f", at most {self.left} more"
            self.log(f"estimate {len(self.known)}{more}: {spec.label} on {spec.recipe}, "
                     f"{spec.world} workers, {time.perf_counter() - t0:.1f} s")
        return result


def _estimate_peak(spec: BenchSpec) -> int:
    # the worst rank sets the budget; the planner needs it only, so estimate every distinct row
    return estimate_memory(spec).peak_bytes


def _num_units(spec: BenchSpec) -> int:
    from subnetdp.estimate.spec import make_bench_plan

    recipe, meta = meta_model(spec)
    plan = make_bench_plan(spec.replace(coverage=1.0), meta, recipe)
    # split layers: units per layer are the groups (= world); else the blocks
    split = spec.strategy_value.splits_layers
    return min(spec.world, plan.num_units) if split else plan.num_units


def plan_budget(
    base: BenchSpec, memory_gb: float, *, strategies: tuple[str, ...] | None = None,
    estimator: Estimator | None = None, fsdp: bool = False, ac: bool = False,
    log: Callable[[str], None] | None = None,
) -> list[Option]:
    """Options for ``base`` (recipe, world, batch, seq, dtype), best first; each SDP strategy
    contributes its highest fitting coverage (or its lowest tried one, marked not fitting).
    ``fsdp``/``ac`` compose the SDP strategies (baselines keep theirs: ``fsdp+ac``...).
    ``estimator``: the fake-mode estimator's worst-rank peak by default; ``log`` gets a line
    before the search and one per estimate (``Estimates``)."""
    if memory_gb <= 0:
        raise ValueError(f"--memory-gb must be > 0, got {memory_gb}")
    budget = int(memory_gb * GB)
    chosen = tuple(dict.fromkeys(strategies or (*BASELINES, *SDP_NAMES)))
    searches: list[tuple[BenchSpec, tuple[int, int, int] | None]] = []
    for strategy in chosen:
        spec = base.replace(strategy=strategy, coverage=1.0)
        searches.append((spec, None) if not spec.is_sdp else
                        (spec.replace(fsdp=fsdp, ac=ac), _k_range(spec)))
    # a binary search over n values of k probes at most n.bit_length() of them
    bounds = [1 if r is None else max(1, (r[2] - r[1] + 1).bit_length()) for _, r in searches]
    estimates = Estimates(estimator or _estimate_peak, log)
    if log is not None:
        log(f"searching {len(chosen)} strategies for {base.recipe} at {base.world} workers: "
            f"at most {sum(bounds)} fake-mode estimates")
    options: list[Option] = []
    for i, (spec, k_range) in enumerate(searches):
        estimates.left = sum(bounds[i:])
        options.append(_option(spec, estimates(spec), budget) if k_range is None else
                       _best_coverage(spec, k_range, budget, estimates))
    return sorted(options, key=lambda o: (not o.fits, -o.spec.coverage, o.comm_ring_bytes,
                                          o.peak_bytes))


def _option(spec: BenchSpec, peak: int, budget: int) -> Option:
    ring = worst_comm(analytic_comm(spec))["comm/ring_bytes_per_step"]
    return Option(spec, peak, ring, peak <= budget)


def _k_range(spec: BenchSpec) -> tuple[int, int, int]:
    """(U, the smallest k, the largest k) of the coverage search: below the smallest some
    unit has no holder, or the spread plan cannot be connected."""
    from subnetdp.plan import min_units_per_worker

    units = _num_units(spec)
    return units, min_units_per_worker(spec.world, units, connected=True), units


def _best_coverage(spec: BenchSpec, k_range: tuple[int, int, int], budget: int,
                   estimator: Estimator) -> Option:
    """Binary search for the largest k (units per worker, k/U coverage) whose peak fits;
    ``estimator`` memoises (``Estimates``), so the answer's k is not estimated twice."""
    units, lo, hi = k_range
    first = lo
    # invariant: every k < lo fits (or is impossible), every k > hi does not

    def peak(k: int) -> int:
        return estimator(spec.replace(coverage=k / units))

    best = 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if peak(mid) <= budget:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    k = best or first
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
