"""Randomised rescue campaign ([Note: rescue]): kill a random rank at a random step and phase of
a 4-worker ``--min-holders 2`` run, and check the state the survivors rescued against an
uninterrupted reference run (a checkpoint every step) of the same strategy, bit for bit.

Resumable: each finished kill is a line of ``--state`` (JSONL); a rerun skips the kills done
and rewrites the table (``--table``) from all of them. Run it with ``nice``; minutes per kill on
a shared CPU machine.

    python benchmarks/rescue_campaign.py --kills 50
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = ("b-sdp", "n-sdp", "bb-sdp", "nb-sdp")
PHASES = ("forward", "backward", "reduce", "commit", "optimizer", "checkpoint")
STEPS, CKPT_EVERY, WORLD = 8, 4, 4
TINY = ["--recipe", "llama-tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1",
        "--memory-step", "-1", "--no-progress", "--warmup", "2", "--model-arg", "n_layers=2",
        "--model-arg", "dim=32", "--model-arg", "ffn_hidden=64", "--coverage", "0.75",
        "--min-holders", "2", "--steps", str(STEPS)]
RESCUED = re.compile(r"rescued step (\d+) ")
FALLBACK = re.compile(r"no rescue: (.*); falling back")


def _train(args: list[str], fault: str | None = None) -> tuple[float, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("SUBNETDP_FAULT", None)
    if fault:
        env["SUBNETDP_FAULT"] = fault
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "subnetdp.cli", "train", *args], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"train {args} failed: {done.stderr[-2000:]}")
    return time.perf_counter() - t0, done.stderr


def _tensors(ckpt: Path) -> dict[tuple[str, str], bytes]:
    out = {}
    for f in sorted(ckpt.glob("rank*.safetensors")):
        h = safe_open(str(f), framework="pt")
        for k in h.keys():  # noqa: SIM118
            if not k.startswith("rng/"):
                out[(f.name, k)] = h.get_tensor(k).contiguous().view(-1).view(
                    torch.uint8).numpy().tobytes()
    return out


def _reference(work: Path, strategy: str, extra: tuple[str, ...] = ()) -> tuple[Path, float]:
    """The uninterrupted run of ``strategy`` (plus ``extra`` options), a checkpoint per step."""
    ref = work / f"reference-{strategy}"
    stamp = ref / "wall.txt"
    if not stamp.exists():
        wall, _ = _train([*TINY, "--strategy", strategy, "--nproc", str(WORLD), "--ckpt-every",
                          "1", "--ckpt-keep", str(STEPS), *extra, "--out", str(ref),
                          "--overwrite"])
        stamp.write_text(f"{wall}\n")
    return ref, float(stamp.read_text())


def _kill(work: Path, i: int, strategy: str, rank: int, step: int, phase: str) -> dict:
    ref, ref_wall = _reference(work, strategy)
    out = work / f"kill-{i:03d}"
    wall, err = _train([*TINY, "--strategy", strategy, "--nproc", str(WORLD), "--min-nproc",
                        str(WORLD - 1), "--ckpt-every", str(CKPT_EVERY), "--out", str(out),
                        "--overwrite"], fault=f"{rank}:{step}:{phase}:kill")
    row = {"kill": i, "strategy": strategy, "rank": rank, "step": step, "phase": phase,
           "wall_s": round(wall, 1), "reference_wall_s": round(ref_wall, 1)}
    m, f = RESCUED.search(err), FALLBACK.search(err)
    if m:
        cut = int(m[1])
        ckpt = f"step_{cut:08d}"
        same = _tensors(out / "checkpoints" / ckpt) == _tensors(ref / "checkpoints" / ckpt)
        row.update(rescued_step=cut, steps_lost=max(0, step - 1 - cut), fallback=None,
                   mixed_state=not same)
    else:
        row.update(rescued_step=None, fallback=f[1] if f else "no failure seen",
                   steps_lost=None, mixed_state=None)
    return row


def _table(rows: list[dict]) -> str:
    lines = ["# Rescue campaign (benchmarks/rescue_campaign.py)", "",
             f"{len(rows)} kills (SIGKILL of one rank of 4, `--min-holders 2`, {STEPS} steps, "
             f"checkpoint every {CKPT_EVERY}); each rescued state compared bit for bit with an "
             "uninterrupted run's checkpoint of the same step. Wall times on a shared, loaded "
             "2-core CPU machine (whole run, including both launches).", "",
             "| kill | strategy | rank | step | phase | rescued step | steps lost | fallback | "
             "mixed state | wall s | reference wall s |", "|---" * 11 + "|"]
    for r in rows:
        lines.append(f"| {r['kill']} | {r['strategy']} | {r['rank']} | {r['step']} | "
                     f"{r['phase']} | {r['rescued_step']} | {r['steps_lost']} | "
                     f"{r['fallback'] or '-'} | {r['mixed_state']} | {r['wall_s']} | "
                     f"{r['reference_wall_s']} |")
    rescued = [r for r in rows if r["rescued_step"] is not None]
    lines += ["", f"Rescued {len(rescued)} of {len(rows)}; steps lost in total "
              f"{sum(r['steps_lost'] for r in rescued)}; mixed states "
              f"{sum(bool(r['mixed_state']) for r in rescued)}; fallbacks "
              f"{len(rows) - len(rescued)}.", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="runs/rescue-campaign")
    p.add_argument("--state", default="benchmarks/results/rescue_campaign.jsonl")
    p.add_argument("--table", default="benchmarks/results/rescue.md")
    args = p.parse_args()
    work, state = Path(args.work), Path(args.state)
    work.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(x) for x in state.read_text().splitlines()] if state.exists() else []
    rng = random.Random(args.seed)
    plan = [(rng.choice(STRATEGIES), rng.randrange(WORLD), rng.randrange(2, STEPS),
             rng.choice(PHASES)) for _ in range(args.kills)]
    for i, (strategy, rank, step, phase) in enumerate(plan):
        if i < len(rows):
            continue
        if phase == "checkpoint":  # only steps with a checkpoint reach that phase
            step = CKPT_EVERY
        rows.append(_kill(work, i, strategy, rank, step, phase))
        with state.open("a") as f:
            f.write(json.dumps(rows[-1]) + "\n")
        Path(args.table).write_text(_table(rows))
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
