"""Write a suite's results: per task a markdown table, a JSON file and two PNG plots."""

from __future__ import annotations

import math
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from subnetdp.metrics.sinks import write_json_atomic
from subnetdp.study.aggregate import Row, all_rows
from subnetdp.study.plots import loss_curves, quality_vs_memory
from subnetdp.study.runner import CellResult
from subnetdp.study.suite import Suite, TaskSpec
from subnetdp.study.tables import task_markdown


def write_results(suite: Suite, results: list[CellResult], out: Path, *, command: str,
                  plots: bool = True) -> list[Path]:
    """``quality_<task>.md``, ``.json``, ``_curves.png`` and ``_memory.png`` under ``out``."""
    rows = all_rows(suite, results)
    versions = f"torch {torch.__version__}, Python {platform.python_version()}"
    written = []
    for task in suite.tasks:
        mine = [r for r in results if r.cell.task == task.name]
        payload: dict[str, Any] = {
            "suite": suite.name, "task": asdict(task), "seeds": suite.seeds,
            "nproc": suite.nproc, "coverages": list(suite.coverages), "command": command,
            "versions": versions,
            "wall_s": sum(r.wall_s for r in mine if math.isfinite(r.wall_s)),
            "cells": [{**asdict(r.cell), "wall_s": r.wall_s, "error": r.error,
                       task.metric: (r.summary or {}).get(task.metric),
                       "val_loss": (r.summary or {}).get("val_loss")} for r in mine],
        }
        written += write_task_results(suite, task, rows[task.name], payload, out, plots=plots)
    return written


def write_task_results(suite: Suite, task: TaskSpec, rows: dict[str, list[Row]],
                       payload: dict[str, Any], out: Path, *, plots: bool = True) -> list[Path]:
    """One task's files from its rows and the rest of its JSON ``payload`` (command, versions,
    wall time, cells, optional ``notes`` shown under the introduction)."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"quality_{task.name}"
    md = task_markdown(suite, task, rows, command=payload["command"], wall_s=payload["wall_s"],
                       versions=payload["versions"], notes=payload.get("notes", ()))
    stem.with_suffix(".md").write_text(md)
    payload = payload | {"rows": {b: [r.to_dict() for r in rs] for b, rs in rows.items()}}
    write_json_atomic(stem.with_suffix(".json"), payload)
    written = [stem.with_suffix(".md"), stem.with_suffix(".json")]
    if plots:
        curves = out / f"quality_{task.name}_curves.png"
        scatter = out / f"quality_{task.name}_memory.png"
        loss_curves(task, rows, curves)
        quality_vs_memory(task, rows, scatter)
        written += [curves, scatter]
    return written
