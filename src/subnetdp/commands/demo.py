"""``subnetdp demo`` (``make demo``): DDP vs b-sdp on real text with CPU workers, one table.

By default at matched compute, the paper's convention: b-sdp at coverage C trains
round(steps / C) steps, since each of its workers runs C of the blocks per step
(``study.suite.budget_steps``, the quality study's FLOP-matched budget).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from subnetdp.train.config import TrainConfig


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="ddp vs b-sdp on llama-tiny at matched compute, "
                                           "side by side")
    p.set_defaults(func=run)
    p.add_argument("--recipe", default="llama-tiny")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=200, help="DDP's steps")
    p.add_argument("--coverage", type=float, default=0.5)
    p.add_argument("--match", default="compute", choices=("compute", "steps"),
                   help="compute: b-sdp trains round(steps / coverage) steps, the block FLOPs "
                        "of DDP's steps; steps: both train --steps (default compute)")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def matching_note(steps: dict[str, int], coverage: float, match: str) -> str:
    """One line saying how the two runs' budgets compare."""
    if match == "steps":
        return (f"matched steps: both train {steps['ddp']} steps (b-sdp's workers then run "
                f"{coverage:g} of the blocks: less compute than DDP)")
    return (f"matched compute: b-sdp trains round({steps['ddp']} / {coverage:g}) = "
            f"{steps['b-sdp']} steps of {coverage:g} of the blocks, the block FLOPs of DDP's "
            f"{steps['ddp']} (embeddings and output layer run every step, so b-sdp computes "
            "somewhat more in all; wall time shows what it cost)")


def run(args: argparse.Namespace) -> int:
    from subnetdp.metrics.report import comparison_table, format_summary
    from subnetdp.study.suite import budget_steps
    from subnetdp.train.run import run_training

    if not 0 < args.coverage <= 1 or args.steps < 1:
        print(f"subnetdp demo: need 0 < --coverage <= 1 and --steps >= 1, got "
              f"{args.coverage} and {args.steps}", file=sys.stderr)
        return 2
    budget = "flop" if args.match == "compute" else "step"
    steps = {s: budget_steps(s, args.coverage, args.steps, budget) for s in ("ddp", "b-sdp")}
    summaries = {}
    for strategy, n in steps.items():
        name = "ddp" if strategy == "ddp" else f"b-sdp (C={args.coverage:g})"
        print(f"== {name}: {args.recipe}, {args.nproc} CPU workers, {n} steps ==", flush=True)
        cfg = TrainConfig(recipe=args.recipe, strategy=strategy, coverage=args.coverage,
                          nproc=args.nproc, steps=n, progress=args.progress, device="cpu",
                          out=str(Path(args.out) / strategy), overwrite=True)
        summaries[strategy] = run_training(cfg)
        print(format_summary(summaries[strategy]), flush=True)
    print("\n" + matching_note(steps, args.coverage, args.match))
    print(comparison_table(summaries["ddp"], summaries["b-sdp"]))
    print(f"\nruns and metrics: {args.out}/{{ddp,b-sdp}}/summary.json, metrics/rank*.jsonl")
    return 0
