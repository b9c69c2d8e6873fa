"""PNG plots of the quality study (matplotlib, Agg): loss curves and quality vs memory."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from subnetdp.study.aggregate import Row
from subnetdp.study.suite import METHODS, TaskSpec, is_reference

# (colour, marker) per method, in the study's method order (every strategy of the table, then
# the regularised baselines); a method past the palette is drawn grey
_PALETTE = (("black", "*"), ("tab:blue", "o"), ("tab:orange", "s"), ("tab:cyan", "^"),
            ("tab:red", "v"), ("tab:green", "D"), ("tab:purple", "P"), ("tab:brown", "X"),
            ("tab:pink", "<"), ("tab:olive", ">"))
STYLE = dict(zip(METHODS, _PALETTE, strict=False))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what exists so far)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def loss_curves(task: TaskSpec, rows: dict[str, list[Row]], path: Path) -> None:
    """One panel per coverage: training loss (mean over ranks and seeds, smoothed) against the
    step; step-matched runs solid, FLOP-matched longer runs dashed, DDP in every panel."""
    plt = _pyplot()
    coverages = sorted({r.coverage for r in rows["step"] if not is_reference(r.method)},
                       reverse=True)
    fig, axes = plt.subplots(1, max(1, len(coverages)), figsize=(5 * max(1, len(coverages)), 4),
                             sharey=True, squeeze=False)
    ddp = next((r for r in rows["step"] if is_reference(r.method)), None)
    window = max(1, task.steps // 10)
    for ax, c in zip(axes[0], coverages, strict=False):
        drawn = [ddp] if ddp is not None else []
        drawn += [r for r in rows["step"] if r.coverage == c and not is_reference(r.method)]
        drawn += [r for r in rows["flop"] if r.coverage == c and r.steps != task.steps]
        for r in drawn:
            if not r.curve:
                continue
            colour, _ = STYLE.get(r.method, ("grey", "x"))
            dashed = r.steps != task.steps
            ax.plot(range(len(r.curve)), _smooth(r.curve, window), color=colour,
                    linestyle="--" if dashed else "-", linewidth=1.3,
                    label=f"{r.label}" + (f" ({r.steps} steps)" if dashed else ""))
        ax.set_title(f"C = {c:g} (drop rate {1 - c:g})")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"training loss (mean of ranks, {window}-step avg)")
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"{task.recipe}: training loss (SDP: each worker's own subnetwork)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def quality_vs_memory(task: TaskSpec, rows: dict[str, list[Row]], path: Path) -> None:
    """Per budget: quality (mean ± std over seeds) against peak memory per worker relative to
    DDP; marker = method, label = coverage."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True, squeeze=False)
    for ax, (budget, title) in zip(axes[0], (("step", "step-matched"), ("flop", "FLOP-matched")),
                                   strict=True):
        base = next((r for r in rows[budget] if is_reference(r.method)), None)
        if base is None or not base.memory.n:
            continue
        seen: set[str] = set()
        for r in rows[budget]:
            if not (r.quality.n and r.memory.n) or not math.isfinite(r.quality.mean):
                continue
            colour, marker = STYLE.get(r.method, ("grey", "x"))
            x = r.memory.mean / base.memory.mean
            ax.errorbar(x, r.quality.mean, yerr=r.quality.std, fmt=marker, color=colour,
                        markersize=7, capsize=3,
                        label=r.label if r.method not in seen else None)
            seen.add(r.method)
            if not is_reference(r.method):
                ax.annotate(f"{r.coverage:g}", (x, r.quality.mean), fontsize=6,
                            xytext=(4, 3), textcoords="offset points")
        ax.axhline(base.quality.mean, color="black", linewidth=0.6, linestyle=":")
        ax.set_title(title)
        ax.set_xlabel("peak memory per worker / DDP's")
        ax.grid(alpha=0.3)
    metric = "validation loss (lower is better)" if task.metric == "val_loss" else \
        "validation accuracy (higher is better)"
    axes[0][0].set_ylabel(metric)
    axes[0][1].legend(fontsize=7, loc="best")
    fig.suptitle(f"{task.recipe}: quality vs memory (labels: coverage C)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
