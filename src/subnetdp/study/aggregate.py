"""From cell results to table rows: mean ± sample std over seeds, per task, budget and method."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from subnetdp.metrics.report import row_values
from subnetdp.study.runner import CellResult
from subnetdp.study.suite import BUDGETS, Suite, TaskSpec, budget_cells

# a strategy's label is its name
METHOD_LABELS = {"ddp+sd": "ddp + stochastic depth", "ddp+dropout": "ddp + neuron dropout"}


@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation (0 for one value) of the finite values; ``n`` counts
    them, ``failed`` the seeds that diverged."""

    mean: float
    std: float
    n: int
    failed: int = 0

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Stat:
        finite = [v for v in values if v is not None and math.isfinite(v)]
        failed = len(values) - len(finite)
        if not finite:
            return cls(float("nan"), float("nan"), 0, failed)
        std = statistics.stdev(finite) if len(finite) > 1 else 0.0
        return cls(statistics.fmean(finite), std, len(finite), failed)


@dataclass
class Row:
    task: str
    budget: str
    method: str
    coverage: float
    steps: int
    quality: Stat  # val loss (lm) or val accuracy (image)
    val_loss: Stat
    memory: Stat  # peak bytes per worker (worst rank)
    bytes_per_step: Stat  # gradient bytes sent per step (worst rank)
    refresh_per_step: Stat  # backward masking: owners -> non-holders
    step_time: Stat  # median step time (slowest rank)
    wall: Stat  # the cell's wall time, start-up and evaluation included
    param_coverage: float  # fraction of all parameters the worst rank holds
    curve: list[float] = field(default_factory=list)  # mean over seeds, per step
    curve_std: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        return METHOD_LABELS.get(self.method, self.method)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["label"] = self.label
        return d


def _mean_curve(curves: list[list[float]]) -> tuple[list[float], list[float]]:
    curves = [c for c in curves if c]
    if not curves:
        return [], []
    n = min(len(c) for c in curves)
    cols = [[c[i] for c in curves] for i in range(n)]
    return ([statistics.fmean(col) for col in cols],
            [statistics.stdev(col) if len(col) > 1 else 0.0 for col in cols])


def task_rows(suite: Suite, task: TaskSpec, results: list[CellResult], budget: str) -> list[Row]:
    """One row per (method, coverage) of ``task`` under ``budget``, in table order."""
    by_cell = {r.cell: r for r in results}
    groups: dict[tuple[str, float, int], list[CellResult]] = {}
    for cell in budget_cells(suite, task, budget):
        if cell in by_cell:
            groups.setdefault((cell.method, cell.coverage, cell.steps), []).append(by_cell[cell])
    rows = []
    for (method, coverage, steps), rs in groups.items():
        ok = [r.summary for r in rs if r.summary is not None]
        vals = [row_values(s) for s in ok]
        failed = len(rs) - len(ok)
        pad: list[float | None] = [None] * failed

        def stat(key: str, vals: list[dict[str, float]] = vals, pad: list[float | None] = pad
                 ) -> Stat:
            return Stat.of([*(v[key] for v in vals), *pad])

        curve, curve_std = _mean_curve([r.curve for r in rs if r.summary is not None])
        rows.append(Row(
            task=task.name, budget=budget, method=method, coverage=coverage, steps=steps,
            quality=Stat.of([s.get(task.metric) for s in ok] + pad),
            val_loss=Stat.of([s.get("val_loss") for s in ok] + pad),
            # measured on seed 0 only (see suite.cell_config): the seeds that have it
            memory=Stat.of([v["memory"] for v in vals if math.isfinite(v["memory"])]),
            bytes_per_step=stat("bytes"), refresh_per_step=stat("refresh"),
            step_time=stat("step_time"), wall=Stat.of([r.wall_s for r in rs]),  # all seeds
            # the plan is the same for every seed; the worst rank, like memory and bytes
            param_coverage=max(ok[0]["plan"]["param_coverage"]) if ok else float("nan"),
            curve=curve, curve_std=curve_std,
        ))
    return rows


def all_rows(suite: Suite, results: list[CellResult]) -> dict[str, dict[str, list[Row]]]:
    """``{task: {budget: rows}}``."""
    return {t.name: {b: task_rows(suite, t, results, b) for b in BUDGETS} for t in suite.tasks}
