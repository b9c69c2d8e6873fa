"""The same failure, recovered by checkpoint-restart (``--no-rescue``) at ``--ckpt-every``
10/50/200 and by rescue ([Note: rescue]), for several kinds of fault (a SIGKILL, a native crash,
a lost node of two ranks: [Note: kinds of fault]): the steps replayed, and the time the failure
cost (the faulted run's wall time minus an uninterrupted run's with the same options). The
model is larger than the campaigns' so that replaying ~36 steps costs time of its own.

    python benchmarks/rescue_vs_restart.py
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from rescue_campaign import TINY, WORLD, _train

STEPS, KILL_STEP = 300, 237
MODEL = ["--model-arg", "n_layers=4", "--model-arg", "dim=128", "--model-arg", "ffn_hidden=256",
         "--seq-len", "64"]
FAULTS = {"SIGKILL of rank 2": f"2:{KILL_STEP}:forward:kill",
          "SIGSEGV of rank 2": f"2:{KILL_STEP}:backward:segv",
          "node 1 (ranks 2, 3)": f"1:{KILL_STEP}:forward:node"}
RECOVERIES = {"rescue (--ckpt-every 200)": ["--ckpt-every", "200"],
              **{f"checkpoint-restart, --ckpt-every {n}": ["--ckpt-every", str(n), "--no-rescue"]
                 for n in (10, 50, 200)}}
# every recovery for the kill; rescue and the 36-step replay for the other kinds
CASES = [(f, r) for f in FAULTS for r in RECOVERIES
         if f.startswith("SIGKILL") or r.endswith("200") or r.startswith("rescue")]
FROM = re.compile(r"rescued step (\d+) |going on with \d+ from \S*step_(\d+)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="runs/rescue-vs-restart")
    p.add_argument("--table", default="benchmarks/results/rescue_vs_restart.md")
    args = p.parse_args()
    work = Path(args.work)
    base = [*_without(TINY, ("--model-arg", "--steps", "--seq-len")), *MODEL, "--steps",
            str(STEPS), "--strategy", "b-sdp", "--nproc", str(WORLD), "--min-nproc", "2",
            "--log-every", "50", "--overwrite"]
    rows, clean = [], {}
    for fault, recovery in CASES:
        extra = RECOVERIES[recovery]
        if recovery not in clean:
            clean[recovery], _ = _train([*base, *extra, "--out", str(work / "clean")])
        if fault.startswith("node"):
            os.environ["SUBNETDP_FAULT_NODES"] = "2"
        faulted, err = _train([*base, *extra, "--out", str(work / "faulted")],
                              fault=FAULTS[fault])
        os.environ.pop("SUBNETDP_FAULT_NODES", None)
        m = FROM.search(err)
        start = int(m[1] or m[2]) if m else None
        lost = None if start is None else max(0, KILL_STEP - 1 - start)
        rows.append(f"| {fault} | {recovery} | {start} | {lost} | "
                    f"{faulted - clean[recovery]:.1f} |")
        print(rows[-1], flush=True)
        _write(Path(args.table), rows)


def _write(table: Path, rows: list[str]) -> None:
    """The table of the rows so far (rewritten after each case)."""
    table.write_text("\n".join([
        "# Rescue vs checkpoint-restart (benchmarks/rescue_vs_restart.py)", "",
        f"b-sdp, 4 workers of llama-tiny at n_layers 4, dim 128, seq-len 64, `--coverage 0.75 "
        f"--min-holders 2 --min-nproc 2`, {STEPS} steps; the fault fires at step {KILL_STEP} "
        "and the run goes on with the workers left. Steps replayed: those computed before the "
        "fault that the run computes again. Time lost: the faulted run's wall time minus an "
        "uninterrupted run's with the same options (the stop, the new group's start, the "
        "replayed steps; a shared, loaded 2-core CPU machine). Node 1: ranks 2 and 3 "
        "(`SUBNETDP_FAULT_NODES=2`: two emulated nodes, for the injector only).", "",
        "| fault | recovery | went on from step | steps replayed | time lost (s) |",
        "|---|---|---|---|---|", *rows, ""]))


def _without(args: list[str], flags: tuple[str, ...]) -> list[str]:
    """``args`` less every ``FLAG VALUE`` pair of ``flags``."""
    out: list[str] = []
    it = iter(args)
    for a in it:
        if a in flags:
            next(it)
        else:
            out.append(a)
    return out


if __name__ == "__main__":
    main()
