"""Markdown tables of the quality study: one per task, a section per budget."""

from __future__ import annotations

import math
from collections.abc import Sequence

from subnetdp.study.aggregate import Row, Stat
from subnetdp.study.suite import Suite, TaskSpec, is_reference

MiB = 2**20

BUDGET_TITLES = {
    "step": "Step-matched (every method S steps)",
    "flop": "FLOP-matched (b-sdp, n-sdp and stochastic depth: round(S / C) steps)",
}


def pm(s: Stat, digits: int = 3, scale: float = 1.0) -> str:
    """``mean ± std`` (or ``-``); diverged seeds are flagged."""
    if s.n == 0:
        return "diverged" if s.failed else "-"
    text = f"{s.mean / scale:.{digits}f}"
    if s.n > 1:  # one seed has no spread to show
        text += f" ± {s.std / scale:.{digits}f}"
    return text + (f" ({s.failed} diverged)" if s.failed else "")


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b and math.isfinite(a) and math.isfinite(b) else "-"


def quality_name(task: TaskSpec) -> str:
    return "val loss ↓" if task.metric == "val_loss" else "val accuracy ↑"


def rows_table(task: TaskSpec, rows: list[Row]) -> str:
    """A markdown table: method, C, steps, quality (mean ± std), Δ vs DDP, memory, bytes, time."""
    base = next((r for r in rows if is_reference(r.method)), None)
    lm = task.metric == "val_loss"
    head = ["method", "C", "steps", quality_name(task), "Δ vs ddp"]
    if not lm:
        head.append("val loss")
    head += ["params held", "peak mem / worker (MiB)", "mem / ddp", "bytes / step (MiB)",
             "bytes / ddp", "step (s)", "wall (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        delta = "-"
        if base is not None and r is not base and r.quality.n and base.quality.n:
            delta = f"{r.quality.mean - base.quality.mean:+.3f}"
        traffic = r.bytes_per_step.mean + (r.refresh_per_step.mean
                                           if math.isfinite(r.refresh_per_step.mean) else 0.0)
        cells = [r.label, "1" if is_reference(r.method) else f"{r.coverage:g}", str(r.steps),
                 pm(r.quality, 3 if lm else 4), delta]
        if not lm:
            cells.append(pm(r.val_loss, 3))
        cells += [
            f"{r.param_coverage:.2f}" if math.isfinite(r.param_coverage) else "-",
            f"{r.memory.mean / MiB:.1f}" if r.memory.n else "-",
            _ratio(r.memory.mean, base.memory.mean) if base else "-",
            f"{traffic / MiB:.2f}" if r.bytes_per_step.n else "-",
            _ratio(traffic, base.bytes_per_step.mean) if base else "-",
            f"{r.step_time.mean:.3f}" if r.step_time.n else "-",
            f"{r.wall.mean:.0f}" if r.wall.n else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def matrix_table(task: TaskSpec, rows: dict[str, list[Row]]) -> str:
    """Quality only, at a glance: a row per method and budget, a column per coverage."""
    coverages = sorted({r.coverage for b in rows.values() for r in b
                        if not is_reference(r.method)}, reverse=True)
    digits = 3 if task.metric == "val_loss" else 4
    head = ["method", "budget", *(f"C = {c:g}" for c in coverages)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ddp = next((r for r in rows.get("step", []) if is_reference(r.method)), None)
    if ddp is not None:
        lines.append(f"| {ddp.label} (C = 1) | both | " + " | ".join([pm(ddp.quality, digits)]
                                                           * len(coverages)) + " |")
    for budget in ("step", "flop"):
        methods = dict.fromkeys(r.method for r in rows.get(budget, [])
                                if not is_reference(r.method))
        for m in methods:
            by_c = {r.coverage: r for r in rows[budget] if r.method == m}
            if budget == "flop" and all(r.steps == task.steps for r in by_c.values()):
                continue  # same runs as step-matched
            cells = [pm(by_c[c].quality, digits) if c in by_c else "-" for c in coverages]
            label = next(iter(by_c.values())).label
            lines.append(f"| {label} | {budget} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def task_markdown(suite: Suite, task: TaskSpec, rows: dict[str, list[Row]],
                  *, command: str, wall_s: float, versions: str,
                  notes: Sequence[str] = ()) -> str:
    """The whole results page of one task; ``notes``: paragraphs after the introduction."""
    train = ", ".join(f"{k} {v}" for k, v in task.train.items())
    out = [
        f"# Quality study: {task.recipe}",
        "",
        f"`{command}` — {suite.nproc} CPU workers (gloo), S = {task.steps} steps, "
        f"{suite.seeds} seed(s) per cell (mean ± sample std), coverages "
        f"{', '.join(f'{c:g}' for c in suite.coverages)}; {train}. {versions}. "
        f"Cells of this task: {wall_s / 60:.1f} min of wall time in all.",
        "",
        "Quality is the *full* model's (SDP: assembled from the owners) on held-out data after "
        "training. Params held: the fraction of all parameters the worst rank holds (b-sdp's "
        "ResNet blocks differ a lot in size). Baselines run torch DDP with stochastic depth "
        "(blocks skipped, not rescaled) or neuron dropout (whole hidden units / heads / "
        "channels, inverted scaling) at rate 1 − C, masks drawn independently per rank and "
        "step. Memory: measured peak of one step (seed 0: it does not depend on the seed), "
        "worst rank; bytes: gradient traffic sent per step by the worst rank (bb-sdp / "
        "nb-sdp: plus the owners' refresh traffic); step: median step time of the slowest rank; "
        "wall: the whole cell, start-up and evaluation included. Machine shared with other "
        "work: times are indicative only.",
        "",
    ]
    for note in notes:
        out += [note, ""]
    out += [f"## {quality_name(task)} at a glance (mean ± std over seeds)", "",
            matrix_table(task, rows), ""]
    for budget, title in BUDGET_TITLES.items():
        out += [f"## {title}", "", rows_table(task, rows[budget]), ""]
    return "\n".join(out)
