"""Loss and memory curves of finished runs (``subnetdp plot``), from their metrics files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from subnetdp.metrics.sinks import rank_jsonl_path, read_jsonl, val_jsonl_path
from subnetdp.metrics.tracking import GLOBAL_AVG_LOSS, MAX_ACTIVE, VAL_LOSS


def run_curves(run: Path) -> dict[str, list[tuple[int, float]]]:
    """``(steps done, value)`` series of a run: the all-rank training loss, the validation
    loss and rank 0's ``memory/max_active(GiB)``."""
    path = rank_jsonl_path(run, 0)
    if not path.exists():
        raise ValueError(f"{run} has no {path.relative_to(run)}; pass a folder `subnetdp train "
                         f"--out` wrote")
    rows = read_jsonl(path)
    val = read_jsonl(val_jsonl_path(run)) if val_jsonl_path(run).exists() else []

    for name, records in ((path, rows), (val_jsonl_path(run), val)):
        bad = next((r for r in records if type(r.get("step")) is not int), None)
        if bad is not None:
            raise ValueError(f"{name}: a record without a whole step number ({bad}); fix or "
                             "delete that line")

    def series(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
        try:
            return [(r["step"], float(r[key])) for r in records if r.get(key) is not None]
        except (TypeError, ValueError) as e:
            raise ValueError(f"{run}: a metrics record's {key} is not a number ({e}); fix or "
                             "delete that line") from None

    # runs from before the all-rank loss existed: rank 0's own
    train_key = GLOBAL_AVG_LOSS if any(GLOBAL_AVG_LOSS in r for r in rows) else "loss"
    return {"train": series(rows, train_key), "val": series(val, VAL_LOSS),
            "memory": series(rows, MAX_ACTIVE)}


def plot_runs(runs: list[Path], out: Path) -> Path:
    """One PNG: training (solid) and validation (dots) loss, and memory, of every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        curves = run_curves(run)
        if not curves["train"]:
            raise ValueError(f"{rank_jsonl_path(run, 0)} holds no training loss; pass a run "
                             "that trained at least --log-every steps")
        line, = ax_loss.plot(*zip(*curves["train"], strict=True), label=f"{run.name} train")
        if curves["val"]:
            ax_loss.plot(*zip(*curves["val"], strict=True), "o--", color=line.get_color(),
                         label=f"{run.name} val")
        if curves["memory"]:
            ax_mem.plot(*zip(*curves["memory"], strict=True), color=line.get_color(),
                        label=run.name)
    ax_loss.set(xlabel="step", ylabel="loss (all-rank mean)", title="loss")
    ax_mem.set(xlabel="step", ylabel=MAX_ACTIVE, title="memory, rank 0")
    for ax in (ax_loss, ax_mem):
        if ax.lines:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
