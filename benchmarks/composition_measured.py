"""SDP composed with FSDP2 and activation checkpointing, measured: step time and peak memory.

    OMP_NUM_THREADS=1 python benchmarks/composition_measured.py [--steps 10] [--nproc 4]

One ``bench step`` run (gloo workers, every configuration built by ``parallelize`` in every
worker, steps interleaved so machine noise hits all alike): DDP, plain FSDP2 (``fsdp``,
``fsdp+ac``), b-sdp, bb-sdp and n-sdp with ``--fsdp --ac`` at C = 0.5, b-sdp + FSDP at C = 0.5
with prefetch off, and b-sdp + FSDP at C = 1 (everyone holds everything: the SDP runtime's
own overhead over plain FSDP2). Per row: median step time over ranks and steps, its ratio to
DDP (and C = 1 to plain FSDP2, prefetch off to on), the measured peak of the heaviest rank
(``metrics.memory``: parameters, gradients, optimizer state, activations) with the fake-tensor
estimate beside it, and counted bytes per step. On gloo a reduce-scatter clones its input, so
measured FSDP peaks sit above the estimate by up to one unit's gradient (Note: gloo's
reduce-scatter clone, estimate/memory.py); NCCL does not. Writes
benchmarks/results/composition_measured.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

from subnetdp.bench.step import run_step_bench
from subnetdp.estimate.memory import estimate_memory
from subnetdp.estimate.spec import BenchSpec

OUT = Path(__file__).parent / "results"
MIB = 2**20


def specs(nproc: int, model_args: tuple[tuple[str, Any], ...], batch: int,
          seq: int) -> list[BenchSpec]:
    base = BenchSpec(recipe="llama-tiny", strategy="ddp", world=nproc, batch=batch, seq=seq,
                     model_args=model_args)
    half = {"coverage": 0.5, "fsdp": True, "ac": True}
    return [
        base, base.replace(strategy="fsdp"), base.replace(strategy="fsdp+ac"),
        base.replace(strategy="b-sdp", **half), base.replace(strategy="bb-sdp", **half),
        base.replace(strategy="n-sdp", **half),
        base.replace(strategy="b-sdp", coverage=0.5, fsdp=True),
        base.replace(strategy="b-sdp", coverage=0.5, fsdp=True, fsdp_prefetch=False),
        base.replace(strategy="b-sdp", coverage=1.0, fsdp=True),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: NCCL, one GPU per worker (--nproc <= GPUs)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    model_args = (("dim", args.dim), ("n_layers", args.layers))
    todo = specs(args.nproc, model_args, args.batch, args.seq)
    t0 = time.perf_counter()
    res = run_step_bench(todo, steps=args.steps, warmup=args.warmup, device=args.device)
    wall = time.perf_counter() - t0
    rows = []
    for s in todo:
        r = res["rows"][s.label]
        est = estimate_memory(s).worst.peak_bytes
        rows.append({"label": s.label, "median_step_s": r["median_step_s"],
                     "slowest_rank_median_s": r["slowest_rank_median_s"],
                     "step_ratio_to_ddp": r["step_ratio_to_ddp"],
                     "measured_peak_bytes": r["measured_peak_bytes"],
                     "estimated_peak_bytes": est,
                     "bytes_per_step": r["comm"]["comm/bytes_per_step"] if r["comm"] else 0.0})
    by = {r["label"]: r for r in rows}
    pairs = {"C=1 SDP+FSDP / plain FSDP2": ("b-sdp+fsdp (C=1)", "fsdp"),
             "prefetch off / on (b-sdp+fsdp, C=0.5)": ("b-sdp+fsdp (C=0.5) (no prefetch)",
                                                       "b-sdp+fsdp (C=0.5)")}
    ratios = {k: by[a]["median_step_s"] / by[b]["median_step_s"] for k, (a, b) in pairs.items()}
    record = {"config": vars(args) | {"out": str(args.out)}, "rows": rows, "ratios": ratios,
              "wall_s": wall, "host": platform.node(), "cpus": _cpus(),
              "versions": res["versions"]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "composition_measured.json").write_text(json.dumps(record, indent=1) + "\n")
    text = _table(record)
    (args.out / "composition_measured.md").write_text(text)
    print(text)
    _plot(rows, args.out / "composition_measured.png")


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _table(rec: dict[str, Any]) -> str:
    c = rec["config"]
    where = (f"gloo workers on {rec['cpus']} CPU cores" if c["device"] == "cpu"
             else "NCCL workers, one GPU each")
    lines = [
        "# SDP composed with FSDP2 and activation checkpointing (measured)",
        "",
        f"`python benchmarks/composition_measured.py` — llama-tiny (dim {c['dim']}, "
        f"{c['layers']} layers), {c['nproc']} {where}, micro-batch "
        f"{c['batch']} x {c['seq']}, fp32, AdamW; {c['steps']} timed steps after "
        f"{c['warmup']} warm-up, interleaved; wall {rec['wall_s']:.0f} s.",
        "",
        "| configuration | step (s) | / ddp | slowest rank (s) | measured peak (MiB) | "
        "estimated peak (MiB) | bytes/step (MB) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rec["rows"]:
        lines.append(
            f"| {r['label']} | {r['median_step_s']:.3f} | {r['step_ratio_to_ddp']:.2f} | "
            f"{r['slowest_rank_median_s']:.3f} | {r['measured_peak_bytes'] / MIB:.1f} | "
            f"{r['estimated_peak_bytes'] / MIB:.1f} | {r['bytes_per_step'] / 1e6:.2f} |")
    lines += ["", "Ratios of median step times in the same run:", ""]
    lines += [f"- {k}: **{v:.3f}**" for k, v in rec["ratios"].items()]
    lines += ["", "Measured peaks are the heaviest rank's; on gloo FSDP's reduce-scatter clones "
              "its input, so measured FSDP rows can exceed the estimate by up to one unit's "
              "gradient (NCCL does not). Several workers share the CPU cores, so step times "
              "include contention; compare ratios, not absolute times.", ""]
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    axes[0].barh(labels, [r["median_step_s"] for r in rows], color="tab:blue")
    axes[0].set_xlabel("median step time (s)")
    axes[1].barh(labels, [r["measured_peak_bytes"] / MIB for r in rows], color="tab:orange",
                 label="measured")
    axes[1].scatter([r["estimated_peak_bytes"] / MIB for r in rows], labels, color="black",
                    zorder=3, label="estimated")
    axes[1].set_xlabel("peak memory, heaviest rank (MiB)")
    axes[1].legend()
    axes[1].set_yticklabels([])
    for ax in axes:
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
