"""Worker-side stop on SIGTERM/SIGINT, the one-line summary of a failed launch, timeouts."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from subnetdp.distributed.launch import WorkerFailedError
from subnetdp.distributed.signals import GracefulStop, steps_to_checkpoint
from subnetdp.distributed.timeouts import slow_timeout


def test_steps_to_checkpoint() -> None:
    assert steps_to_checkpoint(4, 6, 100) == 2
    assert steps_to_checkpoint(6, 6, 100) == 6
    assert steps_to_checkpoint(98, 6, 100) == 2  # the final checkpoint comes first
    assert steps_to_checkpoint(5, 0, 100) is None  # no checkpoints
    assert steps_to_checkpoint(100, 6, 100) is None


@pytest.fixture
def stop() -> Iterator[GracefulStop]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield GracefulStop(grace_s=10.0)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_no_signal_no_stop(stop: GracefulStop) -> None:
    # long steps, checkpoint due or just written: without a signal, training always goes on
    for done, saved in ((3, False), (6, True), (100, True)):
        assert stop.after_step(done, every=6, total=100, step_s=100.0, saved=saved) is None
    assert stop.signum is None
    # a handler is installed and only notes the signal; the stop comes at the next step
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.signum == signal.SIGTERM
    with pytest.raises(SystemExit):
        stop.after_step(7, every=6, total=100, step_s=100.0, saved=False)


def test_checkpoint_due_within_the_grace_is_awaited(stop: GracefulStop) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    # 2 steps of 1 s to the next checkpoint, 10 s of grace: train on
    stop.after_step(4, every=6, total=100, step_s=1.0, saved=False)
    with pytest.raises(SystemExit) as info:  # ... and stop right after writing it
        stop.after_step(6, every=6, total=100, step_s=1.0, saved=True)
    assert info.value.code == 128 + signal.SIGTERM


def test_checkpoint_too_far_means_stop_now(stop: GracefulStop) -> None:
    os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(SystemExit) as info:  # 5 steps of 3 s > 10 s
        stop.after_step(1, every=6, total=100, step_s=3.0, saved=False)
    assert info.value.code == 128 + signal.SIGINT
    with pytest.raises(SystemExit):  # no checkpoints at all
        stop.after_step(1, every=0, total=100, step_s=0.001, saved=False)


def test_summary_names_the_cause_not_the_rank_that_lost_its_peer() -> None:
    lost = ("Traceback (most recent call last):\n  ...\nRuntimeError: [../gloo/transport/tcp/"
            "pair.cc:534] Connection closed by peer [127.0.0.1]:123")
    cause = "Traceback (most recent call last):\n  ...\nValueError: bad shard"
    e = WorkerFailedError("...", {0: (1, lost), 1: (1, cause)}, first=0)
    assert e.summary == "rank 1 failed (exit code 1): ValueError: bad shard (and 1 more rank(s))"
    e.log = "runs/x/logs/failure.log"
    assert e.summary.endswith("; tracebacks in runs/x/logs/failure.log")
    mod = WorkerFailedError("...", {2: (1, "x\nsubnetdp.distributed.timeouts."
                                           "CollectiveTimeoutError: rank(s) [1] stopped "
                                           "answering")})
    assert mod.summary == ("rank 2 failed (exit code 1): CollectiveTimeoutError: rank(s) [1] "
                           "stopped answering")


def test_slow_phases_get_longer() -> None:
    assert slow_timeout(5) == 1800.0
    assert slow_timeout(600) == 3600.0
