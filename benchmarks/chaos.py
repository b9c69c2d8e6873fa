"""Chaos campaign: random faults of every kind ([Note: kinds of fault] in
distributed/faults.py), one per run, over the SDP strategies, ``--zero``, ``--fsdp``, the phases
of a step and two emulated nodes of two ranks, each judged against an uninterrupted reference run
of the same strategy (a checkpoint every step), bit for bit, as benchmarks/rescue_campaign.py
does.

Per fault: how it ended (rescued, fell back to the newest checkpoint and why, named and not
stopped, or stopped), the steps lost, whether the rescued checkpoint mixes states (it must equal
the reference's at that step), and the seconds from the last step committed before the fault to
the first committed after it (metrics lines, ``--log-every 1``). Nodes: the built-in launcher
does not yet tell workers their node, so ``SUBNETDP_FAULT_NODES=2`` places ranks 0-1 and 2-3 on
nodes 0 and 1 for the injector only (the plan does not know them).

Resumable: each finished fault is a line of ``--state`` (JSONL); a rerun skips the faults done
and rewrites the tables (``--table``) from all of them. Minutes per fault on a shared CPU
machine; run it with ``nice``.

    python benchmarks/chaos.py --faults 100
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
from collections import Counter
from pathlib import Path

from rescue_campaign import CKPT_EVERY, REPO, STEPS, TINY, WORLD, _reference, _tensors

TIMEOUT_S = 3  # --collective-timeout: a stuck rank is named after it
STRATEGIES = {"b-sdp": [], "n-sdp": [], "bb-sdp": [], "nb-sdp": [],
              "b-sdp --zero 1": ["--zero", "1"], "b-sdp --fsdp": ["--fsdp"]}
# kind -> weight: the ones that wait for the timeout and the stop grace (hang, gil, a straggler
# past the timeout: ~a minute each) less often
KINDS = {"kill": 2, "segv": 2, "raise": 1, "abort": 2, "hang": 1, "gil": 1,
         f"slow={3 * TIMEOUT_S}": 1, "slow=1.5": 1, "node": 2}
PHASES = ("forward", "backward", "reduce", "commit", "optimizer", "checkpoint")
RESCUED = re.compile(r"rescued step (\d+) ")
FELL_BACK = re.compile(r"no rescue: (.*); falling back")
WENT_ON = re.compile(r"going on with \d+ from \S*step_(\d+)")
STRAGGLER = re.compile(r"straggler: rank (\d+) took")
# --nodes: the launcher's two emulated nodes (plans spread each unit's holders over both) and
# --max-nproc 4, so the lost workers restart and rejoin; the kinds that lose a node or a rank
NODE_RUN = ("--nnodes", "2")
NODE_KINDS = {"node": 2, "kill": 1, "segv": 1}
NODE_STRATEGIES = ("b-sdp", "n-sdp", "bb-sdp", "nb-sdp")


def _phases(strategy: str, kind: str) -> list[str]:
    """The phases a run of ``strategy`` reaches (``SUBNETDP_FAULT`` refuses the others) that
    suit ``kind``: a straggler is slow in its compute (the straggler watch times the forward
    and backward); a rank stuck before a checkpoint keeps its peers in the checkpoint's
    collectives, whose timeout is max(30 min, 6x --collective-timeout): not drawn."""
    if kind == "slow=1.5":
        return ["forward", "backward"]
    out = list(PHASES)
    if kind in ("hang", "gil") or kind.startswith("slow"):
        out.remove("checkpoint")
    if "--fsdp" in strategy:
        out.remove("reduce")
    if "--zero" in strategy or "--fsdp" in strategy:
        out.remove("commit")  # not rescuable: no commit
    return out


def _draw(rng: random.Random) -> dict:
    strategy = rng.choice(list(STRATEGIES))
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    phase = rng.choice(_phases(strategy, kind))
    step = CKPT_EVERY if phase == "checkpoint" else rng.randrange(2, STEPS)
    where = rng.randrange(2) if kind == "node" else rng.randrange(WORLD)
    return {"strategy": strategy, "kind": kind, "phase": phase, "step": step, "where": where}


def _draw_node(rng: random.Random) -> dict:
    """A fault of the ``--nodes`` campaign: no checkpoint phase (its collectives' timeout is
    the long one), a step after the first."""
    kind = rng.choices(list(NODE_KINDS), weights=list(NODE_KINDS.values()))[0]
    return {"strategy": rng.choice(NODE_STRATEGIES), "kind": kind,
            "phase": rng.choice(PHASES[:-1]), "step": rng.randrange(2, STEPS),
            "where": rng.randrange(2) if kind == "node" else rng.randrange(WORLD)}


def _run(out: Path, strategy: str, fault: str, nodes: bool,
         launch: tuple[str, ...] = ()) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1",
           "SUBNETDP_FAULT": fault}
    env.pop("SUBNETDP_FAULT_NODES", None)
    if nodes and not launch:  # the launcher's nodes (--nodes) need no override
        env["SUBNETDP_FAULT_NODES"] = "2"
    name = strategy.split()[0]
    args = [*TINY, "--strategy", name, *STRATEGIES[strategy], "--nproc", str(WORLD), *launch,
            "--min-nproc", "2", "--ckpt-every", str(CKPT_EVERY), "--log-every", "1",
            "--collective-timeout", str(TIMEOUT_S), "--out", str(out), "--overwrite"]
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "subnetdp.cli", "train", *args], env=env,
                          capture_output=True, text=True, check=False)
    return done.returncode, done.stderr, time.perf_counter() - t0


def _gap_s(out: Path, cut: int) -> float | None:
    """Seconds from the last step committed before the fault to the first after it."""
    times: dict[int, list[float]] = {}
    for f in (out / "metrics").glob("rank*.jsonl"):
        for line in f.read_text().splitlines():
            m = json.loads(line)
            times.setdefault(int(m["step"]), []).append(float(m["time"]))
    before = [t for s, ts in times.items() if s <= cut for t in ts]
    after = times.get(cut + 1)
    if not before or not after:
        return None
    return round(min(after) - max(before), 1)


def _state(ckpt: Path) -> dict[str, bytes] | None:
    """A checkpoint's tensors by name, whichever rank's file holds them (the lost rank's file a
    composed piece lands in is layout, not state); None when two files disagree on one."""
    state: dict[str, bytes] = {}
    for (_, key), value in _tensors(ckpt).items():
        if state.setdefault(key, value) != value:
            return None
    return state


def _mixed(out: Path, ref: Path, ckpt: str) -> bool:
    """Whether the rescued checkpoint differs from the reference's at the same step."""
    mine = _state(out / "checkpoints" / ckpt)
    return mine is None or mine != _state(ref / "checkpoints" / ckpt)


def _recheck(work: Path, rows: list[dict]) -> None:
    """``--recheck``: judge the rescued rows again from their run folders (kept in ``work``)."""
    for r in rows:
        if r["outcome"] == "rescued":
            ckpt = f"step_{r['rescued_step']:08d}"
            ref = work / f"reference-{r['strategy'].split()[0]}"
            r["mixed_state"] = _mixed(work / f"fault-{r['fault']:03d}", ref, ckpt)


def _rejoined(out: Path) -> bool:
    """Whether the lost workers came back: the run ended on all its workers."""
    last = out / "checkpoints" / f"step_{STEPS:08d}" / "manifest.json"
    return last.exists() and json.loads(last.read_text())["world"] == WORLD


def _fault(work: Path, i: int, d: dict, nodes: bool = False) -> dict:
    name = d["strategy"].split()[0]
    ref, _ = _reference(work, name, NODE_RUN if nodes else ())
    out = work / f"fault-{i:03d}"
    spec = f"{d['where']}:{d['step']}:{d['phase']}:{d['kind']}"
    launch = (*NODE_RUN, "--max-nproc", str(WORLD)) if nodes else ()
    code, err, wall = _run(out, d["strategy"], spec, d["kind"] == "node", launch)
    row = {"fault": i, **d, "spec": spec, "exit": code, "wall_s": round(wall, 1),
           "rescued_step": None, "fallback": None, "steps_lost": None, "mixed_state": None,
           "gap_s": None, "line": next((ln for ln in err.splitlines()
                                        if ln.startswith("subnetdp train: ")), "")[:300]}
    m, f, w = RESCUED.search(err), FELL_BACK.search(err), WENT_ON.search(err)
    if m:
        cut = int(m[1])
        ckpt = f"step_{cut:08d}"
        row.update(outcome="rescued", rescued_step=cut, steps_lost=max(0, d["step"] - 1 - cut),
                   mixed_state=_mixed(out, ref, ckpt), gap_s=_gap_s(out, cut))
        if nodes:
            row["rejoined"] = _rejoined(out)
    elif w:
        start = int(w[1])
        why = f[1] if f else "the run does not rescue (--zero/--fsdp or single holders)"
        row.update(outcome="fell back", fallback=why, steps_lost=max(0, d["step"] - 1 - start),
                   gap_s=_gap_s(out, start))
    elif code == 0:
        said = [ln for p in (out / "logs").rglob("stdout.log")
                for ln in p.read_text().splitlines() if STRAGGLER.search(ln)]
        row.update(outcome="named, not stopped" if said else "no failure seen",
                   line=said[0].split("] ", 1)[-1][:300] if said else row["line"])
    else:
        row.update(outcome="stopped", fallback=row["line"])
    return row


def _tables(rows: list[dict]) -> str:
    kinds = Counter(r["kind"] for r in rows)
    outcomes = Counter(r["outcome"] for r in rows)
    rescued = [r for r in rows if r["outcome"] == "rescued"]
    gaps = sorted(r["gap_s"] for r in rows if r["gap_s"] is not None)
    lines = [
        "# Chaos campaign (benchmarks/chaos.py)", "",
        f"{len(rows)} faults, one per run: 4 workers of llama-tiny (2 layers, dim 32), "
        f"`--coverage 0.75 --min-holders 2 --min-nproc 2`, {STEPS} steps, a checkpoint every "
        f"{CKPT_EVERY}, `--collective-timeout {TIMEOUT_S}`; kind, strategy, phase, step and "
        "rank (or node) drawn at random. Nodes: two emulated nodes of two ranks, for the "
        "injector only (`SUBNETDP_FAULT_NODES=2`: the built-in launcher does not yet tell "
        "workers their node, so the plan does not spread holders over them). Each rescued "
        "checkpoint is compared, tensor for tensor by name, with an uninterrupted run's of "
        "the same step (a name two files disagree on counts as mixed; which rank's file holds "
        "a piece is layout: `--recheck` judged all rows this way, after fault 81, nb-sdp "
        "losing node 0, was flagged by a file-by-file comparison: 14 pieces in the other lost "
        "rank's file, every tensor equal). Gap: seconds from the last step committed before "
        "the fault to the first after it (detection, the stop, composing, the new group's "
        "start and one step), on a shared, loaded 2-core CPU machine. 'stopped': a run that "
        "cannot rescue (`--zero`, `--fsdp`) lost a rank before its first checkpoint (step 4); "
        "from fault 27 on the launcher's line says so (before, the table shows the failure's "
        "summary line). 'no failure seen': a straggler that the watch does not time (under "
        "`--fsdp`, or slowed before a backward-masking refresh, which its peers wait in).", "",
        "Kinds: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) + ". Outcomes: "
        + ", ".join(f"{k} {n}" for k, n in sorted(outcomes.items())) + ".", "",
        f"Rescued {len(rescued)}: steps lost {sum(r['steps_lost'] for r in rescued)}, mixed "
        f"states {sum(bool(r['mixed_state']) for r in rescued)}. Median gap "
        f"{gaps[len(gaps) // 2] if gaps else '-'} s.", ""]
    return "\n".join([*lines, *_fault_rows(rows, rejoined=False), ""])


def _fault_rows(rows: list[dict], *, rejoined: bool) -> list[str]:
    """The per-fault table (``rejoined``: with the column of the ``--nodes`` campaign)."""
    extra = ["rejoined"] if rejoined else []
    head = ["fault", "kind", "strategy", "phase", "step", "rank/node", "outcome",
            "rescued step", "steps lost", "mixed state", *extra, "gap s", "why / the line"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        where = f"node {r['where']}" if r["kind"] == "node" else f"rank {r['where']}"
        why = (r["fallback"] or r["line"] or "-").replace("|", "/")
        cells = [r["fault"], r["kind"], r["strategy"], r["phase"], r["step"], where,
                 r["outcome"], r["rescued_step"], r["steps_lost"], r["mixed_state"],
                 *([r.get("rejoined")] if rejoined else []), r["gap_s"], why]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def _node_table(rows: list[dict]) -> str:
    """``--nodes``: the launcher's nodes, spread plans and rejoins."""
    rescued = [r for r in rows if r["outcome"] == "rescued"]
    lines = [
        "# Chaos campaign on emulated nodes, with rejoins (benchmarks/chaos.py --nodes)", "",
        f"{len(rows)} faults, one per run, as in chaos.md but launched with `--nnodes 2 "
        f"--max-nproc {WORLD}`: the launcher tells each worker its node (two of two ranks), "
        "the plan spreads each unit's holders over both, and the workers lost are restarted "
        "and rejoin the running group at a step boundary. Kinds node (both ranks of one node), "
        "kill and segv; SDP strategies (`--zero`/`--fsdp` do not rescue). Rescued checkpoints "
        "compared tensor for tensor by name with an uninterrupted `--nnodes 2` run's; "
        "rejoined: the run ended on all 4 workers (its last checkpoint's world).", "",
        f"Rescued {len(rescued)} of {len(rows)}: steps lost "
        f"{sum(r['steps_lost'] for r in rescued)}, mixed states "
        f"{sum(bool(r['mixed_state']) for r in rescued)}, rejoined "
        f"{sum(bool(r.get('rejoined')) for r in rescued)}.", ""]
    return "\n".join([*lines, *_fault_rows(rows, rejoined=True), ""])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=100)
    p.add_argument("--seed", type=int, default=44)
    p.add_argument("--work", default="runs/chaos")
    p.add_argument("--state", default="benchmarks/results/chaos.jsonl")
    p.add_argument("--table", default="benchmarks/results/chaos.md")
    p.add_argument("--recheck", action="store_true",
                   help="judge the finished rescues again from the run folders, then stop")
    p.add_argument("--nodes", action="store_true",
                   help="the launcher's emulated nodes with rejoins (--nnodes 2 --max-nproc 4); "
                        "default --work runs/chaos-nodes, results chaos_nodes.*")
    args = p.parse_args()
    if args.nodes:
        for key, path in (("work", "runs/chaos-nodes"),
                          ("state", "benchmarks/results/chaos_nodes.jsonl"),
                          ("table", "benchmarks/results/chaos_nodes.md")):
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, path)
    work, state = Path(args.work), Path(args.state)
    work.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(x) for x in state.read_text().splitlines()] if state.exists() else []
    if args.recheck:
        _recheck(work, rows)
        state.write_text("".join(json.dumps(r) + "\n" for r in rows))
        Path(args.table).write_text(_tables(rows))
        return
    rng = random.Random(args.seed)
    draws = [(_draw_node if args.nodes else _draw)(rng) for _ in range(args.faults)]
    table = _node_table if args.nodes else _tables
    for i, d in enumerate(draws):
        if i < len(rows):
            continue
        rows.append(_fault(work, i, d, nodes=args.nodes))
        with state.open("a") as f:
            f.write(json.dumps(rows[-1]) + "\n")
        Path(args.table).write_text(table(rows))
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
