"""``subnetdp``: train | plan | demo. Thin: each subcommand lives in subnetdp.commands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from subnetdp.commands import demo, plan_cmd, train_cmd

    parser = argparse.ArgumentParser(
        prog="subnetdp", description="Subnetwork Data Parallelism for PyTorch"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (train_cmd, plan_cmd, demo):
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "train":
        from subnetdp.commands import train_cmd

        return train_cmd.run(args)
    if args.command == "plan":
        from subnetdp.commands import plan_cmd

        return plan_cmd.run(args)
    from subnetdp.commands import demo

    return demo.run(args)


if __name__ == "__main__":
    sys.exit(main())
