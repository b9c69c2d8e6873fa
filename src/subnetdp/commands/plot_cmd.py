"""``subnetdp plot RUN [RUN...]``: loss and memory curves of finished runs in one PNG."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from subnetdp.commands.options import HelpFormatter


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("plot", help="loss and memory curves of runs (PNG)",
                              description=__doc__, formatter_class=HelpFormatter)
    p.set_defaults(func=run)
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (subnetdp train --out)")
    p.add_argument("--out", default=None, metavar="PNG",
                   help="the figure (default: RUN/curves.png of the first run)")


def run(args: argparse.Namespace) -> int:
    from subnetdp.checkpoint.rundir import check_output
    from subnetdp.metrics.curves import plot_runs

    runs = [Path(r) for r in args.runs]
    out = Path(args.out) if args.out else runs[0] / "curves.png"
    try:
        check_output(out, beside=tuple(runs))  # a new file beside a run's own, at most
        plot_runs(runs, out)
    except ImportError:
        print("subnetdp plot: needs matplotlib: `pip install 'subnetdp[plot]'`", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"subnetdp plot: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
