"""``docs/results/convergence.md`` from the convergence study's cells: tables, plots, findings.

Per regime: the step- and FLOP-matched tables of the quality study (tables.rows_table), DDP's
flattening check, a wall-clock view (quality at DDP's training time, curves against time), the
training-vs-test accuracy of the image regimes and the downstream table of every LLaMA run.
The findings paragraph is generated from the same numbers.
"""

from __future__ import annotations

import bisect
import math
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Any

from subnetdp.metrics.sinks import write_json_atomic
from subnetdp.study.aggregate import Row, all_rows
from subnetdp.study.convergence import (
    DOWNSTREAM_FILE,
    DOWNSTREAM_TASKS,
    FLAT_FRACTION,
    FLAT_TOLERANCE,
    TRAIN_EVAL_FILE,
    read_extra,
    run_curves,
)
from subnetdp.study.convergence_plots import curves_plot
from subnetdp.study.runner import CellResult, cell_dir
from subnetdp.study.suite import Suite, TaskSpec, is_reference
from subnetdp.study.tables import BUDGET_TITLES, MiB, rows_table

STEM = "convergence"


def flattened(values: list[float], *, window: int = 1) -> tuple[bool, float]:
    """(flat, relative change): the change of the (``window``-averaged) curve over its last
    ``FLAT_FRACTION``, relative to its final value; flat when under ``FLAT_TOLERANCE``."""
    if len(values) < 2:
        return False, float("nan")
    avg = [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1):
           i + 1]) for i in range(len(values))]
    start = avg[min(len(avg) - 1, int(len(avg) * (1 - FLAT_FRACTION)))]
    change = abs(start - avg[-1]) / abs(avg[-1]) if avg[-1] else float("inf")
    return change < FLAT_TOLERANCE, change


def value_at_time(curve: list[tuple[float, float, float]], t: float) -> float:
    """The curve's last value recorded by training time ``t`` (NaN before its first)."""
    times = [c[1] for c in curve]
    i = bisect.bisect_right(times, t)
    return curve[i - 1][2] if i else float("nan")


def _fmt(v: float | None, digits: int = 4) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.{digits}f}"


def _cells(results: list[CellResult], task: TaskSpec) -> list[CellResult]:
    return sorted((r for r in results if r.cell.task == task.name and r.summary is not None),
                  key=lambda r: (not is_reference(r.cell.method), r.cell.method, r.cell.steps))


def _label(r: CellResult, task: TaskSpec) -> str:
    flop = " (FLOP-matched)" if r.cell.steps != task.steps else ""
    return f"{r.cell.method}{flop}"


def flat_check(task: TaskSpec, ddp: CellResult | None, curves: dict[str, Any]) -> str:
    if ddp is None:
        return "DDP's run is missing: no flattening check."
    val = [c[2] for c in curves["val"]]
    if len(val) >= 5:
        flat, change = flattened(val)
        what = f"validation loss ({len(val)} evaluations)"
    else:
        train = [c[2] for c in curves["train"]]
        flat, change = flattened(train, window=max(1, task.steps // 20))
        what = (f"training loss, {max(1, task.steps // 20)}-step average (no periodic "
                "validation in these runs)")
    verdict = "flattened" if flat else "NOT flattened: train longer"
    return (f"Convergence criterion: DDP's {what} changed by {_fmt(100 * change, 2)}% over the "
            f"last {FLAT_FRACTION:.0%} of training (criterion < {FLAT_TOLERANCE:.0%}): "
            f"**{verdict}**.")


def wall_table(task: TaskSpec, cells: list[CellResult], runs: Path, nproc: int) -> str:
    """Each run's training time (rank 0's summed step times) against DDP's, and its loss once
    it had trained as long as DDP did: the validation loss where every run has periodic
    validation, else the training loss averaged over the last 5% of the steps by then."""
    curves = {r.cell: run_curves(cell_dir(runs, r.cell, nproc)) for r in cells}
    ddp = next((r for r in cells if is_reference(r.cell.method)), None)
    t_ddp = curves[ddp.cell]["train"][-1][1] if ddp and curves[ddp.cell]["train"] else math.nan
    use_val = bool(cells) and all(curves[r.cell]["val"] for r in cells)
    window = max(1, task.steps // 20)
    head = ["run", "steps", "training time (s)", "time / ddp", "final " + task.metric,
            ("val loss" if use_val else f"train loss ({window}-step avg)") + " at ddp's time"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in cells:
        assert r.summary is not None
        c = curves[r.cell]
        t = c["train"][-1][1] if c["train"] else math.nan
        if use_val:
            at = value_at_time(c["val"], t_ddp)
        else:
            pts = [p[2] for p in c["train"] if p[1] <= t_ddp][-window:]
            at = sum(pts) / len(pts) if pts else math.nan
        lines.append(f"| {_label(r, task)} | {r.cell.steps} | {t:.0f} | "
                     f"{_fmt(t / t_ddp, 2)} | {_fmt(r.summary.get(task.metric))} | {_fmt(at)} |")
    return "\n".join(lines)


def accuracy_table(task: TaskSpec, cells: list[CellResult], runs: Path, nproc: int) -> str:
    head = ["run", "steps", "train accuracy", "test accuracy", "gap", "train loss", "test loss"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in cells:
        assert r.summary is not None
        e = read_extra(cell_dir(runs, r.cell, nproc), TRAIN_EVAL_FILE) or {}
        tr, te = e.get("train_accuracy"), r.summary.get("val_accuracy")
        gap = tr - te if tr is not None and te is not None else None
        lines.append(f"| {_label(r, task)} | {r.cell.steps} | {_fmt(tr)} | {_fmt(te)} | "
                     f"{_fmt(gap)} | {_fmt(e.get('train_loss'))} | "
                     f"{_fmt(r.summary.get('val_loss'))} |")
    return "\n".join(lines)


def downstream_table(task: TaskSpec, cells: list[CellResult], runs: Path, nproc: int
                     ) -> tuple[str, dict[str, Any]]:
    """Accuracy (acc) per task and the macro average, a chance row; and the raw results."""
    head = ["run", *DOWNSTREAM_TASKS, "macro avg"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    raw: dict[str, Any] = {}
    chance: dict[str, Any] | None = None
    for r in cells:
        d = read_extra(cell_dir(runs, r.cell, nproc), DOWNSTREAM_FILE)
        if d is None:
            lines.append(f"| {_label(r, task)} | " + " | ".join("-" * 1 for _ in head[1:]) + " |")
            continue
        raw[_label(r, task)] = d
        chance = chance or d
        accs = [_fmt(d["tasks"][t]["acc"]) if t in d["tasks"] else "-" for t in DOWNSTREAM_TASKS]
        lines.append(f"| {_label(r, task)} | " + " | ".join(accs) +
                     f" | {_fmt(d['macro']['acc'])} |")
    if chance is not None:
        lines.append("| *chance* | " + " | ".join(
            _fmt(chance["tasks"][t]["chance"]) if t in chance["tasks"] else "-"
            for t in DOWNSTREAM_TASKS) + f" | {_fmt(chance['macro']['chance'])} |")
        n = {t: int(v["n"]) for t, v in chance["tasks"].items()}
        lines.append("")
        lines.append("Documents per task: " + ", ".join(f"{t} {k}" for t, k in n.items()) +
                     " (lm-eval zero-shot, `acc`; the JSON also has `acc_norm` and standard "
                     "errors).")
    return "\n".join(lines), raw


def findings(task: TaskSpec, rows: dict[str, list[Row]]) -> list[str]:
    """One sentence per SDP run: its quality against DDP and its memory per worker."""
    out = []
    for budget in ("step", "flop"):
        base = next((r for r in rows[budget] if is_reference(r.method)), None)
        if base is None or not base.quality.n:
            continue
        for r in rows[budget]:
            if is_reference(r.method) or not r.quality.n:
                continue
            if budget == "flop" and r.steps == task.steps:
                continue  # the step-matched run again
            delta = r.quality.mean - base.quality.mean
            better = delta < 0 if task.metric == "val_loss" else delta > 0
            verdict = "same" if abs(delta) < 5e-5 else "better" if better else "worse"
            mem = (f"{r.memory.mean / base.memory.mean:.2f}x DDP's peak memory per worker"
                   if r.memory.n and base.memory.n else "memory not measured")
            out.append(f"{r.label} ({budget}-matched, {r.steps} steps): {task.metric} "
                       f"{r.quality.mean:.4f} vs DDP {base.quality.mean:.4f} "
                       f"({delta:+.4f}, {verdict}), {mem}.")
    return out


def write_convergence(suite: Suite, results: list[CellResult], runs: Path, out: Path, *,
                      command: str, plots: bool = True) -> list[Path]:
    """``convergence.md``, ``convergence.json`` and the plots under ``out``."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    rows = all_rows(suite, results)
    wall = sum(r.wall_s for r in results if math.isfinite(r.wall_s))
    md = [
        "# Convergence study",
        "",
        f"`{command}`: {suite.nproc} CPU workers (gloo), C = "
        f"{', '.join(f'{c:g}' for c in suite.coverages)}, {suite.seeds} seed(s); torch "
        f"{torch.__version__}, Python {platform.python_version()}. {len(results)} runs, "
        f"{wall / 3600:.2f} h of wall time in all (start-up, evaluation and downstream "
        "evaluation included). Quality: the full model (SDP: assembled from the owners) on "
        "held-out data after training. FLOP-matched: b-sdp and n-sdp train round(S / C) "
        "steps (see suite.py). Times are from a shared machine: indicative only.",
        "",
    ]
    payload: dict[str, Any] = {"suite": suite.name, "command": command, "wall_s": wall,
                               "tasks": {}}
    written = []
    for task in suite.tasks:
        cells = _cells(results, task)
        ddp = next((r for r in cells if is_reference(r.cell.method)), None)
        ddp_curves = run_curves(cell_dir(runs, ddp.cell, suite.nproc)) if ddp else {
            "train": [], "val": []}
        train = ", ".join(f"{k} {v}" for k, v in task.train.items())
        md += [f"## {task.name}: {task.recipe}, S = {task.steps} steps"
               + (f", {task.train_images} training images" if task.train_images else ""), "",
               f"Settings: {train}.", "", flat_check(task, ddp, ddp_curves), ""]
        for budget, title in BUDGET_TITLES.items():
            md += [f"### {title}", "", rows_table(task, rows[task.name][budget]), ""]
        md += ["### Wall-clock view", "", wall_table(task, cells, runs, suite.nproc), ""]
        entry: dict[str, Any] = {"task": asdict(task),
                                 "rows": {b: [r.to_dict() for r in rs]
                                          for b, rs in rows[task.name].items()}}
        if task.metric == "val_accuracy":
            md += ["### Training vs test accuracy", "",
                   accuracy_table(task, cells, runs, suite.nproc), ""]
        else:
            table, raw = downstream_table(task, cells, runs, suite.nproc)
            md += ["### Downstream (zero-shot, lm-eval)", "", table, ""]
            entry["downstream"] = raw
        facts = findings(task, rows[task.name])
        if facts:
            md += ["### Findings (generated from the tables)", "", *(f"- {f}" for f in facts),
                   ""]
        if plots:
            png = out / f"{STEM}_{task.name}.png"
            curves_plot(task, cells, runs, suite.nproc, png)
            md += [f"![{task.name} curves]({png.name})", ""]
            written.append(png)
        payload["tasks"][task.name] = entry
    (out / f"{STEM}.md").write_text("\n".join(md))
    write_json_atomic(out / f"{STEM}.json", payload)
    return [out / f"{STEM}.md", out / f"{STEM}.json", *written]


__all__ = ["MiB", "flattened", "run_curves", "value_at_time", "write_convergence"]
