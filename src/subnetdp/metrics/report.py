"""Readable tables of run summaries (``summary.json``): one run, or runs side by side.

No torch: the CLI, the quality study and the benchmarks format summaries read back from disk.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from subnetdp.strategy import RankSpec, composition_of

MiB = 2**20


def _worst(summary: dict[str, Any], key: str) -> float:
    values = [r[key] for r in summary["per_rank"] if r.get(key) is not None]
    return max(values) if values else float("nan")


def _figure(value: Any) -> float:
    """A summary's figure as a float: NaN where it was not measured (``null`` in the JSON)."""
    return float("nan") if value is None else float(value)


def row_values(summary: dict[str, Any]) -> dict[str, float]:
    """The headline figures of a run (per-worker figures: the worst rank; NaN: not measured)."""
    quality = summary.get("val_accuracy", summary.get("val_loss"))
    return {
        "steps": float(summary["steps"]),
        "quality": _figure(quality),
        "params": _worst(summary, "params_held"),
        "memory": _worst(summary, "peak_memory_bytes"),
        "bytes": _worst(summary, "comm_bytes_per_step"),
        "refresh": max((r.get("refresh_bytes_per_step") or 0) for r in summary["per_rank"]),
        # null when no step was timed (a resume whose only step measured memory)
        "step_time": _figure(summary.get("step_time_s")),
        "train_time": _figure(summary.get("train_time_s")),
    }


def format_summary(summary: dict[str, Any]) -> str:
    v = row_values(summary)
    qname = "val_accuracy" if "val_accuracy" in summary else "val_loss"

    def line(title: str, key: str, fmt: Callable[[float], str], note: str) -> str:
        shown = f"{fmt(v[key])} ({note})" if math.isfinite(v[key]) else "not measured"
        return f"  {title:<18} {shown}"

    lines = [
        f"{summary['strategy']} on {summary['recipe']}: {summary['world']} workers, "
        f"coverage {summary['coverage']}, {summary['steps']} steps",
        f"  final train loss   {summary['final_train_loss']:.4f}",
        f"  {qname:<18} {v['quality']:.4f}",
        f"  params / worker    {v['params'] / 1e6:.3f} M (max over ranks)",
        line("peak mem / worker", "memory", lambda x: f"{x / MiB:.1f} MiB",
             "measured, max over ranks"),
        f"  bytes sent / step  {v['bytes'] / MiB:.2f} MiB (max over ranks)",
        *([f"  refresh / step     {v['refresh'] / MiB:.2f} MiB (owners -> non-holders, max)"]
          if v["refresh"] else []),
        line("step time", "step_time", lambda x: f"{x:.3f} s", "median"),
        *([f"  wall time (train)  {v['train_time']:.1f} s (training loop, slowest rank)"]
          if math.isfinite(v["train_time"]) else []),
        *downstream_lines(summary),
        *_checkpoint_line(summary),
        *_numerics_line(summary),
    ]
    return "\n".join(lines)


def _numerics_line(summary: dict[str, Any]) -> list[str]:
    """The kernels the figures came from ([Note: figures that repeat on one machine])."""
    n = summary.get("numerics")
    if not n:
        return []
    threads = f"{n['threads']} thread{'s' if n['threads'] != 1 else ''}"
    mkl = f", MKL {n['mkl']}" if n.get("mkl") else ""
    gpu = f", {n['gpu']}" if n.get("gpu") else ""
    return [f"  kernels            {n['cpu_capability']} on {n['cpu']}, {threads}, torch "
            f"{n['torch']}{mkl}{gpu} (summary.json numerics)"]


def _checkpoint_line(summary: dict[str, Any]) -> list[str]:
    """Where the trained model is (``subnetdp export``/``eval`` read it), or why it is not."""
    if "checkpoint" not in summary:  # a summary from before runs recorded it
        return []
    path = summary["checkpoint"]
    shown = (f"{path} (subnetdp eval / export read it)" if path is not None
             else f"none ({summary.get('checkpoint_note', 'not saved')})")
    return [f"  checkpoint         {shown}"]


_DOWNSTREAM = re.compile(r"eval/(?P<task>.+)/(?P<metric>acc|acc_norm)")


def downstream_lines(summary: dict[str, Any]) -> list[str]:
    """One line per task that ``--eval-tasks`` scored (``eval/<task>/acc``, ``acc_norm``)."""
    tasks: dict[str, dict[str, float]] = {}
    for key, value in summary.items():
        m = _DOWNSTREAM.fullmatch(key)
        if m is not None:
            tasks.setdefault(m["task"], {})[m["metric"]] = float(value)
    limit = summary.get("config", {}).get("eval_limit")
    note = f"first {limit} documents" if limit else "all documents"
    return [f"  {task:<18} " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(scores.items()))
            + f" ({note})" for task, scores in sorted(tasks.items())]


def label(summary: dict[str, Any]) -> str:
    """A run's column header: the label its run wrote (``strategy.label`` of its strategy and
    composition, e.g. ``ddp``, ``fsdp+ac``, ``b-sdp+zero2 (C=0.5)``); for a summary written
    before runs recorded it, the same label made from the run's config."""
    if "label" in summary:
        return str(summary["label"])
    spec = RankSpec.of(summary["strategy"], composition_of(summary.get("config", {})))
    return spec.label(summary["coverage"])


def _cell(fmt: Callable[[float], str], value: float) -> str:
    return fmt(value) if math.isfinite(value) else "-"


def comparison_table(
    base: dict[str, Any], *others: dict[str, Any], labels: list[str] | None = None
) -> str:
    """Side by side: a base run, other runs, and the ratio other / base of every figure
    (``-``: not measured, or nothing to compare with)."""
    runs = [base, *others]
    names = labels or [label(r) for r in runs]
    vals = [row_values(r) for r in runs]
    qname = "val accuracy" if "val_accuracy" in base else "val loss (full model)"
    fields: list[tuple[str, str, Callable[[float], str]]] = [
        ("steps", "steps", lambda v: f"{v:.0f}"),
        (qname, "quality", lambda v: f"{v:.4f}"),
        ("params held / worker", "params", lambda v: f"{v / 1e6:.3f} M"),
        ("peak memory / worker", "memory", lambda v: f"{v / MiB:.1f} MiB"),
        ("bytes sent / step", "bytes", lambda v: f"{v / MiB:.2f} MiB"),
        ("median step time", "step_time", lambda v: f"{v:.3f} s"),
    ]
    if any(v["refresh"] for v in vals):  # backward masking's second traffic, kept apart
        fields.insert(5, ("refresh sent / step", "refresh", lambda v: f"{v / MiB:.2f} MiB"))
    if any(math.isfinite(v["train_time"]) for v in vals):  # summaries that record it
        fields.append(("wall time (train)", "train_time", lambda v: f"{v:.1f} s"))
    ratio_names = [f"{n.split(' ')[0]} / {names[0].split(' ')[0]}" for n in names[1:]]
    header = ["", *names, *ratio_names]
    rows = []
    for title, key, fmt in fields:
        b = vals[0][key]
        ratios = [_cell(lambda r: f"{r:.3f}", v[key] / b) if b else "-" for v in vals[1:]]
        rows.append([title, *(_cell(fmt, v[key]) for v in vals), *ratios])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i])
                       for i, c in enumerate(header))]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i])
                        for i, c in enumerate(r)) for r in rows]
    return "\n".join(lines)
