"""``subnetdp demo`` (``make demo``): DDP vs b-sdp on real text with CPU workers, one table."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from subnetdp.train.config import TrainConfig


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="ddp vs b-sdp on llama-tiny, side by side")
    p.add_argument("--recipe", default="llama-tiny")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--coverage", type=float, default=0.5)
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def run(args: argparse.Namespace) -> int:
    from subnetdp.commands.report import comparison_table, format_summary
    from subnetdp.commands.train_cmd import run_training

    summaries = {}
    for strategy in ("ddp", "b-sdp"):
        print(f"== {strategy}: {args.recipe}, {args.nproc} CPU workers, {args.steps} steps ==",
              flush=True)
        cfg = TrainConfig(recipe=args.recipe, strategy=strategy, coverage=args.coverage,
                          nproc=args.nproc, steps=args.steps, progress=args.progress,
                          out=str(Path(args.out) / strategy))
        summaries[strategy] = run_training(cfg)
        print(format_summary(summaries[strategy]), flush=True)
    print("\n" + comparison_table(summaries["ddp"], summaries["b-sdp"]))
    print(f"\nruns and metrics: {args.out}/{{ddp,b-sdp}}/summary.json, metrics/rank*.jsonl")
    return 0
