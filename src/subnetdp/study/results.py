"""Write a suite's results: per task a markdown table, a JSON file and two PNG plots."""

from __future__ import annotations

import math
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from subnetdp.metrics.sinks import write_json_atomic
from subnetdp.study.aggregate import all_rows
from subnetdp.study.plots import loss_curves, quality_vs_memory
from subnetdp.study.runner import CellResult
from subnetdp.study.suite import Suite
from subnetdp.study.tables import task_markdown


def write_results(suite: Suite, results: list[CellResult], out: Path, *, command: str,
                  plots: bool = True) -> list[Path]:
    """``quality_<task>.md``, ``.json``, ``_curves.png`` and ``_memory.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    rows = all_rows(suite, results)
    versions = f"torch {torch.__version__}, Python {platform.python_version()}"
    written = []
    for task in suite.tasks:
        mine = [r for r in results if r.cell.task == task.name]
        wall = sum(r.wall_s for r in mine if math.isfinite(r.wall_s))
        stem = out / f"quality_{task.name}"
        md = task_markdown(suite, task, rows[task.name], command=command, wall_s=wall,
                           versions=versions)
        stem.with_suffix(".md").write_text(md)
        payload: dict[str, Any] = {
            "suite": suite.name, "task": asdict(task), "seeds": suite.seeds,
            "nproc": suite.nproc, "coverages": list(suite.coverages), "command": command,
            "versions": versions, "wall_s": wall,
            "rows": {b: [r.to_dict() for r in rs] for b, rs in rows[task.name].items()},
            "cells": [{**asdict(r.cell), "wall_s": r.wall_s, "error": r.error,
                       task.metric: (r.summary or {}).get(task.metric),
                       "val_loss": (r.summary or {}).get("val_loss")} for r in mine],
        }
        write_json_atomic(stem.with_suffix(".json"), payload)
        written += [stem.with_suffix(".md"), stem.with_suffix(".json")]
        if plots:
            curves = out / f"quality_{task.name}_curves.png"
            scatter = out / f"quality_{task.name}_memory.png"
            loss_curves(task, rows[task.name], curves)
            quality_vs_memory(task, rows[task.name], scatter)
            written += [curves, scatter]
    return written
