"""The paper's memory/communication table at paper scale, and a measured run at CPU scale.

1. Estimated (fake tensors + fake process group, ``subnetdp.bench.estimate``): llama-134m,
   llama-500m and llama-1b at 8 workers, one micro-batch of ``--batch`` x ``--seq`` tokens, fp32,
   AdamW: ddp, ddp (torch's default buckets), ddp+ac, fsdp, fsdp+ac and every SDP strategy at
   C = 0.5 and 0.69, with the analytic bytes per step; each ratio to ddp.
2. Measured (real gloo workers, ``subnetdp.bench.step``): every strategy side by side on a small
   model, steps interleaved: median step time and its ratio to ddp, measured peak memory next to
   the estimate of the same configuration, and the bytes the reducers counted.

Writes benchmarks/results/paper_scale.{md,json}, memory_breakdown.png, comm_bytes.png.

    python benchmarks/paper_scale.py [--models llama-134m,llama-500m,llama-1b] [--batch 1]
        [--seq 2048] [--jobs 2] [--step-recipe llama-tiny --step-world 4 --step-steps 6]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import time
from pathlib import Path
from typing import Any

import torch

from subnetdp.bench.comm import analytic_comm, worst_comm
from subnetdp.bench.estimate import ddp_default_bucket_bytes, estimate_memory, heaviest_rank
from subnetdp.bench.report import memory_table, plot_rows, step_table
from subnetdp.bench.step import run_step_bench
from subnetdp.bench.strategies import BASELINES, BenchSpec, sdp_strategies

RESULTS = Path(__file__).parent / "results"
COVERAGES = (0.5, 0.69)
WHY = ("Micro-batch and sequence: the llama recipes' training defaults (batch_size 1, seq_len "
       "2048); the paper does not state its micro-batch. ddp = torch DDP with "
       "gradient_as_bucket_view=True (one gradient copy, like subnetdp's reducer); 'ddp (default "
       "buckets)' adds torch's default second gradient copy (in 'other', not a column here). "
       "Comm: ring = 2(c-1)/c x payload per all-reduce group; FSDP: all-gather + reduce-scatter.")


def paper_specs(model: str, world: int, batch: int, seq: int) -> list[BenchSpec]:
    base = BenchSpec(recipe=model, strategy="ddp", world=world, batch=batch, seq=seq)
    specs = [base.replace(strategy=s) for s in BASELINES]
    for s in sdp_strategies():
        specs += [base.replace(strategy=s, coverage=c) for c in COVERAGES]
    return specs


def _estimate_row(spec: BenchSpec) -> dict[str, Any]:
    """One table row (run in a worker process: each estimate owns the fake process group)."""
    t0 = time.perf_counter()
    # b-sdp rows are identical for LLaMA (equal blocks); n-sdp rows differ by a slot or two:
    # the rank holding the most parameters is the worst one in both cases.
    est = estimate_memory(spec, ranks=[heaviest_rank(spec)]).to_dict()
    row = {"model": spec.recipe, **est, "comm": worst_comm(analytic_comm(spec)),
           "estimate_s": time.perf_counter() - t0}
    print(f"  estimated {spec.recipe} {spec.label}: {row['peak_bytes'] / 2**30:.2f} GiB "
          f"({row['estimate_s']:.0f} s)", flush=True)
    return row


def _default_buckets_row(ddp_row: dict[str, Any], spec: BenchSpec) -> dict[str, Any]:
    """torch DDP's default (gradient_as_bucket_view=False): the same step plus one flat copy
    of every gradient, alive all run (reported under 'other')."""
    extra = ddp_default_bucket_bytes(spec)
    breakdown = dict(ddp_row["breakdown"])
    breakdown["other"] = breakdown.get("other", 0) + extra
    breakdown["total"] += extra
    return {**ddp_row, "label": "ddp (default buckets)",
            "peak_bytes": ddp_row["peak_bytes"] + extra, "breakdown": breakdown}


def estimate_table(models: list[str], world: int, batch: int, seq: int,
                   jobs: int) -> list[dict[str, Any]]:
    specs = [s for m in models for s in paper_specs(m, world, batch, seq)]
    with mp.get_context("fork").Pool(jobs, maxtasksperchild=1) as pool:
        rows = pool.map(_estimate_row, specs, chunksize=1)
    out: list[dict[str, Any]] = []
    for spec, row in zip(specs, rows, strict=True):
        out.append(row)
        if spec.strategy == "ddp":
            out.append(_default_buckets_row(row, spec))
    return out


def measured_run(recipe: str, world: int, batch: int, seq: int, steps: int,
                 jobs: int) -> dict[str, Any]:
    base = BenchSpec(recipe=recipe, strategy="ddp", world=world, batch=batch, seq=seq)
    specs = [base.replace(strategy=s) for s in BASELINES]
    specs += [base.replace(strategy=s, coverage=0.5) for s in sdp_strategies()]
    summary = run_step_bench(specs, steps=steps, warmup=2)
    with mp.get_context("fork").Pool(jobs, maxtasksperchild=1) as pool:
        ests = pool.map(_worst_peak, specs, chunksize=1)
    for spec, est in zip(specs, ests, strict=True):
        summary["rows"][spec.label]["estimated_peak_bytes"] = est
    return summary


def _worst_peak(spec: BenchSpec) -> int:
    return estimate_memory(spec).peak_bytes


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """The paper's two headline ratios, checked against our estimates."""
    def ratio(model: str, label: str) -> float | None:
        ddp = next((r for r in rows if r["model"] == model and r["label"] == "ddp"), None)
        row = next((r for r in rows if r["model"] == model and r["label"] == label), None)
        return row["peak_bytes"] / ddp["peak_bytes"] if row and ddp else None

    lines = []
    for model, label, goal in (("llama-1b", "b-sdp (C=0.69)", 0.72),
                               ("llama-500m", "b-sdp (C=0.5)", 0.60)):
        r = ratio(model, label)
        if r is not None:
            lines.append(f"- {model} {label}: peak / ddp = {r:.3f} (paper: <= {goal:.2f}) "
                         f"{'MET' if r <= goal else 'NOT MET'}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-134m,llama-500m,llama-1b")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--jobs", type=int, default=2, help="estimates run in this many processes")
    ap.add_argument("--step-recipe", default="llama-tiny")
    ap.add_argument("--step-world", type=int, default=4)
    ap.add_argument("--step-batch", type=int, default=8)
    ap.add_argument("--step-seq", type=int, default=128)
    ap.add_argument("--step-steps", type=int, default=6)
    ap.add_argument("--skip-step", action="store_true", help="estimates only")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = estimate_table(args.models.split(","), args.world, args.batch, args.seq, args.jobs)
    step = None if args.skip_step else measured_run(
        args.step_recipe, args.step_world, args.step_batch, args.step_seq, args.step_steps,
        args.jobs)
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": "paper_scale", "world": args.world, "batch": args.batch,
              "seq": args.seq, "dtype": "fp32", "optimizer": "AdamW (2 states)",
              "rows": rows, "targets": targets(rows), "step": step,
              "wall_s": time.perf_counter() - t0,
              "versions": {"torch": torch.__version__, "python": platform.python_version()}}
    (RESULTS / "paper_scale.json").write_text(json.dumps(record, indent=1, default=str))
    md = [f"# Paper-scale memory and communication ({args.world} workers, micro-batch "
          f"{args.batch} x {args.seq} tokens, fp32, AdamW; estimated with fake tensors)", "",
          WHY, "", memory_table(rows), "", "Paper targets:", *targets(rows)]
    if step is not None:
        md += ["", f"# Measured: {args.step_recipe}, {args.step_world} gloo workers, "
               f"micro-batch {args.step_batch} x {args.step_seq}, median of "
               f"{args.step_steps} interleaved steps per strategy after 2 warm-up", "",
               step_table(step)]
    (RESULTS / "paper_scale.md").write_text("\n".join(md) + "\n")
    plot_rows(rows, RESULTS)
    print("\n".join(md))
    print(f"\n(wall {record['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
