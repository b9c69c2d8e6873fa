"""``subnetdp demo`` (``make demo``): DDP vs b-sdp on real text with CPU workers, one table.

By default at matched compute, the paper's convention: b-sdp at coverage C trains
round(steps / C) steps, since each of its workers runs C of the blocks per step
(``study.suite.budget_steps``, the quality study's FLOP-matched budget).

The demo's figures are a reference (the README's table), so a run reproduces them bit for bit:
data, initialisation and reductions are fixed by the seed and the world size, and each worker
computes on one thread whatever ``OMP_NUM_THREADS`` the caller has (a CPU kernel's thread
count changes how it splits its sums, hence the last bits, which 200 steps amplify).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from subnetdp.commands.options import HelpFormatter, old_name
from subnetdp.train.config import TrainConfig


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="ddp vs b-sdp on llama-tiny at matched compute, "
                                           "side by side",
                              description=__doc__, formatter_class=HelpFormatter)
    p.set_defaults(func=run)
    p.add_argument("--recipe", default="llama-tiny", metavar="NAME",
                   help="the recipe both runs train")
    p.add_argument("--nproc", type=int, default=4, metavar="N", help="CPU worker processes")
    p.add_argument("--steps", type=int, default=200, help="DDP's steps")
    p.add_argument("--coverage", type=float, default=0.5, help="b-sdp's coverage")
    p.add_argument("--match", default="compute", choices=("compute", "steps"),
                   help="compute: b-sdp trains round(steps / coverage) steps, the block FLOPs "
                        "of DDP's steps; steps: both train --steps (default compute)")
    p.add_argument("--runs", "--out", dest="out", default="runs/demo", metavar="DIR",
                   help="folder of the two runs (DIR/ddp, DIR/b-sdp)" + old_name("--out"))
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress lines (default: rank 0's)")


def matching_note(steps: dict[str, int], coverage: float, match: str) -> str:
    """One line saying how the two runs' budgets compare."""
    if match == "steps":
        return (f"matched steps: both train {steps['ddp']} steps (b-sdp's workers then run "
                f"{coverage:g} of the blocks: less compute than DDP)")
    return (f"matched compute: b-sdp trains round({steps['ddp']} / {coverage:g}) = "
            f"{steps['b-sdp']} steps of {coverage:g} of the blocks, the block FLOPs of DDP's "
            f"{steps['ddp']} (embeddings and output layer run every step, so b-sdp computes "
            "somewhat more in all; wall time shows what it cost)")


def demo_config(args: argparse.Namespace, strategy: str, steps: int) -> TrainConfig:
    """The run the demo trains for ``strategy``."""
    return TrainConfig(recipe=args.recipe, strategy=strategy, coverage=args.coverage,
                       nproc=args.nproc, steps=steps, progress=args.progress, device="cpu",
                       out=str(Path(args.out) / strategy), overwrite=True)


@contextlib.contextmanager
def one_thread_per_worker() -> Iterator[None]:
    """Workers take the launch's environment: ``OMP_NUM_THREADS=1`` while the demo trains."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def run(args: argparse.Namespace) -> int:
    from subnetdp.checkpoint.rundir import check_output
    from subnetdp.metrics.report import comparison_table, format_summary
    from subnetdp.study.suite import budget_steps
    from subnetdp.train.run import run_training

    if not 0 < args.coverage <= 1 or args.steps < 1:
        print(f"subnetdp demo: need 0 < --coverage <= 1 and --steps >= 1, got "
              f"{args.coverage} and {args.steps}", file=sys.stderr)
        return 2
    try:
        check_output(args.out, flag="--runs")  # the demo replaces DIR/ddp and DIR/b-sdp
    except ValueError as e:
        print(f"subnetdp demo: {e}", file=sys.stderr)
        return 2
    budget = "flop" if args.match == "compute" else "step"
    steps = {s: budget_steps(s, args.coverage, args.steps, budget) for s in ("ddp", "b-sdp")}
    summaries = {}
    for strategy, n in steps.items():
        name = "ddp" if strategy == "ddp" else f"b-sdp (C={args.coverage:g})"
        print(f"== {name}: {args.recipe}, {args.nproc} CPU workers, {n} steps ==", flush=True)
        with one_thread_per_worker():
            summaries[strategy] = run_training(demo_config(args, strategy, n))
        print(format_summary(summaries[strategy]), flush=True)
    print("\n" + matching_note(steps, args.coverage, args.match))
    print(comparison_table(summaries["ddp"], summaries["b-sdp"]))
    print(f"\nruns and metrics: {args.out}/{{ddp,b-sdp}}/summary.json, metrics/rank*.jsonl")
    return 0
