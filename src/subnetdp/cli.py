"""``subnetdp``: train | plan | demo | export | eval | bench | compare | plot. Thin: each subcommand
lives in subnetdp.commands, whose parser names its ``run`` (``args.func``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

EPILOG = """\
a first run:
  subnetdp demo                                   ddp vs b-sdp on llama-tiny, 4 CPU workers
  subnetdp train --recipe llama-tiny --nproc 4 --strategy b-sdp --coverage 0.5
  subnetdp plan budget --recipe llama-1b --nproc 8 --memory-gb 40 --strategies b-sdp,ddp

the same word means the same thing in every command: --nproc (workers), --out (what the
command writes: a run folder, a file), --runs (a folder of runs), --plan-file (a plan read),
--device auto|cpu|cuda. `subnetdp COMMAND --help` lists a command's options in groups."""


def version() -> str:
    """The installed package's version (its metadata), else the source tree's."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("subnetdp")
    except PackageNotFoundError:
        from subnetdp import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    from subnetdp.commands import (
        bench_cmd,
        compare_cmd,
        demo,
        eval_cmd,
        export_cmd,
        plan_cmd,
        plot_cmd,
        train_cmd,
    )

    parser = argparse.ArgumentParser(
        prog="subnetdp", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Subnetwork Data Parallelism for PyTorch: each worker trains a subnetwork "
                    "(a plan says which\nunits it holds) and every unit is averaged over its "
                    "holders only.",
        epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (train_cmd, plan_cmd, demo, export_cmd, eval_cmd, bench_cmd, compare_cmd,
                   plot_cmd):
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The raw command line, for commands that must know which options were given explicitly
    # (a resumed run refuses any it cannot honour, even one equal to its default).
    args.argv = list(sys.argv[1:] if argv is None else argv)
    from subnetdp.commands.boundary import run_command

    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
