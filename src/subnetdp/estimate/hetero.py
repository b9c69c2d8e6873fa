"""Heterogeneous workers: per-rank memory budgets turned into a balanced plan that fits them.

``plan_for_budgets(base, [80, 40, 40, 40])`` gives rank i the capacity c_i (its share of the
units' memory cost, ``subnet.costs`` ``memory``) that a linear model of its peak says fits:
peak(c) ≈ a + b·c, b = the units' memory cost at the spec's batch (cost model), a = the
estimator's peak with every unit held minus b (the shared part, buffers, temporaries). The
balanced scheme builds the plan; the fake-tensor estimator (``estimate.py``) then checks every
rank. A rank over its budget has its overshoot added to its own a (so its capacity falls by
overshoot / b) and the plan is rebuilt, a few rounds at most. When the budgets cannot hold
``min_holders`` copies of every unit, or a rank cannot hold even the shared part plus its
lightest unit, the plan is refused with the smallest budgets in the same ratio that work: the
linear model's factor, raised step by step until the estimator accepts the plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from subnetdp.estimate.communicators import SHARED_CHILD_MB, split_shared
from subnetdp.estimate.memory import MemoryEstimate, estimate_memory
from subnetdp.estimate.spec import BenchSpec, composition_fields, make_bench_plan, meta_model
from subnetdp.models import get_recipe
from subnetdp.plan import Plan
from subnetdp.strategy import STRATEGIES, Composition

GB = 1e9
ROUNDS = 4  # estimator checks; each lowers the capacities of the ranks that did not fit
# Capacities are aimed this far below the budget: the cost model is linear, the estimator
# is not quite (activation peaks depend on which blocks a rank holds).
MARGIN = 0.97
# A refusal names budgets that fit: the model's factor, raised by this step until they do.
SUGGEST_STEP = 1.05
SUGGEST_TRIES = 6


class BudgetError(ValueError):
    """The budgets cannot be met; the message gives the smallest budgets that would work."""


@dataclass(frozen=True)
class BudgetPlan:
    spec: BenchSpec  # balanced, with the per-rank capacities that fit
    budgets: tuple[float, ...]  # bytes per rank
    estimate: MemoryEstimate  # every rank, from the estimator
    rounds: int  # estimator checks it took

    def plan(self) -> Plan:
        """The plan that fits (``spec``'s, the one builder's), as ``plan --out`` saves it."""
        recipe, model = meta_model(self.spec)
        return make_bench_plan(self.spec, model, recipe)


Estimate = Callable[[BenchSpec], MemoryEstimate]


def _unit_memory(spec: BenchSpec) -> tuple[float, float]:
    """(the units' total memory cost, the lightest unit's), cost model at the spec's batch."""
    from subnetdp.subnet.costs import recipe_costs

    costs = recipe_costs(get_recipe(spec.recipe), batch=spec.batch, seq=spec.seq,
                         model_args=dict(spec.model_args))
    w = [row[0] for row in costs.weights("memory")]
    return float(sum(w)), float(min(w))


def budget_spec(recipe: str, strategy: str, *, world: int, batch: int, seq: int,
                comp: Composition, model_args: Mapping[str, Any], seed: int,
                min_holders: int, comm_mem_mb: float) -> BenchSpec:
    """The spec a run's budgets are planned from (``plan_for_budgets``), built here for
    ``train --memory-gb`` and ``plan --memory-gb A,B,...`` alike: every input of the estimate
    is a required argument, so neither command can leave one out. ``strategy``: the SDP
    strategy's name, composed by ``comp`` (the run's, ``composition_fields``). Whether split
    communicators share resources is the environment's, which the workers inherit
    (``estimate.communicators.split_shared``)."""
    return BenchSpec(recipe=recipe, strategy=strategy, world=world, batch=batch, seq=seq,
                     **composition_fields(comp), seed=seed,
                     model_args=tuple(sorted(model_args.items())), min_holders=min_holders,
                     comm_mem_mb=comm_mem_mb, comm_split_shared=split_shared())


class _Short(Exception):
    """The linear model says the budgets cannot work; ``scale``: the factor that would."""

    def __init__(self, why: str, scale: float) -> None:
        super().__init__(why)
        self.why, self.scale = why, scale


def plan_for_budgets(base: BenchSpec, budgets_gb: Sequence[float], *,
                     estimate: Estimate = estimate_memory) -> BudgetPlan:
    """A plan for ``base`` (a block-level SDP spec: recipe, batch, seq, dtype, min_holders)
    in which every rank's estimated peak is within ``budgets_gb[rank]``; ``BudgetError`` if
    the budgets are too small, naming the smallest budgets in the same ratio that the
    estimator accepts (the model's factor, raised in SUGGEST_STEP steps until they fit).
    ``world`` is the number of budgets."""
    if not budgets_gb or min(budgets_gb) <= 0:
        raise BudgetError(f"give one positive budget per worker, got {list(budgets_gb)}")
    if not base.strategy_value.balanceable:
        balanceable = ", ".join(n for n, s in STRATEGIES.items() if s.balanceable)
        raise BudgetError(f"per-rank budgets need block units ({balanceable}), not "
                          f"{base.strategy}: neuron groups are equal per layer")
    spec = base.replace(world=len(budgets_gb), scheme="balanced", balance="memory",
                        coverage=1.0, capacities=None)
    b, lightest = _unit_memory(spec)
    a = estimate(spec).peak_bytes - b  # every rank holds every unit
    try:
        return _fit(spec, [x * GB for x in budgets_gb], a, b, lightest, estimate)
    except _Short as e:
        why, scale = e.why, e.scale
    for _ in range(SUGGEST_TRIES):
        scaled = [float(_gb_up(x * GB * scale)) for x in budgets_gb]
        try:
            _fit(spec, [x * GB for x in scaled], a, b, lightest, estimate)
        except _Short as e:
            scale *= max(SUGGEST_STEP, e.scale)  # e.scale is relative to `scaled`
            continue
        raise BudgetError(
            f"the budgets {','.join(f'{g:g}' for g in budgets_gb)} GB are too small: {why} "
            f"(shared part and buffers about {a / GB:.3g} GB per rank, all units "
            f"{b / GB:.3g} GB); the smallest budgets in the same ratio that fit (estimator, "
            f"within {SUGGEST_STEP - 1:.0%}) are --memory-gb {','.join(f'{x:g}' for x in scaled)}"
            "; or lower --batch-size/--seq-len or --min-holders")
    raise BudgetError(f"the budgets {','.join(f'{g:g}' for g in budgets_gb)} GB are too "
                      f"small: {why}, and {scale:.3g} times them still did not fit")


def _fit(spec: BenchSpec, budgets: list[float], a: float, b: float, lightest: float,
         estimate: Estimate) -> BudgetPlan:
    """Capacities from the model, checked and lowered by the estimator; ``_Short`` if the
    budgets (with the overshoots measured so far) cannot hold the units."""
    extra = [0.0] * len(budgets)  # per rank: what the estimator found beyond the model
    for rounds in range(1, ROUNDS + 1):
        caps = _shortfall(budgets, extra, a, b, lightest, spec.min_holders)
        cand = spec.replace(capacities=tuple(caps))
        est = estimate(cand)
        over = [r.peak_bytes - budgets[r.rank] for r in est.per_rank]
        if max(over) <= 0:
            return BudgetPlan(cand, tuple(budgets), est, rounds)
        extra = [e + max(0.0, o) for e, o in zip(extra, over, strict=True)]
    raise _Short("some ranks still exceeded their budgets after "
                 f"{ROUNDS} estimator checks", SUGGEST_STEP)


def _caps(budgets: Sequence[float], extra: Sequence[float], a: float, b: float,
          scale: float = 1.0) -> list[float]:
    return [min(1.0, (MARGIN * (scale * x - e) - a) / b)
            for x, e in zip(budgets, extra, strict=True)]


def _shortfall(budgets: list[float], extra: list[float], a: float, b: float,
               lightest: float, min_holders: int) -> list[float]:
    """The capacities, or ``_Short`` with the smallest factor on the budgets that gives every
    rank at least its lightest unit and the units ``min_holders`` copies in all."""
    floor = lightest / b

    def enough(c: list[float]) -> bool:
        return min(c) >= floor and sum(c) >= min_holders - 1e-9

    caps = _caps(budgets, extra, a, b)
    if enough(caps):
        return caps
    hi = 2.0
    while not enough(_caps(budgets, extra, a, b, hi)):
        hi *= 2
    lo = 1.0
    for _ in range(40):  # bisection on the scale factor
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if enough(_caps(budgets, extra, a, b, mid)) else (mid, hi)
    why = (f"every unit needs {min_holders} holder(s)" if sum(caps) < min_holders - 1e-9
           else "every rank must hold the shared part and at least one unit")
    raise _Short(why, hi)


def _gb_up(x: float) -> str:
    """Bytes as GB, 3 significant digits rounded *up* (a suggested budget must not shrink)."""
    gb = x / GB
    scale = 10.0 ** (math.floor(math.log10(gb)) - 2)
    return f"{math.ceil(gb / scale - 1e-9) * scale:.3g}"


def format_budget_plan(bp: BudgetPlan) -> str:
    spec = bp.spec
    lines = [f"per-rank budgets: {spec.recipe}, {spec.world} workers, {spec.strategy}, "
             f"micro-batch {spec.batch}" + (f" x {spec.seq} tokens" if get_recipe(
                 spec.recipe).task == "lm" else "") + f", {spec.dtype}, "
             f"{spec.comm_mem_mb:g} MiB per communicator"
             + (f" (holder groups: {min(spec.comm_mem_mb, SHARED_CHILD_MB):g}, split with "
                "shared resources)" if spec.comm_split_shared else "")
             + "; balanced on memory, checked by the "
             f"estimator ({bp.rounds} round(s))",
             f"{'worker':>6} {'budget GB':>10} {'capacity':>9} {'est. peak GB':>13} {'fits':>5}"]
    caps = spec.capacities or ()
    for r in bp.estimate.per_rank:
        lines.append(f"{r.rank:>6} {bp.budgets[r.rank] / GB:>10.4g} {caps[r.rank]:>9.3f} "
                     f"{r.peak_bytes / GB:>13.4g} "
                     f"{'yes' if r.peak_bytes <= bp.budgets[r.rank] else 'no':>5}")
    return "\n".join(lines)
