"""The convergence study's curves (matplotlib, Agg): against steps and against training time."""

from __future__ import annotations

from pathlib import Path

from subnetdp.study.convergence import run_curves
from subnetdp.study.plots import STYLE, _pyplot, _smooth
from subnetdp.study.runner import CellResult, cell_dir
from subnetdp.study.suite import TaskSpec


def curves_plot(task: TaskSpec, cells: list[CellResult], runs: Path, nproc: int,
                path: Path) -> None:
    """Two panels: the validation loss (or, without periodic validation, rank 0's smoothed
    training loss) against the step and against seconds of training; FLOP-matched runs
    dashed."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True, squeeze=False)
    window = max(1, task.steps // 20)
    kind = "training loss"
    for r in cells:
        c = run_curves(cell_dir(runs, r.cell, nproc))
        if c["val"]:
            kind, pts = "validation loss", c["val"]
            ys = [p[2] for p in pts]
        else:
            pts = c["train"]
            ys = _smooth([p[2] for p in pts], window)
        if not pts:
            continue
        colour, _ = STYLE.get(r.cell.method, ("grey", "x"))
        style = "--" if r.cell.steps != task.steps else "-"
        label = r.cell.method + (f" ({r.cell.steps} steps)" if style == "--" else "")
        for ax, xs in zip(axes[0], ([p[0] for p in pts], [p[1] for p in pts]), strict=True):
            ax.plot(xs, ys, color=colour, linestyle=style, linewidth=1.3, label=label)
    axes[0][0].set_xlabel("step")
    axes[0][1].set_xlabel("training time (s, rank 0)")
    axes[0][0].set_ylabel(kind if kind == "validation loss" else f"{kind} ({window}-step avg)")
    for ax in axes[0]:
        ax.grid(alpha=0.3)
    axes[0][1].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"{task.name}: {task.recipe}, C = 0.5")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
