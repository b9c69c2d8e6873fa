"""A whole emulated node lost ([Note: holders across nodes], [Note: emulated nodes]): 4 workers
on 2 nodes (``--nnodes 2``), every unit's holders on both; node 1's two ranks are SIGKILLed
together, from outside, while step 4 is in flight. The plan said that loss is survived without
rollback, and it is: the 2 survivors compose a checkpoint equal, bit for bit, to an
uninterrupted run's at that step and go on, on one node, until the lost node's ranks, restarted
(``--max-nproc 4``), rejoin on it ([Note: growing a run])."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from subnetdp.checkpoint.files import read_manifest, step_dir
from subnetdp.cli import main
from subnetdp.distributed import faults
from subnetdp.plan import Plan
from subnetdp.plan.nodes import node_ranks, node_report
from tests.faults.harness import long_faults
from tests.faults.test_rescue_oracle import TINY, _tensors

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

NODES = ["--strategy", "b-sdp", "--nproc", "4", "--nnodes", "2", "--log-every", "1", "--steps", "8"]
LOST_NODE = 1


def _worker_pids(logs: Path, ranks: list[int]) -> dict[int, int]:
    """The pids of the workers whose stdout is ``logs/<run>/attempt_0/<rank>/stdout.log``
    (torch elastic redirects each worker's fd 1 there)."""
    found: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            target = os.readlink(proc / "fd" / "1")
        except OSError:
            continue
        p = Path(target)
        if p.name == "stdout.log" and p.parent.name.isdigit() and str(logs) in target \
                and int(p.parent.name) in ranks:
            found[int(p.parent.name)] = int(proc.name)
    return found


def _kill_node_at_step(run: Path, ranks: list[int], step: int, stop: threading.Event) -> None:
    """Once rank 0 logged ``step``, SIGKILL ``ranks`` at once (a node's power cut)."""
    metrics = run / "metrics" / "rank0.jsonl"
    while not stop.wait(0.05):
        done = metrics.exists() and any(json.loads(ln).get("step") == step
                                        for ln in metrics.read_text().splitlines() if ln)
        pids = _worker_pids(run / "logs", ranks) if done else {}
        if len(pids) == len(ranks):
            time.sleep(1.0)  # the healthy ranks reach the commit of the next step
            for pid in pids.values():
                os.kill(pid, signal.SIGKILL)
            return


@long_faults  # make test-faults; in make test: the plan's side (tests/plan/test_nodes.py)
def test_a_lost_node_is_rescued_where_the_plan_says(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    ref, run = tmp_path / "reference", tmp_path / "run"
    assert main(["train", *TINY, *NODES, "--ckpt-every", "1", "--ckpt-keep", "9",
                 "--out", str(ref)]) == 0
    plan = Plan.from_json((ref / "plan.json").read_text())
    said = node_report(plan, 2, min_nproc=2)[LOST_NODE]
    assert said["rollback"] is None and said["lost_units"] == [], said

    lost = node_ranks(4, 2)[LOST_NODE]
    # the node's first rank stops in the commit of step 4, so the loss lands inside that step
    monkeypatch.setenv(faults.ENV, f"{lost[0]}:4:commit:hang")
    stop = threading.Event()
    killer = threading.Thread(target=_kill_node_at_step, args=(run, lost, 3, stop))
    killer.start()
    capsys.readouterr()
    try:
        code = main(["train", *TINY, *NODES, "--min-nproc", "2", "--max-nproc", "4",
                     "--ckpt-every", "2", "--collective-timeout", "60", "--out", str(run)])
    finally:
        stop.set()
        killer.join()
    err = capsys.readouterr().err
    assert code == 0, err
    line = next(ln for ln in err.splitlines() if "lost; rescued step" in ln)
    assert f"rank(s) {lost} of 4 lost" in line and "going on with 2 workers" in line, line
    cut = int(line.split("rescued step ")[1].split()[0])
    assert cut in (3, 4), line  # the survivors' commit of step 4: rolled forward or not
    a, b = _tensors(step_dir(run / "checkpoints", cut)), _tensors(step_dir(ref / "checkpoints",
                                                                            cut))
    assert a.keys() == b.keys()
    for k in a:  # bit for bit, in the same rank files
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k
    # the 2 survivors went on on node 0; the lost node's ranks, restarted, rejoined on node 1
    final = read_manifest(step_dir(run / "checkpoints", 8))
    assert final["world"] == 4 and final["config"]["nnodes"] == 2, final["config"]
    assert any("grew to 4 workers" in p.read_text() for p in (run / "logs").rglob("stdout.log"))
