"""The one line of a failed launch names the cause (issue 27, root cause 7): a rank stopped by
a signal is reported as such (not as torch's link to its docs), and a slow rank's timeout as
the timeout that names it (not as the peer's lost connection)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from subnetdp.distributed import timeouts
from subnetdp.distributed.launch import WorkerFailedError
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
    monkeypatch.setattr(timeouts, "_marked_ranks", lambda world: [0])
    with pytest.raises(timeouts.CollectiveTimeoutError, match=r"^rank\(s\) \[1\] stopped "
                       r"answering: rank\(s\) \[0\] waited"), \
            timeouts.naming_silent_ranks(1, 2):
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1. GLHF!")
    with pytest.raises(RuntimeError, match="bad shard"), timeouts.naming_silent_ranks(1, 2):
        raise RuntimeError("bad shard")  # not a lost peer: as it is


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
