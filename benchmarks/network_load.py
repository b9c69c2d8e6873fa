"""Other jobs' load on the emulated two-tier network: the same step benchmark quiet and beside
busy loops at ``nice 19`` (issue 45: why the first campaign's two-tier rows ran slow).

    python benchmarks/network_load.py [--hogs 8] [--link 1gbit] [--nodes 2]

One ``bench step`` run (``benchmarks/network.py``'s specs, steps and warm-up) of a few options
on one layout, then the same run with ``--hogs`` Python busy loops at ``nice -n 19`` beside it
(the campaign itself runs at ``nice -n -15``, the kernel's ``sched_autogroup`` off). Writes
benchmarks/results/network_load.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import network

from subnetdp.bench.netem import Layout, parse_link

OUT = Path(__file__).resolve().parent / "results"
NAMES = ["ddp", "b-sdp", "fsdp", "b-sdp+fsdp", "n-sdp+fsdp"]


@contextlib.contextmanager
def hogs(n: int) -> Iterator[None]:
    """``n`` busy loops at the lowest priority, for the block's duration."""
    procs = [subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"])
             for _ in range(n)]
    try:
        time.sleep(5 if n else 0)  # they are running before the benchmark starts
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def measure(layout: Layout, n_hogs: int) -> list[dict[str, Any]]:
    with hogs(n_hogs):
        rows = network.measure(layout, NAMES)
    return [{**r, "hogs": n_hogs} for r in rows]


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    quiet = {r["strategy"]: r for r in rows if not r["hogs"]}
    lines = [f"`python benchmarks/network_load.py --hogs {args.hogs} --link {args.link} "
             f"--nodes {args.nodes}` ({rows[0]['run']['date']}): median step and compute-only "
             f"step (s), quiet and beside {args.hogs} busy loops at `nice -n 19`.", "",
             "| strategy | step, quiet | step, loaded | loaded / quiet | compute-only, quiet | "
             "compute-only, loaded |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["hogs"]:
            q = quiet[r["strategy"]]
            lines.append(f"| {r['strategy']} | {q['step_s_median']:.3f} | "
                         f"{r['step_s_median']:.3f} | "
                         f"{r['step_s_median'] / q['step_s_median']:.2f} | "
                         f"{q['compute_s']:.3f} | {r['compute_s']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hogs", type=int, default=8)
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--nodes", type=int, default=2)
    args = ap.parse_args()
    layout = Layout(parse_link(args.link), args.nodes)
    rows = measure(layout, 0) + measure(layout, args.hogs)
    (OUT / "network_load.json").write_text(json.dumps(rows, indent=1) + "\n")
    text = report(rows, args)
    (OUT / "network_load.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
