"""Re-measure the peak memory of the torch-DDP methods in stored quality-study results.

The stored results measured torch DDP with its default ``gradient_as_bucket_view=False`` (a
second gradient copy in its flat buckets) and without tracking those buckets: allocated in C++
before the step, ``MemTracker`` saw them only once backward touched them, mostly after the
peak, while SDP's flat gradient buffers were counted for the whole step. The fair baseline
(bucket views: one copy) with its buckets tracked like SDP's buffers
(``TorchDDPRank.grad_buffers``) changes no value, so of the stored figures only the peak
memory of the methods trained under torch DDP (ddp, ddp + stochastic depth, ddp + neuron
dropout) changes, and with it every ratio to DDP's.

``remeasure_ddp_memory`` re-runs only those methods' seed-0 cells (memory is measured on seed 0
only, ``suite.cell_config``) at their full length, checks that each lands within its row's
seed-to-seed spread of its stored quality (if not, more changed than memory: rerun the whole
study), and rewrites the task's table, JSON and plots with the new memory. Those rows keep
their stored quality, step and wall times (all seeds; times are indicative only).

    OMP_NUM_THREADS=1 .venv/bin/python -m subnetdp.study.remeasure [--tasks llama,resnet]
        [--results docs/results] [--runs runs/study-ddp-memory]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from subnetdp.metrics.report import row_values
from subnetdp.strategy import SDP_NAMES, STRATEGIES
from subnetdp.study.aggregate import Row, Stat
from subnetdp.study.runner import load_result, run_cell
from subnetdp.study.suite import (
    BUDGETS,
    REGULARISED,
    SUITES,
    Cell,
    Suite,
    TaskSpec,
    budget_cells,
    is_reference,
    method_strategy,
    select,
)

MiB = 2**20
COMMAND = "python -m subnetdp.study.remeasure"
# The code that re-runs a cell is not bit for bit the one that stored it (measured: 1e-7 in
# llama's val loss, SDP cells too); ResNet's SGD at lr 0.1 grows that to a few test images.
# A re-run must land within its row's seed-to-seed std (at least this: one seed has none).
ROUNDING = 1e-6
_STAT_FIELDS = {f.name for f in dataclasses.fields(Row) if f.type == "Stat"}


def rows_from_payload(payload: dict[str, Any]) -> dict[str, list[Row]]:
    """The rows of a stored ``quality_<task>.json``, per budget."""
    def row(d: dict[str, Any]) -> Row:
        fields: dict[str, Any] = {k: Stat(**v) if k in _STAT_FIELDS else v
                                  for k, v in d.items() if k != "label"}
        return Row(**fields)

    return {b: [row(d) for d in rows] for b, rows in payload["rows"].items()}


def ddp_memory_cells(suite: Suite, task: TaskSpec) -> list[Cell]:
    """The cells whose measured memory comes from torch DDP: seed 0 of every method that is
    not SDP, in both budgets."""
    cells = {c: None for b in BUDGETS for c in budget_cells(suite, task, b)
             if c.seed == 0 and not method_strategy(c.method).is_sdp}
    return list(cells)


def remeasure_ddp_memory(suite: Suite, task: TaskSpec, results: Path, runs: Path, *,
                         log: Callable[[str], None] = print, plots: bool = True) -> list[Path]:
    """Re-run ``task``'s torch-DDP memory cells into ``runs`` (finished ones are reused) and
    rewrite ``results/quality_<task>.*``; nothing is written unless every re-run reproduces
    its stored quality within the seeds' spread."""
    from subnetdp.study.results import write_task_results

    path = results / f"quality_{task.name}.json"
    payload = json.loads(path.read_text())
    if payload.get("remeasured"):
        log(f"{path}: re-measured before; nothing to do")
        return []
    if payload["suite"] != suite.name or payload["task"] != json.loads(
            json.dumps(dataclasses.asdict(task))):
        raise ValueError(f"{path} was written by another suite or task than {suite.name}'s "
                         f"{task.name}")
    stored = {Cell(c["task"], c["method"], c["coverage"], c["steps"], c["seed"]): c
              for c in payload["cells"]}
    rows = rows_from_payload(payload)
    by_point = {(r.method, r.coverage, r.steps): r for b in rows.values() for r in b}
    old = {point: r.memory.mean for point, r in by_point.items()}
    new: dict[tuple[str, float, int], float] = {}
    spread = 0.0  # the largest |re-run - stored| / seed std
    for cell in ddp_memory_cells(suite, task):
        point = (cell.method, cell.coverage, cell.steps)
        result = load_result(runs, cell, suite.nproc) or run_cell(suite, cell, runs)
        for key, stat in ((task.metric, by_point[point].quality),
                          ("val_loss", by_point[point].val_loss)):
            was, now = stored[cell][key], (result.summary or {}).get(key)
            tol = max(stat.std, ROUNDING)
            if now is None or was is None or abs(now - was) > tol:
                raise RuntimeError(
                    f"{cell.run_name_in(suite.nproc)}: {key} {now} differs from the stored "
                    f"{was} by more than the seeds' std {tol:.2g}, so more than memory "
                    "changed: rerun the whole study (make study) instead; nothing was written")
            spread = max(spread, abs(now - was) / tol)
        assert result.summary is not None
        new[point] = row_values(result.summary)["memory"]
        log(f"{cell.run_name_in(suite.nproc)}: peak {old[point] / MiB:.2f} -> "
            f"{new[point] / MiB:.2f} MiB, quality as stored (within {spread:.2f} std)")
    ddp = next(p for p in new if is_reference(p[0]))
    for budget_rows in rows.values():
        for r in budget_rows:
            if (r.method, r.coverage, r.steps) in new:
                r.memory = Stat.of([new[(r.method, r.coverage, r.steps)]])
    labels = ", ".join(dict.fromkeys(r.label for b in rows.values() for r in b
                                     if (r.method, r.coverage, r.steps) in new))
    note = (f"Peak memory of {labels} (the methods trained under torch DDP) re-measured by "
            f"`{COMMAND}` with `gradient_as_bucket_view=True` (one gradient copy, the fair "
            "baseline) and DDP's buckets counted for the whole step like SDP's gradient "
            "buffers (first measured with torch's default buckets, seen only once backward "
            f"touched them: ddp {old[ddp] / MiB:.1f} -> {new[ddp] / MiB:.1f} MiB); every "
            f"re-run landed within {spread:.2f} seed std of its stored quality, and quality, "
            "step and wall times shown are the first runs'.")
    payload["notes"] = [*payload.get("notes", []), note]
    payload["remeasured"] = {"command": COMMAND, "peak_bytes": [
        {"method": m, "coverage": c, "steps": s, "before": old[(m, c, s)], "after": v}
        for (m, c, s), v in new.items()]}
    payload.pop("rows")
    return write_task_results(suite, task, rows, payload, results, plots=plots)


def _summary_rows() -> list[tuple[tuple[str, ...], str]]:
    """quality.md's summary rows (methods, title): the SDP strategies of the table grouped by
    masking (b-sdp, n-sdp; bb-sdp, nb-sdp), then the regularised baselines."""
    by_masking: dict[str, list[str]] = {}
    for name in SDP_NAMES:
        by_masking.setdefault(STRATEGIES[name].masking, []).append(name)
    rows = [(tuple(names), ", ".join(names)) for names in by_masking.values()]
    return [*rows, (tuple(REGULARISED), "stoch. depth, dropout")]


def memory_ratio_lines(rows: dict[str, list[Row]]) -> list[str]:
    """The "peak memory / DDP" rows of docs/results/quality.md, from a task's rows."""
    step = rows["step"]
    base = next(r for r in step if is_reference(r.method)).memory.mean
    coverages = sorted({r.coverage for r in step if not is_reference(r.method)}, reverse=True)
    mem = {(r.method, r.coverage): r.memory.mean for r in step}
    lines = []
    for methods, title in _summary_rows():
        cells = [", ".join(f"{mem[(m, c)] / base:.2f}" if (m, c) in mem else "-" for m in methods)
                 for c in coverages]
        lines.append(f"| peak memory / DDP: {title} | | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    import multiprocessing

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--tasks", default=None, help="comma-separated subset: llama,resnet")
    ap.add_argument("--results", default="docs/results")
    ap.add_argument("--runs", default="runs/study-ddp-memory",
                    help="run directories; finished cells there are reused (not runs/study: "
                         "its DDP runs are the ones being replaced)")
    ap.add_argument("--no-plots", dest="plots", action="store_false")
    args = ap.parse_args(argv)
    suite = select(SUITES["quality"],
                   tasks=[t.strip() for t in args.tasks.split(",")] if args.tasks else None)
    multiprocessing.set_forkserver_preload(["subnetdp.train.trainer"])  # as compare does
    results = Path(args.results)
    for task in suite.tasks:
        written = remeasure_ddp_memory(suite, task, results, Path(args.runs),
                                       log=lambda m: print(m, flush=True), plots=args.plots)
        if written:
            print("wrote: " + ", ".join(str(p) for p in written))
            payload = json.loads((results / f"quality_{task.name}.json").read_text())
            print(f"{task.recipe}: the memory rows of {results / 'quality.md'} become:")
            print("\n".join(memory_ratio_lines(rows_from_payload(payload))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
