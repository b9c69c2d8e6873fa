"""Run-folder ownership and the re-planning options, without worker processes: the lock
(a live holder refused by name, a dead one's lock taken over), an earlier run's files refused
or replaced with --overwrite, and the option combinations refused before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from subnetdp.checkpoint.files import CheckpointError
from subnetdp.checkpoint.rundir import LOCK, RunFolderBusyError, check_fresh, hold_run_folder
from subnetdp.train.config import TrainConfig
from subnetdp.train.elastic import check_replan_options


def test_the_lock_names_its_live_holder_and_is_released(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with hold_run_folder(out):
        info = json.loads((out / LOCK).read_text())
        assert info["pid"] == os.getpid()
        with pytest.raises(RunFolderBusyError, match=f"in use by another run: pid {os.getpid()} "
                                                     "on host"), hold_run_folder(out):
            pass
    assert not (out / LOCK).exists()
    with hold_run_folder(out):  # free again
        pass


def test_a_dead_holders_lock_is_taken_over(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (out / LOCK).write_text(json.dumps({"pid": dead.pid, "host": "h", "since": 0}))
    with hold_run_folder(out):
        assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()


def test_an_earlier_runs_files_are_refused_or_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "run"
    (out / "metrics").mkdir(parents=True)
    (out / "metrics" / "rank0.jsonl").write_text('{"step": 0}\n')
    (out / "notes.txt").write_text("mine")  # not a run file: never touched
    check_fresh(out, resume=True, overwrite=False)  # a resume continues it
    with pytest.raises(CheckpointError, match=r"earlier run's files \(metrics\); replace them "
                                              "with --overwrite"):
        check_fresh(out, resume=False, overwrite=False)
    (out / "checkpoints" / "step_00000002").mkdir(parents=True)
    (out / "checkpoints" / "step_00000002" / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        check_fresh(out, resume=False, overwrite=False)
    check_fresh(out, resume=False, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize(("change", "message"), [
    ({"reshard": True}, "use it with --resume RUN"),
    ({"min_nproc": 5}, "between 1 and --nproc"),
    ({"min_nproc": 2, "ckpt_every": 0}, "add --ckpt-every N"),
    ({"min_nproc": 2, "plan_file": "p.json"}, "a --plan-file cannot"),
])
def test_replan_options_refused_before_launch(change: dict[str, object], message: str) -> None:
    cfg = TrainConfig(**{"nproc": 4, "ckpt_every": 5, **change})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        check_replan_options(cfg)
