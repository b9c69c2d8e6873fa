"""The same failure, recovered by checkpoint-restart (``--no-rescue``) at ``--ckpt-every``
10/50/200 and by rescue ([Note: rescue]), for several kinds of fault (a SIGKILL, a native crash,
a lost node of two ranks: [Note: kinds of fault]): the steps replayed, and the seconds the
failure cost, read from the run's own timeline. The model is larger than the campaigns' so that
replaying ~36 steps costs time of its own.

Seconds lost: from the moment step K-1 was first committed (K: the faulted step) to the moment
step K+1 was first committed after the fault, less the two steps' own time (the median step of
the run). Each step's first commit is read from rank 0's metrics file while the run goes (a
restart rewrites the replayed steps' lines). Not the difference of two runs' wall times: the
run goes on with fewer workers, which on a shared, oversubscribed CPU machine step faster.

    python benchmarks/rescue_vs_restart.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rescue_campaign import REPO, TINY, WORLD

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


def _watched(args: list[str], fault: str, out: Path, nodes: bool) -> tuple[str, dict[int, float]]:
    """Run ``train ARGS`` with ``fault``; its stderr and the time each step was first
    committed (rank 0's metrics, read while it runs)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1",
           "SUBNETDP_FAULT": fault}
    env.pop("SUBNETDP_FAULT_NODES", None)
    if nodes:
        env["SUBNETDP_FAULT_NODES"] = "2"
    metrics = out / "metrics" / "rank0.jsonl"
    first: dict[int, float] = {}
    with open(out.parent / f"{out.name}.err", "w+") as err:
        p = subprocess.Popen([sys.executable, "-m", "subnetdp.cli", "train", *args], env=env,
                             stdout=subprocess.DEVNULL, stderr=err)
        while p.poll() is None:
            time.sleep(0.2)
            _read(metrics, first)
        _read(metrics, first)
        err.seek(0)
        text = err.read()
    if p.returncode != 0:
        raise RuntimeError(f"train {args} failed: {text[-2000:]}")
    return text, first


def _read(metrics: Path, first: dict[int, float]) -> None:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        try:
            m = json.loads(line)
        except ValueError:  # a line being written
            continue
        first.setdefault(int(m["step"]), float(m["time"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="runs/rescue-vs-restart")
    p.add_argument("--table", default="benchmarks/results/rescue_vs_restart.md")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    base = [*_without(TINY, ("--model-arg", "--steps", "--seq-len")), *MODEL, "--steps",
            str(STEPS), "--strategy", "b-sdp", "--nproc", str(WORLD), "--min-nproc", "2",
            "--log-every", "1", "--overwrite"]
    rows = []
    for i, (fault, recovery) in enumerate(CASES):
        out = work / f"case-{i}"
        shutil.rmtree(out, ignore_errors=True)  # no earlier run's lines to read
        err, first = _watched([*base, *RECOVERIES[recovery], "--out", str(out)],
                              FAULTS[fault], out, fault.startswith("node"))
        m = FROM.search(err)
        start = int(m[1] or m[2]) if m else None
        replayed = None if start is None else max(0, KILL_STEP - 1 - start)
        steps = sorted(first)
        step_s = statistics.median(first[b] - first[a] for a, b in itertools.pairwise(steps)
                                   if b == a + 1 and a not in (KILL_STEP - 1, KILL_STEP))
        lost = first[KILL_STEP + 1] - first[KILL_STEP - 1] - 2 * step_s
        rows.append(f"| {fault} | {recovery} | {start} | {replayed} | {lost:.1f} | "
                    f"{step_s:.3f} |")
        print(rows[-1], flush=True)
        _write(Path(args.table), rows)


def _write(table: Path, rows: list[str]) -> None:
    """The table of the rows so far (rewritten after each case)."""
    table.write_text("\n".join([
        "# Rescue vs checkpoint-restart (benchmarks/rescue_vs_restart.py)", "",
        f"b-sdp, 4 workers of llama-tiny at n_layers 4, dim 128, seq-len 64, `--coverage 0.75 "
        f"--min-holders 2 --min-nproc 2`, {STEPS} steps; the fault fires at step {KILL_STEP} "
        "and the run goes on with the workers left. Steps replayed: those committed before the "
        "fault that the run computes again. Seconds lost: from step "
        f"{KILL_STEP - 1}'s first commit to step {KILL_STEP + 1}'s first commit after the "
        "fault, less two median steps (the detection, the stop, composing or reading the "
        "checkpoint, the new group's start, the replayed steps), on a shared, loaded 2-core "
        "CPU machine. Node 1: ranks 2 and 3 (`SUBNETDP_FAULT_NODES=2`: two emulated nodes, for "
        "the injector only).", "",
        "| fault | recovery | went on from step | steps replayed | seconds lost | "
        "median step (s) |", "|---|---|---|---|---|---|", *rows, ""]))


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
