"""``subnetdp compare --suite quality``: the quality study, end to end from one command.

    subnetdp compare --suite quality [--quick] [--subset llama,resnet] [--seeds N] [--steps S]
        [--runs runs/study] [--out docs/results] [--no-plots]

Trains every cell that has no result under ``--runs`` yet (a stopped suite resumes where it
stopped), then writes per task ``quality_<task>.md``, ``.json`` and two PNG plots to ``--out``.
``--quick`` runs a small version (C = 0.5, one seed, 20 steps; under 10 minutes on 2 cores)
into ``runs/study-quick`` and writes its results there, not to docs/results.

``--suite convergence`` (``make study-long``, ~2.5 h on 2 cores; study/convergence.py): longer
runs of ddp, b-sdp, n-sdp and bb-sdp at C = 0.5 on llama-tiny, ResNet-18 on all of
Fashion-MNIST and on 2,000 of its images, with the downstream evaluation of every LLaMA run,
into ``runs/study-long``; writes ``convergence.md`` (+ JSON, plots). Its ``--quick`` is a smoke
run of a few steps per cell into ``runs/study-long-quick``.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from subnetdp.commands.options import HelpFormatter, old_name


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("compare", help="the quality study: strategies vs DDP baselines",
                              description=__doc__.split("\n\n")[0] if __doc__ else None,
                              formatter_class=HelpFormatter)
    p.set_defaults(func=run)
    p.add_argument("--suite", default="quality", choices=["quality", "convergence"],
                   help="quality: strategies vs DDP at several coverages; convergence: longer "
                        "runs with downstream evaluation (make study-long)")
    p.add_argument("--quick", action="store_true",
                   help="C = 0.5 only, one seed, 20 steps (< 10 min); into runs/study-quick")
    p.add_argument("--subset", "--tasks", dest="tasks", default=None, metavar="PART[,PART]",
                   help="the suite's parts to run, comma-separated: llama,resnet (convergence: "
                        "and overfit; default: all)" + old_name("--tasks"))
    p.add_argument("--seeds", type=int, default=None, help="seeds per cell (default 3; quick 1)")
    p.add_argument("--steps", type=int, default=None,
                   help="the step-matched budget S (default: the suite's, per task)")
    p.add_argument("--runs", default=None, metavar="DIR",
                   help="run directories; existing results there are reused "
                        "(default runs/study, or runs/study-quick)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="the result tables and plots (default docs/results, or "
                        "runs/study-quick/results)")
    p.add_argument("--no-plots", dest="plots", action="store_false",
                   help="write the tables only (default: also PNG plots)")
    p.add_argument("--downstream-limit", type=int, default=None,
                   help="convergence: documents per downstream task (default 500; quick 8)")


def run(args: argparse.Namespace) -> int:
    import multiprocessing

    from subnetdp.data import DatasetMissingError
    from subnetdp.distributed.launch import WorkerFailedError
    from subnetdp.study.results import write_results
    from subnetdp.study.runner import run_suite
    from subnetdp.study.suite import QUICK, SUITES, enumerate_cells, select

    if args.suite == "convergence":
        from subnetdp.study import convergence

        base = convergence.SMOKE if args.quick else convergence.CONVERGENCE
        default_runs = "runs/study-long-quick" if args.quick else "runs/study-long"
    else:
        base = QUICK if args.quick else SUITES[args.suite]
        default_runs = "runs/study-quick" if args.quick else "runs/study"
    runs = Path(args.runs or default_runs)
    out = Path(args.out or (runs / "results" if args.quick else "docs/results"))
    try:
        tasks = [t.strip() for t in args.tasks.split(",")] if args.tasks else None
        if args.seeds is not None and args.seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
        if args.steps is not None and args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        if args.downstream_limit is not None and args.downstream_limit < 1:
            raise ValueError(f"--downstream-limit must be >= 1, got {args.downstream_limit}")
        suite = select(base, tasks=tasks, seeds=args.seeds, steps=args.steps)
        for flag, folder in (("--runs", runs), ("--out", out)):  # before hours of training
            there = next(p for p in (folder, *folder.parents) if p.exists())
            if not there.is_dir():
                raise ValueError(f"{flag} {folder}: {there} is a file, not a folder; pick "
                                 f"another {flag}")
        from subnetdp.checkpoint.rundir import check_output

        check_output(runs, flag="--runs")  # its cells' folders are replaced when unfinished
        check_output(out, flag="--out")
    except ValueError as e:
        print(f"subnetdp compare: {e}", file=sys.stderr)
        return 2
    # Workers start from a fork server that has imported the trainer once (cheap, and safe
    # to fork from: it has no threads).
    multiprocessing.set_forkserver_preload(["subnetdp.train.trainer"])
    cells = enumerate_cells(suite)
    print(f"{suite.name}: {len(cells)} runs ({', '.join(t.recipe for t in suite.tasks)}; "
          f"{suite.seeds} seed(s)) under {runs}", flush=True)
    t0 = time.perf_counter()
    after = None
    if args.suite == "convergence":
        limit = args.downstream_limit or (8 if args.quick else convergence.DOWNSTREAM_LIMIT)
        after = partial(convergence.after_cell, downstream_limit=limit,
                        log=lambda m: print(m, flush=True))
    try:
        results = run_suite(suite, runs, log=lambda m: print(m, flush=True), after=after)
    except (ValueError, FileNotFoundError, DatasetMissingError) as e:
        print(f"subnetdp compare: {e}", file=sys.stderr)
        return 1
    except WorkerFailedError as e:  # one line; the tracebacks are in the cell's logs/
        print(f"subnetdp compare: {e.summary}", file=sys.stderr)
        return 1
    command = "subnetdp " + " ".join(getattr(args, "argv", None) or ["compare", "--suite",
                                                                      args.suite])
    if args.suite == "convergence":
        from subnetdp.study.convergence_report import write_convergence

        written = write_convergence(suite, results, runs, out, command=command,
                                    plots=args.plots)
    else:
        written = write_results(suite, results, out, command=command, plots=args.plots)
    print(f"done in {(time.perf_counter() - t0) / 60:.1f} min; wrote:", flush=True)
    for path in written:
        print(f"  {path}")
    return 0
