"""The one line of a failed launch names the cause (issue 27, root cause 7): a rank stopped by
a signal is reported as such (not as torch's link to its docs), and a slow rank's timeout as
the timeout that names it (not as the peer's lost connection)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from subnetdp.distributed import timeouts
from subnetdp.distributed.launch import WorkerFailedError, launch
from tests.faults.harness import (
    clear_message,
    kill_quietly,
    long_faults,
    start_training,
    wait_for_metrics,
    worker_pids,
)

LINK = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
LOST = ("Traceback (most recent call last):\n  ...\nRuntimeError: [../gloo/transport/tcp/"
        "pair.cc:534] Connection closed by peer [127.0.0.1]:123")


def test_a_worker_stopped_by_sigterm_is_reported_as_such() -> None:
    # the worker's SIGTERM handler exits with 128 + 15 and leaves no error file
    e = WorkerFailedError("...", {1: (143, LINK), 0: (1, LOST)}, first=1)
    assert e.summary.startswith("rank 1 failed (exit code 143): stopped on SIGTERM from "
                                "outside the run")
    assert "pytorch.org" not in e.summary
    killed = WorkerFailedError("...", {1: (-9, "Signal 9 (SIGKILL) received by PID 7")})
    assert killed.summary.startswith("rank 1 failed (exit code -9): killed by SIGKILL")


@pytest.mark.parametrize("code", [-signal.SIGBUS, 128 + signal.SIGBUS])
def test_sigbus_names_the_mapped_file_not_an_outside_kill(code: int) -> None:
    """SIGBUS comes from inside (a memory-mapped file truncated under the run): the line names
    the mapped files and does not advise a plain --resume, which maps the same file again."""
    e = WorkerFailedError("...", {0: (code, LINK), 1: (1, LOST)}, first=0)
    e.mapped = ["/data/cache/train.bin", "/data/cache/val.bin"]
    summary = e.summary
    assert "SIGBUS: a memory-mapped file was truncated or changed under the run (the run "\
        "maps /data/cache/train.bin, /data/cache/val.bin); restore or rebuild it" in summary
    assert "outside the run" not in summary and "resume with --resume" not in summary
    assert len(summary.splitlines()) == 1


def test_the_launcher_knows_the_files_the_workers_map(tmp_path: Path) -> None:
    """What a SIGBUS line names: the LM task's token files (an image task maps none)."""
    from subnetdp.train.config import TrainConfig
    from subnetdp.train.tasks import make_task

    (np.arange(4000) % 300).astype(np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 300, "dtype": "uint16"}))
    cfg = TrainConfig(data_dir=str(tmp_path), out=str(tmp_path / "run")).resolved()
    assert make_task(cfg).mapped_files() == [str(tmp_path / "train.bin")]


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGILL, signal.SIGFPE])
def test_a_native_crash_is_not_blamed_on_the_outside(sig: signal.Signals) -> None:
    e = WorkerFailedError("...", {1: (-sig, f"Signal {int(sig)} ({sig.name}) received by PID 7")})
    assert e.summary.startswith(f"rank 1 failed (exit code {-sig}): killed by {sig.name}: a "
                                "native crash inside the worker"), e.summary
    assert "outside the run (" not in e.summary and "--resume" not in e.summary


def test_a_slow_rank_is_reported_by_the_timeout_that_names_it() -> None:
    timeout = ("Traceback ...\nsubnetdp.distributed.timeouts.CollectiveTimeoutError: rank(s) "
               "[1] stopped answering: rank 0 waited 5 s in a collective")
    glhf = "Traceback ...\nRuntimeError: [c10d] recvValue failed: GLHF! Connection closed"
    # the slow rank came back to a group that had gone and failed first by the clock
    e = WorkerFailedError("...", {0: (1, timeout), 1: (1, glhf)}, first=1)
    assert e.summary.startswith("rank 0 failed (exit code 1): CollectiveTimeoutError: rank(s) "
                                "[1] stopped answering")



def test_the_slow_rank_names_itself_when_it_finds_its_peer_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 comes back to a group whose rank 0 gave up waiting for it (rank 0's timeout mark
    is in the store): its lost connection is reported as its own silence."""
    monkeypatch.setattr(timeouts, "_awaited_marks", lambda rank, world: [0])
    with pytest.raises(timeouts.CollectiveTimeoutError, match=r"^rank\(s\) \[1\] stopped "
                       r"answering: rank\(s\) \[0\] waited"), \
            timeouts.naming_silent_ranks(1, 2):
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1. GLHF!")
    with pytest.raises(RuntimeError, match="bad shard"), timeouts.naming_silent_ranks(1, 2):
        raise RuntimeError("bad shard")  # not a lost peer: as it is


def test_a_waiter_whose_peer_timed_out_leaves_the_naming_to_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: a waiter's lost connection]: rank 0 of 3 loses its connection to rank 1, which
    timed out waiting for rank 2 (stuck holding the GIL, say): rank 0 marks itself as waiting,
    so rank 1's census names rank 2 alone, and raises its own error after that census."""
    marked: list[int] = []
    slept: list[float] = []
    monkeypatch.setattr(timeouts, "_awaited_marks", lambda rank, world: [1])
    monkeypatch.setattr(timeouts, "_mark", marked.append)
    monkeypatch.setattr(timeouts.time, "sleep", slept.append)
    with pytest.raises(RuntimeError, match="Connection closed by peer"), \
            timeouts.naming_silent_ranks(0, 3):
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1. GLHF!")
    assert marked == [0] and slept == [timeouts._MARK_WAIT_S]


def _fill_then_fail(folder: str) -> None:
    """A worker: fill the disk under ``folder``, then fail as a metrics write there does."""
    with open(os.path.join(folder, "fill"), "wb", buffering=0) as f, \
            contextlib.suppress(OSError):
        while True:
            f.write(bytes(1 << 16))
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(folder, "rank0.jsonl"))


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_worker_on_a_full_disk_is_reported_by_its_own_error(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The logs and the run share a disk that the worker fills: its error still reaches the
    line (its error file lies off that disk), and agent.log's failed writes print nothing."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        with pytest.raises(WorkerFailedError) as info:
            launch(_fill_then_fail, (str(disk),), nproc=1, run_id="full-disk",
                   log_dir=str(disk / "logs"), start_method="fork")  # no torch to import
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    assert info.value.summary == (
        f"rank 0 failed (exit code 1): OSError: [Errno 28] No space left on device: "
        f"'{disk / 'rank0.jsonl'}'")
    assert "Logging error" not in capfd.readouterr().err


# -- the same with real workers (long: a launch each) ------------------------------------------
@long_faults
@pytest.mark.timeout(600)
def test_sigterm_of_one_worker_is_named_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    p = start_training(out, "--steps", "100000")
    try:
        wait_for_metrics(out, 1)
        os.kill(worker_pids(out)[1], signal.SIGTERM)
        _, err = p.communicate(timeout=180)
    finally:
        kill_quietly(p)
    message = clear_message(err)
    assert p.returncode == 1 and message is not None, err
    assert "rank 1 failed" in message and "SIGTERM" in message, message
    assert "pytorch.org" not in message


@long_faults
@pytest.mark.timeout(600)
def test_a_token_file_truncated_under_the_run_is_named(tmp_path: Path) -> None:
    """The workers map --data-dir's train.bin; emptied under them, a worker dies of SIGBUS on
    its next batch and the line names the file, not an outside kill."""
    ids = tmp_path / "ids"
    ids.mkdir()
    (np.arange(400000) % 300).astype(np.uint16).tofile(ids / "train.bin")
    (ids / "meta.json").write_text(json.dumps({"vocab_size": 300, "dtype": "uint16"}))
    out = tmp_path / "run"
    p = start_training(out, "--steps", "100000", "--data-dir", str(ids))
    try:
        wait_for_metrics(out, 1)
        os.truncate(ids / "train.bin", 0)
        _, err = p.communicate(timeout=180)
    finally:
        kill_quietly(p)
    message = clear_message(err)
    assert p.returncode == 1 and message is not None, err
    assert "SIGBUS: a memory-mapped file was truncated" in message, message
    assert str(ids / "train.bin") in message and "outside the run" not in message, message


@long_faults
@pytest.mark.timeout(600)
def test_a_disk_filled_under_the_run_is_one_line_naming_the_metrics_file(
        tmp_path: Path) -> None:
    """The run folder on a small tmpfs, filled while the workers write their metrics: one line
    that names the metrics file and the full disk (6 tracebacks, 158 lines before)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    out = disk / "run"
    try:
        p = start_training(out, "--steps", "100000")
        try:
            wait_for_metrics(out, 1)
            with open(disk / "fill", "wb", buffering=0) as f, contextlib.suppress(OSError):
                while True:
                    f.write(bytes(1 << 16))
            _, err = p.communicate(timeout=180)
        finally:
            kill_quietly(p)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    message = clear_message(err)
    assert p.returncode == 1 and message is not None, err
    assert "No space left on device while writing metrics" in message, message
    assert f"{out / 'metrics'}/rank" in message, message


@long_faults
@pytest.mark.timeout(600)
def test_a_slow_rank_is_named_not_the_peer_it_lost(tmp_path: Path) -> None:
    """Rank 1 stops for longer than --collective-timeout, then goes on (a slow rank, not a dead
    one): the line names rank 1's silence, not the connection it finds closed."""
    out = tmp_path / "run"
    p = start_training(out, "--steps", "100000", "--collective-timeout", "5")
    pid = 0
    try:
        wait_for_metrics(out, 1)
        pid = worker_pids(out)[1]
        os.kill(pid, signal.SIGSTOP)
        time.sleep(8)
        os.kill(pid, signal.SIGCONT)
        _, err = p.communicate(timeout=300)
    finally:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        kill_quietly(p)
    message = clear_message(err)
    assert p.returncode == 1 and message is not None, err
    log = out / "logs" / "failure.log"
    assert "[1] stopped answering" in message, (message, log.exists() and log.read_text())
    assert "GLHF" not in message and "closed by peer" not in message.lower(), message
