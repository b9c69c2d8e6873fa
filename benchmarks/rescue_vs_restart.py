"""The same failure, recovered by checkpoint-restart (``--no-rescue``) at ``--ckpt-every``
10/50/200 and by rescue ([Note: rescue]): steps lost, and the time the failure cost (the
faulted run's wall time minus an uninterrupted run's with the same options).

    python benchmarks/rescue_vs_restart.py
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from rescue_campaign import TINY, WORLD, _train

STEPS, KILL = 300, "2:237:forward:kill"
FROM = re.compile(r"rescued step (\d+) |going on with \d+ from \S*step_(\d+)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="runs/rescue-vs-restart")
    p.add_argument("--table", default="benchmarks/results/rescue_vs_restart.md")
    args = p.parse_args()
    work = Path(args.work)
    tiny = list(TINY)
    tiny[tiny.index("--steps") + 1] = str(STEPS)
    base = [*tiny, "--strategy", "b-sdp", "--nproc", str(WORLD), "--min-nproc",
            str(WORLD - 1), "--log-every", "50", "--overwrite"]
    kill_step = int(KILL.split(":")[1])
    rows = []
    for name, extra in [("rescue (--ckpt-every 200)", ["--ckpt-every", "200"]),
                        *[(f"checkpoint-restart, --ckpt-every {n}",
                           ["--ckpt-every", str(n), "--no-rescue"]) for n in (10, 50, 200)]]:
        clean, _ = _train([*base, *extra, "--out", str(work / "clean")])
        faulted, err = _train([*base, *extra, "--out", str(work / "faulted")], fault=KILL)
        m = FROM.search(err)
        start = int(m[1] or m[2]) if m else None
        lost = None if start is None else max(0, kill_step - 1 - start)
        rows.append(f"| {name} | {start} | {lost} | {faulted - clean:.1f} |")
        print(rows[-1], flush=True)
    Path(args.table).write_text("\n".join([
        "# Rescue vs checkpoint-restart (benchmarks/rescue_vs_restart.py)", "",
        f"b-sdp, 4 workers, `--min-holders 2`, {STEPS} steps; rank 2 SIGKILLed entering the "
        f"forward of step {kill_step}; the run goes on with 3 workers. Time lost: the faulted "
        "run's wall time minus an uninterrupted run's with the same options (both launches, "
        "the replayed steps; a shared 2-core CPU machine, tiny model: the launch dominates).", "",
        "| recovery | went on from step | steps lost | time lost (s) |", "|---|---|---|---|",
        *rows, ""]))


if __name__ == "__main__":
    main()
