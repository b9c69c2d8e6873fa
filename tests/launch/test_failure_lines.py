"""The one line of a failed launch names the cause (issue 27, root cause 7): a rank stopped by
a signal is reported as such (not as torch's link to its docs), and a slow rank's timeout as
the timeout that names it (not as the peer's lost connection)."""

from __future__ import annotations

from subnetdp.distributed.launch import WorkerFailedError

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
