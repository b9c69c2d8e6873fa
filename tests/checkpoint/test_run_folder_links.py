"""Issue 27, root cause 4: run-folder files are never written through symbolic links
([Note: no links inside a run folder] in filemode.py).

The decision: a run refuses, in one line and before writing anything, a run folder in which a
name it writes is a link; a link planted later (mid-run) is refused at the name (``O_NOFOLLOW``:
the lock, appends) or replaced by an atomic rename (every other write), never written through.
The property: every file the tiny run writes, planted as a link to a sentinel, is refused and
the sentinel keeps its bytes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from subnetdp.checkpoint.checkpointer import Checkpointer
from subnetdp.checkpoint.files import write_json_durable
from subnetdp.checkpoint.rundir import LOCK, RUN_ENTRIES, hold_run_folder
from subnetdp.filemode import (
    LinkedFileError,
    append_text,
    check_no_links,
    check_same_folder,
    folder_id,
    write_atomic,
)
from tests.checkpoint.conftest import TINY_RUN
from tests.faults.harness import clear_message, run_cli

# names a run writes that the tiny run has not (yet) written
NOT_IN_TINY = [LOCK, "logs/failure.log", "budget_plan.json", ".subnetdp.shared", "tensorboard",
               "rescue"]


def _plant(path: Path, sentinels: Path) -> Path:
    """Replace ``path`` by a link to a new sentinel file; return the sentinel."""
    sentinels.mkdir(exist_ok=True)
    target = sentinels / hashlib.sha256(str(path).encode()).hexdigest()[:16]
    target.write_bytes(b"sentinel " + str(path).encode())
    if path.is_dir():
        import shutil

        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)
    return target


def _unchanged(sentinels: Path) -> bool:
    return all(p.read_bytes().startswith(b"sentinel ") and p.stat().st_nlink == 1
               for p in sentinels.iterdir())


def test_every_file_a_run_writes_planted_as_a_link_is_refused(copy_run: Path,
                                                               tmp_path: Path) -> None:
    written = sorted(p.relative_to(copy_run) for p in copy_run.rglob("*")
                     if p.is_file() and p.relative_to(copy_run).parts[0] in RUN_ENTRIES)
    assert len(written) >= 10  # the run's own files: checkpoints, metrics, logs, config, ...
    for rel in [*written, *map(Path, NOT_IN_TINY)]:
        if rel == Path(LOCK):
            continue  # the lock is opened, not checked: test_a_planted_lock_is_refused
        sentinel = _plant(copy_run / rel, tmp_path / "sentinels")
        with pytest.raises(LinkedFileError, match=f"{copy_run / rel} is a symbolic link"):
            check_no_links(copy_run, RUN_ENTRIES)
        (copy_run / rel).unlink()
        assert sentinel.read_bytes().startswith(b"sentinel ")


def test_a_run_folder_full_of_links_is_refused_in_one_line(
        copy_run: Path, tmp_path: Path, no_launch: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Every file of the run planted at once; a new run with ``--out R --overwrite`` refuses
    before writing or deleting (first at the lock, then, with the lock a plain file, at the
    first other link)."""
    sentinels = tmp_path / "sentinels"
    for p in [p for p in copy_run.rglob("*") if p.is_file()]:
        _plant(p, sentinels)
    for name in NOT_IN_TINY:
        _plant(copy_run / name, sentinels)
    resume = ["train", *TINY_RUN, "--steps", "2", "--out", str(copy_run), "--overwrite"]
    code, err = run_cli(resume, capsys)
    message = clear_message(err)
    assert code == 2 and message is not None and f"{copy_run / LOCK} is a symbolic" in message
    (copy_run / LOCK).unlink()
    code, err = run_cli(resume, capsys)
    message = clear_message(err)
    assert code == 2 and message is not None and "is a symbolic link" in message, err
    assert _unchanged(sentinels)
    assert not (copy_run / LOCK).exists()
    code, err = run_cli(["train", "--resume", str(copy_run), "--steps", "6"], capsys)
    message = clear_message(err)  # a rescue left behind is looked at first (issue 44, 1c)
    assert code == 2 and message is not None and "rescue is a symbolic link" in message
    (copy_run / "rescue").unlink()
    code, err = run_cli(["train", "--resume", str(copy_run), "--steps", "6"], capsys)
    message = clear_message(err)
    assert code == 2 and message is not None and "manifest.json is a symbolic link" in message


def test_a_rescue_folder_planted_as_a_link_receives_nothing(tmp_path: Path) -> None:
    """Issue 44 (1d): ``RUN/rescue`` linked elsewhere, mid-run: a group's start refuses to
    clear it and a survivor refuses to save its state through it; the target stays empty."""
    import torch

    from subnetdp.checkpoint.rescue import clear_rescue, rescue_attempt_dir, write_contribution

    run, elsewhere = tmp_path / "R", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    (run / "rescue").symlink_to(elsewhere)
    with pytest.raises(LinkedFileError, match=f"{run / 'rescue'} is a symbolic link"):
        clear_rescue(run)
    with pytest.raises(LinkedFileError, match=f"{run / 'rescue'} is a symbolic link"):
        write_contribution(rescue_attempt_dir(run), rank=1, world=2, step=3,
                           tensors={"model/w": torch.ones(2)}, owned=["w"], manifest={})
    (run / "rescue").unlink()
    (run / "rescue").mkdir()
    (run / "rescue" / "attempt_0").symlink_to(elsewhere)  # one level down
    with pytest.raises(LinkedFileError, match="attempt_0 is a symbolic link"):
        write_contribution(rescue_attempt_dir(run), rank=1, world=2, step=3,
                           tensors={"model/w": torch.ones(2)}, owned=["w"], manifest={})
    assert list(elsewhere.iterdir()) == []


def test_a_linked_rescue_is_never_composed(tmp_path: Path) -> None:
    """Issue 44 (1d): the launcher reads no contributions through ``RUN/rescue`` planted as a
    link (they could be anyone's), and its fallback line names the link, not "no survivor
    saved its state"."""
    import torch

    from subnetdp.checkpoint.rescue import (
        RescueUnavailableError,
        compose_rescue,
        write_contribution,
    )

    run, elsewhere = tmp_path / "R", tmp_path / "elsewhere"
    run.mkdir()
    write_contribution(elsewhere / "attempt_0", rank=0, world=2, step=3,
                       tensors={"model/w": torch.ones(2)}, owned=["w"], manifest={})
    (run / "rescue").symlink_to(elsewhere)
    with pytest.raises(RescueUnavailableError) as e:
        compose_rescue(run)
    assert str(e.value) == f"{run / 'rescue'} is a symbolic link (to {elsewhere})"
    assert not (run / "checkpoints").exists()


# -- each kind of write, planted after the check (mid-run) ------------------------------------
@pytest.fixture
def sentinel(tmp_path: Path) -> Path:
    p = tmp_path / "sentinel"
    p.write_bytes(b"sentinel")
    return p


def test_a_planted_lock_is_refused(tmp_path: Path, sentinel: Path) -> None:
    run = tmp_path / "R"
    run.mkdir()
    (run / LOCK).symlink_to(sentinel)
    with pytest.raises(LinkedFileError, match="is a symbolic link"), hold_run_folder(run):
        pass
    assert sentinel.read_bytes() == b"sentinel"


def test_appends_refuse_a_link(tmp_path: Path, sentinel: Path) -> None:
    """Metrics lines (``JsonlSink``) and the agent's log append with ``O_NOFOLLOW``."""
    from subnetdp.distributed.launch import _agent_log
    from subnetdp.metrics.sinks import JsonlSink

    (tmp_path / "rank0.jsonl").symlink_to(sentinel)
    with pytest.raises(LinkedFileError):
        JsonlSink(tmp_path / "rank0.jsonl")
    (tmp_path / "agent.log").symlink_to(sentinel)
    with pytest.raises(LinkedFileError), _agent_log(str(tmp_path)):
        pass
    with pytest.raises(LinkedFileError):
        append_text(tmp_path / "agent.log")
    assert sentinel.read_bytes() == b"sentinel"


def test_rewrites_replace_a_link(tmp_path: Path, sentinel: Path) -> None:
    """Manifests, summaries, config, plans, truncated metrics and failure.log: an atomic
    rename over the name, so a link there is replaced and its target keeps its bytes."""
    from subnetdp.metrics.sinks import write_json_atomic
    from subnetdp.train.resume import truncate_metrics

    writers = {
        "manifest.json": lambda p: write_json_durable(p, {"step": 1}),
        "summary.json": lambda p: write_json_atomic(p, {"loss": 1.0}),
        "failure.log": lambda p: write_atomic(p, "rank 0 failed\n"),
        "rank0.jsonl": lambda p: truncate_metrics(p, 0),
    }
    for name, write in writers.items():
        path = tmp_path / name
        path.symlink_to(sentinel)
        write(path)
        assert not path.is_symlink() and path.is_file(), name
    assert sentinel.read_bytes() == b"sentinel"


def test_a_swapped_run_folder_is_never_pruned_or_published(tmp_path: Path) -> None:
    """The run folder replaced mid-run by a link to another run: the checkpointer's identity
    check fails before anything is staged, published or pruned there."""
    run, other = tmp_path / "R", tmp_path / "other"
    (run / "checkpoints").mkdir(parents=True)
    (other / "checkpoints").mkdir(parents=True)
    ckpt = SimpleNamespace(root=run / "checkpoints", folder=folder_id(run))
    Checkpointer._check_folder(ckpt)  # type: ignore[arg-type]
    os.rename(run, tmp_path / "R.moved")
    run.symlink_to(other)
    with pytest.raises(OSError, match="no longer the run folder"):
        Checkpointer._check_folder(ckpt)  # type: ignore[arg-type]
    with pytest.raises(OSError):
        check_same_folder(run, folder_id(tmp_path / "R.moved"))
