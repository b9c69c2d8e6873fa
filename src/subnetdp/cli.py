"""``subnetdp``: train | plan | demo | export | eval | bench | compare | plot. Thin: each subcommand
lives in subnetdp.commands."""

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
    if args.command == "train":
        from subnetdp.commands import train_cmd

        return train_cmd.run(args)
    if args.command == "plan":
        from subnetdp.commands import plan_cmd

        return plan_cmd.run(args)
    if args.command == "bench":
        from subnetdp.commands import bench_cmd

        return bench_cmd.run(args)
    if args.command == "compare":
        from subnetdp.commands import compare_cmd

        return compare_cmd.run(args)
    if args.command == "plot":
        from subnetdp.commands import plot_cmd

        return plot_cmd.run(args)
    if args.command in ("export", "eval"):
        from subnetdp.commands import eval_cmd, export_cmd

        return (export_cmd if args.command == "export" else eval_cmd).run(args)
    from subnetdp.commands import demo

    return demo.run(args)


if __name__ == "__main__":
    sys.exit(main())
