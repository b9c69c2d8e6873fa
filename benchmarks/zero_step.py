"""Does ZeRO inside holder groups cost step time? b-sdp vs b-sdp+zero1 / +zero2 on real gloo
workers, steps interleaved (``subnetdp.bench.step``): median step time and its ratio to plain
b-sdp, measured peak memory and counted ring bytes. Prints a table, writes
benchmarks/results/zero_step.{md,json}.

    python benchmarks/zero_step.py [--recipe llama-tiny] [--world 4] [--coverage 0.5]
        [--batch 8] [--seq 128] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from subnetdp.bench.step import run_step_bench
from subnetdp.estimate.spec import BenchSpec

RESULTS = Path(__file__).parent / "results"
TARGET = 1.05  # b-sdp+zero2 step time / b-sdp's


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="llama-tiny")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--coverage", type=float, default=0.5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    base = BenchSpec(recipe=args.recipe, strategy="b-sdp", world=args.world, batch=args.batch,
                     seq=args.seq, coverage=args.coverage)
    specs = [base, base.replace(zero=1), base.replace(zero=2)]
    out = run_step_bench(specs, steps=args.steps, warmup=args.warmup)
    rows = out["rows"]
    ref = rows[base.label]
    lines = ["| strategy | median step s | / b-sdp | peak MiB (worst rank) | / b-sdp | "
             "ring MB/step |", "|---|---|---|---|---|---|"]
    for spec in specs:
        r = rows[spec.label]
        r["step_ratio"] = r["median_step_s"] / ref["median_step_s"]
        r["peak_ratio"] = r["measured_peak_bytes"] / ref["measured_peak_bytes"]
        lines.append(f"| {spec.label} | {r['median_step_s']:.4f} | {r['step_ratio']:.3f} | "
                     f"{r['measured_peak_bytes'] / 2**20:.1f} | {r['peak_ratio']:.3f} | "
                     f"{r['comm']['comm/ring_bytes_per_step'] / 1e6:.2f} |")
    ratio = rows[specs[2].label]["step_ratio"]
    verdict = (f"b-sdp+zero2 / b-sdp step time = {ratio:.3f} (target <= {TARGET}): "
               f"{'MET' if ratio <= TARGET else 'NOT MET'}")
    md = [f"# ZeRO inside holder groups: step time ({args.recipe}, {args.world} gloo workers, "
          f"C = {args.coverage}, micro-batch {args.batch} x {args.seq}, median of "
          f"{args.steps} interleaved steps after {args.warmup} warm-up)", "", *lines, "",
          verdict]
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": "zero_step", "args": vars(args), **out, "verdict": verdict,
              "versions": {"torch": torch.__version__, "python": platform.python_version()}}
    (RESULTS / "zero_step.json").write_text(json.dumps(record, indent=1, default=str))
    (RESULTS / "zero_step.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
