"""Tables and plots of benchmark rows: markdown, and PNG bar charts (matplotlib, Agg).

A *row* is a dict with at least ``label``, ``peak_bytes``, ``breakdown`` (memory categories)
and ``comm`` (``comm/bytes_per_step``, ``comm/ring_bytes_per_step``); rows of one model share a
``model`` key. Ratios are taken to the row labelled ``ddp`` of the same model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

GiB = float(1 << 30)
MB = 1e6
STACK = ("params", "grads", "optimizer", "activations", "temporaries", "buffers", "other")


def _ratio(x: float | None, base: float | None) -> str:
    return f"{x / base:.3f}" if x is not None and base else "-"


def memory_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per model and strategy, peak and breakdown (GiB), comm (MB), ratios to DDP."""
    head = ("| model | strategy | peak GiB | / DDP | params | grads | optimizer | activations "
            "| temporaries | ring MB/step | payload MB/step | comm / DDP |")
    out = [head, "|" + "---|" * 12]
    for model, r, base in _with_ddp_base(rows):
        b = r["breakdown"]
        ring = r["comm"]["comm/ring_bytes_per_step"]
        out.append(
            f"| {model} | {r['label']} | {r['peak_bytes'] / GiB:.2f} | "
            f"{_ratio(r['peak_bytes'], base['peak_bytes'] if base else None)} | "
            + " | ".join(f"{b.get(k, 0) / GiB:.2f}" for k in STACK[:5])
            + f" | {ring / MB:,.0f} | {r['comm']['comm/bytes_per_step'] / MB:,.0f} | "
            f"{_ratio(ring, base['comm']['comm/ring_bytes_per_step'] if base else None)} |"
        )
    return "\n".join(out)


def _with_ddp_base(rows: list[dict[str, Any]]) -> Any:
    """``(model, row, that model's ddp row or None)`` for every row, grouped by model."""
    for model in dict.fromkeys(r["model"] for r in rows):
        group = [r for r in rows if r["model"] == model]
        base = next((r for r in group if r["label"] == "ddp"), None)
        for r in group:
            yield model, r, base


def step_table(summary: dict[str, Any]) -> str:
    """Markdown of a step benchmark: time, ratio, measured vs estimated memory, counted comm;
    with ``--compute`` the compute-only step and the exposed communication, and under
    ``--link`` a first line on the emulated network and its measured links."""
    timed = any("compute_step_s" in r for r in summary["rows"].values())
    out = _network_lines(summary.get("network"))
    out += ["| strategy | median step s | / DDP | measured peak MiB | estimated peak MiB "
            "| est / meas | counted payload MB/step |"
            + (" slowest rank s | compute s | exposed comm s |" if timed else ""),
            "|" + "---|" * (10 if timed else 7)]
    for label, r in summary["rows"].items():
        est = r.get("estimated_peak_bytes")
        counted = r["comm"]["comm/bytes_per_step"] if r.get("comm") else None
        out.append(
            f"| {label} | {r['median_step_s']:.3f} | "
            + (f"{r['step_ratio_to_ddp']:.3f}" if r["step_ratio_to_ddp"] is not None
               else "-")  # no ddp among the strategies
            + f" | {r['measured_peak_bytes'] / 2**20:.1f} | "
            + (f"{est / 2**20:.1f} | {est / r['measured_peak_bytes']:.3f} | "
               if est else "- | - | ")
            + (f"{counted / MB:.3f} |" if counted is not None else "not counted |")
            + (f" {r['slowest_rank_median_s']:.3f} | {r['compute_step_s']:.3f} | "
               f"{r['exposed_comm_s']:.3f} |" if timed else "")
        )
    return "\n".join(out)


def _network_lines(net: dict[str, Any] | None) -> list[str]:
    if not net:
        return []
    rate = "unthrottled" if net["rate_mbit"] is None else f"{net['rate_mbit']:g} Mbit/s"
    where = ("one shared link" if net["nodes"] == 1
             else f"{net['nodes']} nodes, each linked to the others at")
    measured = "; ".join(f"{name} measured {m['mbit']:,.0f} Mbit/s, round trip "
                         f"{m['rtt_ms']:.3f} ms" for name, m in net["links"].items())
    return [f"Emulated network: {where} {rate}"
            + (f", +{net['latency_ms']:g} ms" if net["latency_ms"] else "")
            + f" ({measured})", ""]


def composition_table(rows: list[dict[str, Any]], paper: dict[str, float]) -> str:
    """Markdown of composition rows (grouped by ``model``: one recipe, micro-batch and dtype):
    peak (GiB and GB), ratio to the group's ``ddp``, the paper's GB and ratio where it reports
    one (``paper[label]``, ratio to ``paper["ddp"]``), the breakdown and the ring bytes."""
    out = ["| setting | strategy | peak GiB | peak GB | / DDP | paper GB | paper / DDP | params "
           "| grads | optimizer | activations | temporaries | ring MB/step | comm / DDP |",
           "|" + "---|" * 14]
    for model, r, base in _with_ddp_base(rows):
        b = r["breakdown"]
        ring = r["comm"]["comm/ring_bytes_per_step"]
        pp = paper.get(r["label"])
        out.append(
            f"| {model} | {r['label']} | {r['peak_bytes'] / GiB:.2f} | "
            f"{r['peak_bytes'] / 1e9:.2f} | "
            f"{_ratio(r['peak_bytes'], base['peak_bytes'] if base else None)} | "
            + (f"{pp:.1f} | {pp / paper['ddp']:.3f} | " if pp is not None else "- | - | ")
            + " | ".join(f"{b.get(k, 0) / GiB:.2f}" for k in STACK[:5])
            + f" | {ring / MB:,.0f} | "
            f"{_ratio(ring, base['comm']['comm/ring_bytes_per_step'] if base else None)} |"
        )
    return "\n".join(out)


def plot_rows(rows: list[dict[str, Any]], out_dir: Path, prefix: str = "") -> list[Path]:
    """One PNG per model of stacked memory bars, and one of ring bytes per step (file names
    ``{prefix}memory_breakdown.png``, ``{prefix}comm_bytes.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        group = [r for r in rows if r["model"] == model]
        labels = [r["label"] for r in group]
        bottom = [0.0] * len(group)
        for cat in STACK:
            vals = [r["breakdown"].get(cat, 0) / GiB for r in group]
            ax.bar(labels, vals, bottom=bottom, label=cat)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_title(f"{model}: peak memory per worker")
        ax.set_ylabel("GiB at the peak")
        ax.tick_params(axis="x", rotation=60)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / f"{prefix}memory_breakdown.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        group = [r for r in rows if r["model"] == model]
        ax.bar([r["label"] for r in group],
               [r["comm"]["comm/ring_bytes_per_step"] / MB for r in group], color="C1")
        ax.set_title(f"{model}: bytes sent per step")
        ax.set_ylabel("ring MB per worker per step")
        ax.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    path = out_dir / f"{prefix}comm_bytes.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written
