"""The injector's kinds of fault beyond kill/raise/hang ([Note: kinds of fault] in
distributed/faults.py): each one does what it says in a process of its own, and (``long``, in
``make test-faults``) a real 4-worker run detects it, names it in one line and goes on from
the survivors' copies or the newest checkpoint."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from subnetdp.checkpoint.files import read_manifest, step_dir
from subnetdp.distributed import faults
from subnetdp.distributed.stragglers import stragglers
from tests.faults.harness import REPO, long_faults, run_cli


def _python(code: str, **kw: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "RANK": "0"}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kw)  # type: ignore[call-overload]


def test_segv_is_the_kernels_segmentation_fault() -> None:
    p = _python("""
        import os
        from subnetdp.distributed import faults
        os.environ[faults.ENV] = "0:1:forward:segv"
        faults.at_step(1)
        faults.point("forward")
        print("survived")
    """)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGSEGV and "survived" not in out


def test_gil_holds_the_interpreter_until_sigkill() -> None:
    """No Python runs while the rank is stuck: another thread stops ticking, and SIGTERM's
    Python handler never runs; only SIGKILL ends it."""
    p = _python("""
        import os, signal, sys, threading, time
        from subnetdp.distributed import faults
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
        def tick():
            while True:
                print("tick", flush=True)
                time.sleep(0.05)
        threading.Thread(target=tick, daemon=True).start()
        time.sleep(0.3)
        print("stuck", flush=True)
        os.environ[faults.ENV] = "0:1:backward:gil"
        faults.at_step(1)
        faults.point("backward")
    """)
    assert p.stdout is not None
    while p.stdout.readline().strip() != "stuck":
        pass
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert p.poll() is None  # the handler would have exited with 7
    p.send_signal(signal.SIGKILL)
    rest, _ = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL
    assert rest.count("tick") < 5  # free, the thread would tick 20 times a second


def test_abort_aborts_and_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """In process: the fault aborts the groups and returns; a failure once the group is gone
    (here: said gone) is named as the abort."""
    from subnetdp import torch_compat
    from subnetdp.distributed import timeouts

    aborted: list[bool] = []
    monkeypatch.setattr(torch_compat, "abort_process_group", lambda: aborted.append(True))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(faults.ENV, "0:1:reduce:abort")
    faults.at_step(1)
    faults.point("reduce")
    assert aborted == [True]
    grouped = iter([True, False])
    monkeypatch.setattr(timeouts.dist, "is_initialized", lambda: next(grouped))
    with pytest.raises(timeouts.GroupAbortedError, match=r"^rank 3's process group was aborted"), \
            timeouts.naming_silent_ranks(3, 4):
        raise ValueError("Default process group has not been initialized")


@long_faults
def test_abort_leaves_the_rank_without_its_group_and_names_it() -> None:
    p = _python("""
        import os, tempfile
        import torch, torch.distributed as dist
        from subnetdp.distributed import faults, timeouts
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        os.environ[faults.ENV] = "0:1:reduce:abort"
        faults.at_step(1)
        try:
            with timeouts.naming_silent_ranks(0, 4):
                faults.point("reduce")  # the rank goes on ...
                dist.all_reduce(torch.ones(1))  # ... and its next collective fails
        except timeouts.GroupAbortedError as e:
            print(e)
    """)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert out.strip() == ("rank 0's process group was aborted under it, so its collectives "
                           "cannot run")


def test_a_straggler_is_a_rank_well_above_the_median() -> None:
    assert stragglers([0.1, 0.1, 1.2, 0.1]) == [2]
    assert stragglers([0.1, 0.12, 0.4, 0.1]) == []  # 4x, but 0.3 s: a shared machine's noise
    assert stragglers([1.0, 1.0, 2.5, 1.0]) == []  # 2.5x: not slow enough
    assert stragglers([0.02, 1.1, 0.02, 1.2, 0.02]) == [1, 3]


# -- end to end: 4 workers, every unit held twice, a loss rescued ---------------------------
TINY = ["--recipe", "llama-tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1",
        "--memory-step", "-1", "--no-progress", "--warmup", "2", "--model-arg", "n_layers=2",
        "--model-arg", "dim=32", "--model-arg", "ffn_hidden=64", "--coverage", "0.75",
        "--min-holders", "2", "--steps", "6", "--log-every", "1", "--strategy", "b-sdp",
        "--nproc", "4", "--min-nproc", "2", "--ckpt-every", "2", "--collective-timeout", "5"]
# the one line that names what happened, and the step the survivors rescued
NAMED = {
    "2:4:backward:segv": r"rank 2: killed by SIGSEGV: a native crash inside the worker",
    "1:4:forward:abort": r"rank 1's process group was aborted under it, so its collectives "
                         r"cannot run",
    "2:4:backward:gil": r"rank\(s\) \[2\] stopped answering: rank \d waited 5 s in a "
                        r"collective \(--collective-timeout\)",
    # the slow rank came back after its peers gave up: it names itself
    "3:4:backward:slow=9": r"rank\(s\) \[3\] stopped answering: rank(\(s\) \[[\d, ]+\]| \d) "
                           r"waited 5 s",
    "1:4:forward:node": r"rank [23]: killed by SIGKILL",
}
LOST = {"2:4:backward:segv": [2], "1:4:forward:abort": [1], "2:4:backward:gil": [2],
        "3:4:backward:slow=9": [3], "1:4:forward:node": [2, 3]}


@long_faults
@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("spec", list(NAMED))
def test_each_kind_is_named_in_one_line_and_rescued(
        tmp_path: Path, spec: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.ENV, spec)
    if spec.endswith(":node"):  # 2 emulated nodes of 2 ranks ([Note: kinds of fault])
        monkeypatch.setenv(faults.NODES_ENV, "2")
    run = tmp_path / "run"
    code, err = run_cli(["train", *TINY, "--out", str(run)], capsys)
    assert code == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("subnetdp train: ")]
    assert len(lines) == 1, err
    assert re.match(f"subnetdp train: {NAMED[spec]}", lines[0]), lines[0]
    assert f"rank(s) {LOST[spec]} of 4 lost; rescued step 3 " in lines[0], lines[0]
    assert read_manifest(step_dir(run / "checkpoints", 6))["world"] == 4 - len(LOST[spec])


@long_faults
@pytest.mark.dist
@pytest.mark.timeout(600)
def test_a_node_of_the_launchers_emulated_nodes(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``train --nnodes 2`` tells each worker its node (GROUP_RANK): node 1's ranks die
    together, and the holders the plan spread over both nodes rescue the step."""
    monkeypatch.setenv(faults.ENV, "1:4:forward:node")
    monkeypatch.delenv(faults.NODES_ENV, raising=False)
    run = tmp_path / "run"
    code, err = run_cli(["train", *TINY, "--nnodes", "2", "--out", str(run)], capsys)
    assert code == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("subnetdp train: ")]
    assert len(lines) == 1 and "rank(s) [2, 3] of 4 lost; rescued step 3 " in lines[0], err
    assert read_manifest(step_dir(run / "checkpoints", 6))["world"] == 2


@long_faults
@pytest.mark.dist
@pytest.mark.timeout(600)
def test_a_straggler_is_named_and_not_stopped(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """1.5 s more a step from step 4 on, under a 5 s timeout: rank 0 names the slow rank
    once, and the run ends as it would have, with all 4 workers."""
    monkeypatch.setenv(faults.ENV, "1:4:backward:slow=1.5")
    run = tmp_path / "run"
    code, err = run_cli(["train", *TINY, "--out", str(run)], capsys)
    assert code == 0 and "subnetdp train: " not in err, err
    said = [ln for p in (run / "logs").rglob("stdout.log") for ln in p.read_text().splitlines()
            if "straggler" in ln]
    assert len(said) == 1, said
    assert re.search(r"straggler: rank 1 took 1\.\d\d s a step to compute \(step 4\), "
                     r"[\d.]+x the median rank", said[0]), said
    assert read_manifest(step_dir(run / "checkpoints", 6))["world"] == 4


def test_the_fallback_counts_named_aborted_and_killed_ranks_as_lost() -> None:
    """The checkpoint fallback (no rescue: --zero, --fsdp, single holders) shrinks by every
    rank lost: a node's ranks, the rank a timeout named, the rank whose group was aborted; a
    rank's own Python exception is not retried on fewer workers."""
    from subnetdp.train.elastic import _lost, _own_error

    timeout = ("Traceback ...\nsubnetdp.distributed.timeouts.CollectiveTimeoutError: rank(s) "
               "[2] stopped answering: rank 0 waited 3 s in a collective")
    aborted = ("Traceback ...\nsubnetdp.distributed.timeouts.GroupAbortedError: rank 1's "
               "process group was aborted under it, so its collectives cannot run")
    peer = "Traceback ...\nRuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1"
    assert _lost({2: (-9, "Signal 9"), 3: (-9, "Signal 9"), 0: (-15, "")}) == 2
    assert _lost({0: (1, timeout), 1: (1, peer)}) == 1
    assert _lost({1: (1, aborted)}) == 1
    assert not any(_own_error(1, t) for t in (timeout, aborted, peer))
    assert _own_error(1, "Traceback ...\nValueError: a bug") and not _own_error(-9, "")


def test_a_loss_before_the_first_checkpoint_says_there_is_nothing_to_fall_back_to(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """--fsdp cannot rescue; a rank killed before the first checkpoint ends the run, and the
    launcher's line says both why (it named only the killed rank)."""
    from subnetdp.distributed.launch import WorkerFailedError
    from subnetdp.train import elastic
    from subnetdp.train.config import TrainConfig

    def lost(*_: object, **__: object) -> None:
        raise WorkerFailedError("...", {3: (-9, "Signal 9")})

    monkeypatch.setattr(elastic, "launch", lost)
    cfg = TrainConfig(nproc=4, min_nproc=2, fsdp=True, ckpt_every=4, out=str(tmp_path))
    with pytest.raises(WorkerFailedError):
        elastic.launch_shrinking(lambda: None, cfg, run_id="r")
    assert capsys.readouterr().err == (
        "subnetdp train: rank 3: killed by SIGKILL from outside the run (kill, a scheduler or "
        "the OOM killer); no rescue: --fsdp shards each holder group's parameters, so a lost "
        "rank's shard exists nowhere else; and no checkpoint yet to fall back to\n")
