"""``subnetdp``: train | plan | demo | export | eval | bench | compare | plot. Thin: each subcommand
lives in subnetdp.commands, whose parser names its ``run`` (``args.func``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


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
        prog="subnetdp", description="Subnetwork Data Parallelism for PyTorch"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (train_cmd, plan_cmd, demo, export_cmd, eval_cmd, bench_cmd, compare_cmd,
                   plot_cmd):
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The raw command line, for commands that must know which options were given explicitly
    # (a resumed run refuses any it cannot honour, even one equal to its default).
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
