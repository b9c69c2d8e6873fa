"""Run the cells of a suite that have no result yet, one after the other.

Resumable: a cell whose ``summary.json`` exists is read back, not rerun, so a suite
interrupted after hours loses at most the cell in flight (its half-written folder is cleared
and the cell starts again). A cell that stops on a NaN/inf loss is recorded as diverged
(``failed.json``) and counted as done: a rerun would diverge the same way.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from subnetdp.metrics.sinks import rank_jsonl_path, write_json_atomic
from subnetdp.study.subset import fmnist_subset
from subnetdp.study.suite import Cell, Suite, cell_config, enumerate_cells

WALL_FILE = "study_wall.json"  # the cell's wall time, beside summary.json
FAILED_FILE = "failed.json"


@dataclass
class CellResult:
    cell: Cell
    summary: dict[str, Any] | None  # None: diverged (see error)
    wall_s: float
    curve: list[float] = field(default_factory=list)  # training loss per step, mean over ranks
    error: str | None = None


def cell_dir(runs: Path, cell: Cell, world: int) -> Path:
    return runs / cell.run_name_in(world)


def read_curve(run_dir: Path, world: int) -> list[float]:
    """Training loss per step, averaged over the ranks that logged it (each rank's own
    subnetwork loss under forward masking)."""
    per_step: dict[int, list[float]] = {}
    for rank in range(world):
        path = rank_jsonl_path(run_dir, rank)
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if "loss" in rec and "step" in rec:
                    per_step.setdefault(int(rec["step"]), []).append(float(rec["loss"]))
    return [sum(v) / len(v) for _, v in sorted(per_step.items())]


def load_result(runs: Path, cell: Cell, world: int) -> CellResult | None:
    """The cell's stored result, or None when it has not finished."""
    d = cell_dir(runs, cell, world)
    wall = json.loads((d / WALL_FILE).read_text())["wall_s"] if (d / WALL_FILE).exists() \
        else float("nan")
    if (d / "summary.json").exists():
        summary = json.loads((d / "summary.json").read_text())
        return CellResult(cell, summary, wall, read_curve(d, world))
    if (d / FAILED_FILE).exists():
        err = json.loads((d / FAILED_FILE).read_text())["error"]
        return CellResult(cell, None, wall, read_curve(d, world), error=err)
    return None


def run_cell(suite: Suite, cell: Cell, runs: Path) -> CellResult:
    """Train one cell from scratch (clearing a half-written folder first)."""
    from subnetdp.train.resume import NonFiniteLossError
    from subnetdp.train.run import run_training

    task = next(t for t in suite.tasks if t.name == cell.task)
    d = cell_dir(runs, cell, suite.nproc)
    if d.exists():
        shutil.rmtree(d)  # an interrupted run: its folder is not fresh, start it again
    data_dir = None if task.train_images is None else str(fmnist_subset(runs, task.train_images))
    cfg = cell_config(suite, task, cell, str(d), data_dir=data_dir)
    t0 = time.perf_counter()
    error = None
    try:
        run_training(cfg)
    except NonFiniteLossError as e:
        error = str(e)
    wall = time.perf_counter() - t0
    write_json_atomic(d / WALL_FILE, {"wall_s": wall})
    if error is not None:
        write_json_atomic(d / FAILED_FILE, {"error": error, "cell": asdict(cell)})
    result = load_result(runs, cell, suite.nproc)
    if result is None:
        raise RuntimeError(f"cell {d.name} finished without a summary.json in {d}")
    return result


def run_suite(
    suite: Suite, runs: Path, *, log: Callable[[str], None] = print,
    after: Callable[[CellResult, Path], None] | None = None,
) -> list[CellResult]:
    """Every cell of ``suite``: stored results are reused, missing ones are trained.
    ``after(result, run_dir)`` runs on every finished cell, stored or new (its own work, e.g.
    the downstream evaluation, must skip what it stored before)."""
    cells = enumerate_cells(suite)
    results = []
    t_start = time.perf_counter()
    for i, cell in enumerate(cells, 1):
        name = cell.run_name_in(suite.nproc)
        stored = load_result(runs, cell, suite.nproc)
        if stored is not None:
            results.append(stored)
            log(f"[{i}/{len(cells)}] {name}: done before")
        else:
            result = run_cell(suite, cell, runs)
            results.append(result)
            outcome = "diverged" if result.summary is None else _headline(result.summary)
            log(f"[{i}/{len(cells)}] {name}: {outcome}, {result.wall_s:.1f} s "
                f"(suite {time.perf_counter() - t_start:.0f} s)")
        if after is not None and results[-1].summary is not None:
            after(results[-1], cell_dir(runs, cell, suite.nproc))
    return results


def _headline(summary: dict[str, Any]) -> str:
    if "val_accuracy" in summary:
        return f"val acc {summary['val_accuracy']:.4f}"
    return f"val loss {summary.get('val_loss', float('nan')):.4f}"
