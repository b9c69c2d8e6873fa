"""The step-level fault injector (``SUBNETDP_FAULT``, distributed/faults.py), in process: its
parsing, and that each hook point of a step fires where it says."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from subnetdp.distributed import faults
from subnetdp.runtime.reducer import HolderReducer
from subnetdp.train.trainer import train_step
from tests.faults.harness import clear_message, run_cli


@pytest.fixture(autouse=True)
def _step_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    faults.at_step(1)


def test_parse() -> None:
    assert faults.parse("") is None and faults.parse("  ") is None
    assert faults.parse("2:7:reduce:kill") == faults.Fault(2, 7, "reduce", "kill")
    assert faults.parse("1:3:backward:slow") == faults.Fault(1, 3, "backward", "slow",
                                                             faults.SLOW_S)
    assert faults.parse("1:3:backward:slow=2.5").seconds == 2.5  # type: ignore[union-attr]
    assert faults.parse("1:3:forward:node") == faults.Fault(1, 3, "forward", "node")
    for bad in ("2:7:reduce", "x:7:reduce:kill", "2:0:reduce:kill", "2:7:update:kill",
                "2:7:reduce:explode", "-1:7:forward:raise", "1:3:forward:slow=x",
                "1:3:forward:slow=0", "1:3:forward:slow=inf", "1:3:forward:kill=2"):
        with pytest.raises(ValueError, match="is not RANK:STEP:PHASE:KIND"):
            faults.parse(bad)


def test_a_straggler_fires_from_its_step_on_and_a_node_on_all_its_ranks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slow = faults.Fault(1, 3, "backward", "slow", 1.0)
    assert [slow.fires("backward", s, 1, 0) for s in (2, 3, 4)] == [False, True, True]
    assert not slow.fires("backward", 4, 0, 0) and not slow.fires("forward", 4, 1, 0)
    node = faults.Fault(1, 3, "forward", "node")
    assert [node.fires("forward", 3, r, r // 2) for r in range(4)] == [False, False, True, True]
    # a rank's node: torchrun's GROUP_RANK; else SUBNETDP_FAULT_NODES's contiguous blocks
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.delenv("GROUP_WORLD_SIZE", raising=False)
    monkeypatch.delenv("GROUP_RANK", raising=False)
    assert faults._node() == 0
    monkeypatch.setenv(faults.NODES_ENV, "2")
    assert faults._node() == 1
    monkeypatch.setenv("GROUP_WORLD_SIZE", "4")
    monkeypatch.setenv("GROUP_RANK", "3")
    assert faults._node() == 3
    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    monkeypatch.setenv(faults.ENV, "2:1:forward:slow=0.25")
    faults.point("forward")
    faults.at_step(2)
    faults.point("forward")
    assert slept == [0.25, 0.25] and faults.reached("forward") is not None


def test_check_env(monkeypatch: pytest.MonkeyPatch) -> None:
    faults.check_env(4)  # unset: nothing to check
    monkeypatch.setenv(faults.ENV, "3:2:forward:raise")
    faults.check_env(4)
    with pytest.raises(ValueError, match="names rank 3, but the run has 2 workers"):
        faults.check_env(2)
    monkeypatch.setenv(faults.ENV, "1:2:forward:node")
    with pytest.raises(ValueError, match=r"names node 1, but the run has 1 node\(s\) \(nodes "
                                         r"0\.\.0; SUBNETDP_FAULT_NODES emulates more\)"):
        faults.check_env(4)
    faults.check_env(4, nodes=2)
    monkeypatch.setenv(faults.NODES_ENV, "2")
    faults.check_env(4)
    monkeypatch.setenv(faults.NODES_ENV, "5")
    with pytest.raises(ValueError, match="must be a number of nodes from 1 to the run's 4"):
        faults.check_env(4)
    monkeypatch.delenv(faults.NODES_ENV)
    monkeypatch.setenv(faults.ENV, "3:2:sideways:raise")
    with pytest.raises(ValueError, match="phases forward, backward"):
        faults.check_env(4)


def test_fires_only_at_its_rank_step_and_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.ENV, "0:3:backward:raise")
    faults.point("backward")  # step 1: no
    faults.at_step(3)
    faults.point("forward")  # another phase: no
    monkeypatch.setenv("RANK", "1")
    faults.point("backward")  # another rank: no
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(faults.InjectedFault, match="rank 0, step 3, backward"):
        faults.point("backward")
    monkeypatch.setenv(faults.ENV, "")  # disarmed, as the launcher leaves it after a failure
    faults.point("backward")


def test_kill_and_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    killed: list[int] = []

    def kill(pid: int, sig: int) -> None:  # a real SIGKILL never returns
        killed.append(sig)
        raise SystemExit(-sig)

    monkeypatch.setattr(faults.os, "kill", kill)
    monkeypatch.setenv(faults.ENV, "0:1:forward:kill")
    with pytest.raises(SystemExit):
        faults.point("forward")
    assert killed == [signal.SIGKILL]

    def woken(_: float) -> None:
        raise TimeoutError("asleep")

    monkeypatch.setattr(faults.time, "sleep", woken)
    monkeypatch.setenv(faults.ENV, "0:1:forward:hang")
    with pytest.raises(TimeoutError):
        faults.point("forward")


class _Spy:
    """A rank model, optimizer and task that record how far a step got."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.w = torch.nn.Parameter(torch.ones(2))

    def model(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append("forward")
        return (self.w * x).sum()

    def step(self) -> None:
        self.calls.append("optimizer")


@pytest.mark.parametrize(("phase", "reached"), [("forward", []), ("backward", ["forward"]),
                                                ("optimizer", ["forward", "commit"])])
def test_train_step_hook_points(monkeypatch: pytest.MonkeyPatch, phase: str,
                                reached: list[str]) -> None:
    spy = _Spy()
    commit = SimpleNamespace(reduced=lambda: spy.calls.append("commit"),
                             applied_step=lambda: None)
    opt = SimpleNamespace(step=spy.step, zero_grad=lambda **_: None)
    task = SimpleNamespace(loss=lambda out, y: out)
    monkeypatch.setenv(faults.ENV, f"0:1:{phase}:raise")
    with pytest.raises(faults.InjectedFault):
        train_step(spy, opt, SimpleNamespace(step=lambda: None), task,  # type: ignore[arg-type]
                   (torch.ones(2), torch.ones(2)), 0.0, commit)  # type: ignore[arg-type]
    assert spy.calls == reached
    if phase != "forward":
        assert (spy.w.grad is not None) == (phase == "optimizer")


def test_reduce_hook_point_ends_the_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reducer's end-of-backward callback fails before it waits for any reduction."""
    monkeypatch.setenv(faults.ENV, "0:1:reduce:raise")
    untouched: Any = object()  # any attribute access would raise AttributeError instead
    with pytest.raises(faults.InjectedFault):
        HolderReducer._finish(untouched)


def test_commit_hook_point_is_inside_the_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that fails entering the commit is ready (its peers may roll forward) and never
    reaches the all-reduce; a disabled commit has no hook point."""
    from subnetdp.train.rescue import StepCommit

    monkeypatch.setenv(faults.ENV, "0:1:commit:raise")
    StepCommit(False, applied=0, device=torch.device("cpu")).reduced()
    commit = StepCommit(True, applied=0, device=torch.device("cpu"))
    with pytest.raises(faults.InjectedFault):
        commit.reduced()  # no process group: the all-reduce would raise another error
    assert commit.ready and commit.applied == 0
    commit.applied_step()
    assert not commit.ready and commit.applied == 1


def test_check_env_refuses_a_fault_that_never_fires(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step outside the run's, or a phase the run never reaches there (issue 44, 1e)."""
    from subnetdp.train.config import TrainConfig
    from subnetdp.train.rescue import unreached_phase

    def check(spec: str, cfg: TrainConfig, first: int = 1) -> None:
        monkeypatch.setenv(faults.ENV, spec)
        faults.check_env(cfg.nproc, first=first, last=cfg.steps,
                         unreached=lambda phase, step: unreached_phase(cfg, phase, step))

    plain = TrainConfig(nproc=4, steps=6, ckpt_every=3)
    rescuable = TrainConfig(nproc=4, steps=6, ckpt_every=3, min_nproc=3, min_holders=2)
    check("1:6:forward:kill", plain)
    check("1:4:commit:kill", rescuable)
    check("1:3:checkpoint:kill", plain)
    check("1:6:checkpoint:kill", plain)  # the final checkpoint
    with pytest.raises(ValueError, match=r"names step 7, but this run trains steps 1\.\.6"):
        check("1:7:forward:kill", plain)
    with pytest.raises(ValueError, match=r"names step 2, but this run trains steps 3\.\.6"):
        check("1:2:forward:kill", plain, first=3)  # resumed after step 2
    with pytest.raises(ValueError, match="phase commit, which this run never reaches at step 4 "
                                         r"\(only a rescuable run commits its steps, and this "
                                         r"one is not: the run is not elastic \(no --min-nproc"):
        check("1:4:commit:kill", plain)
    with pytest.raises(ValueError, match="--zero 2 shards"):
        check("1:4:commit:kill", TrainConfig(nproc=4, steps=6, ckpt_every=3, min_nproc=3,
                                             zero=2))
    with pytest.raises(ValueError, match="no checkpoint is written at step 4: --ckpt-every 3"):
        check("1:4:checkpoint:kill", plain)
    with pytest.raises(ValueError, match="FSDP's own hooks"):
        check("1:4:reduce:kill", TrainConfig(nproc=4, steps=6, fsdp=True))


@pytest.mark.parametrize(("spec", "extra", "message"), [
    ("5:1:forward:kill", [], "SUBNETDP_FAULT names rank 5, but the run has 2 workers "
                             "(ranks 0..1)"),
    ("1:9:forward:kill", [], "SUBNETDP_FAULT names step 9, but this run trains steps 1..2, so "
                             "it would never fire; name a step in that range"),
    ("2:1:forward:node", ["--nnodes", "2"], "SUBNETDP_FAULT names node 2, but the run has 2 "
                                            "node(s) (nodes 0..1; SUBNETDP_FAULT_NODES emulates "
                                            "more)"),
    ("1:2:commit:kill",
     ["--ckpt-every", "1", "--min-nproc", "1", "--no-rescue", "--coverage", "1"],
     "SUBNETDP_FAULT names phase commit, which this run never reaches at step 2 (only a "
     "rescuable run commits its steps, and this one is not: --no-rescue), so it would never "
     "fire; name another phase or step"),
])
def test_a_bad_fault_is_one_line_before_any_worker(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str],
                                                    spec: str, extra: list[str],
                                                    message: str) -> None:
    monkeypatch.setenv(faults.ENV, spec)
    code, err = run_cli(["train", "--recipe", "llama-tiny", "--nproc", "2", "--steps", "2",
                         "--batch-size", "2", "--seq-len", "32", "--no-progress", *extra,
                         "--out", str(tmp_path / "run")], capsys)
    assert code == 2
    assert clear_message(err) == f"subnetdp train: {message}"
    assert not (tmp_path / "run").exists()
