"""Readable tables of run summaries."""

from __future__ import annotations

from typing import Any

MiB = 2**20


def _worst(summary: dict[str, Any], key: str) -> float:
    values = [r[key] for r in summary["per_rank"] if r.get(key) is not None]
    return max(values) if values else float("nan")


def row_values(summary: dict[str, Any]) -> dict[str, float]:
    """The headline figures of a run (per-worker figures: the worst rank)."""
    quality = summary.get("val_accuracy", summary.get("val_loss", float("nan")))
    return {
        "quality": quality,
        "params": _worst(summary, "params_held"),
        "memory": _worst(summary, "peak_memory_bytes"),
        "bytes": _worst(summary, "comm_bytes_per_step"),
        "step_time": summary["step_time_s"],
    }


def format_summary(summary: dict[str, Any]) -> str:
    v = row_values(summary)
    qname = "val_accuracy" if "val_accuracy" in summary else "val_loss"
    lines = [
        f"{summary['strategy']} on {summary['recipe']}: {summary['world']} workers, "
        f"coverage {summary['coverage']}, {summary['steps']} steps",
        f"  final train loss   {summary['final_train_loss']:.4f}",
        f"  {qname:<18} {v['quality']:.4f}",
        f"  params / worker    {v['params'] / 1e6:.3f} M (max over ranks)",
        f"  peak mem / worker  {v['memory'] / MiB:.1f} MiB (measured, max over ranks)",
        f"  bytes sent / step  {v['bytes'] / MiB:.2f} MiB (max over ranks)",
        f"  step time          {v['step_time']:.3f} s (median)",
    ]
    return "\n".join(lines)


def comparison_table(base: dict[str, Any], other: dict[str, Any]) -> str:
    """Side by side: two runs and the ratio other / base of every figure."""
    b, o = row_values(base), row_values(other)
    qname = "val accuracy" if "val_accuracy" in base else "val loss (full model)"
    rows = [
        (qname, f"{b['quality']:.4f}", f"{o['quality']:.4f}", o["quality"] / b["quality"]),
        ("params held / worker", f"{b['params'] / 1e6:.3f} M", f"{o['params'] / 1e6:.3f} M",
         o["params"] / b["params"]),
        ("peak memory / worker", f"{b['memory'] / MiB:.1f} MiB", f"{o['memory'] / MiB:.1f} MiB",
         o["memory"] / b["memory"]),
        ("bytes sent / step", f"{b['bytes'] / MiB:.2f} MiB", f"{o['bytes'] / MiB:.2f} MiB",
         o["bytes"] / b["bytes"] if b["bytes"] else float("nan")),
        ("median step time", f"{b['step_time']:.3f} s", f"{o['step_time']:.3f} s",
         o["step_time"] / b["step_time"]),
    ]
    h1 = base["strategy"]
    h2 = f"{other['strategy']} (C={other['coverage']})"
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(h1), *(len(r[1]) for r in rows))
    w2 = max(len(h2), *(len(r[2]) for r in rows))
    ratio = f"{other['strategy']} / {base['strategy']}"
    out = [f"{'':<{w0}}  {h1:>{w1}}  {h2:>{w2}}  {ratio:>11}"]
    out.append("-" * len(out[0]))
    for name, x, y, r in rows:
        out.append(f"{name:<{w0}}  {x:>{w1}}  {y:>{w2}}  {r:>11.3f}")
    return "\n".join(out)
