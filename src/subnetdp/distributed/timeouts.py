"""Bounded waits: every collective of a run gives up after ``--collective-timeout`` seconds,
and the rank that stopped answering is named.

A hung rank (a deadlock, stuck I/O, a stopped process) otherwise holds every other rank in its
next collective for torch's default 30 minutes. ``set_timeout`` sets the timeout on every process
group of this worker (the holder groups too: ``dist.new_group`` does not inherit the default
group's); ``slow_phase`` lengthens it around work that legitimately keeps peers waiting (rank
0's evaluation, checkpoint writes). ``naming_silent_ranks`` turns a timeout into a
``CollectiveTimeoutError`` that says which ranks did not answer: each rank that timed out
leaves a mark in the job's store and waits briefly for the others' marks; the ranks without
one are the silent ones.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

from subnetdp.torch_compat import default_store, set_group_timeouts

__all__ = [
    "CollectiveTimeoutError",
    "GroupAbortedError",
    "lost_peer",
    "named_silent",
    "naming_silent_ranks",
    "set_timeout",
    "slow_phase",
    "slow_timeout",
]

SLOW_FACTOR = 6  # evaluation / checkpoint writes may take this many times longer,
SLOW_MIN_S = 1800.0  # and at least this long
_MARK_WAIT_S = 10.0  # how long a rank that timed out waits for the other ranks' marks

_current_s: float | None = None


class CollectiveTimeoutError(RuntimeError):
    """A collective waited longer than ``--collective-timeout``; the message names the rank."""


class GroupAbortedError(RuntimeError):
    """This rank's process group was aborted under it; the message names the rank."""


def slow_timeout(seconds: float) -> float:
    return max(SLOW_MIN_S, SLOW_FACTOR * seconds)


def set_timeout(seconds: float) -> None:
    """Every process group of this worker now waits at most ``seconds`` for a peer."""
    global _current_s
    set_group_timeouts(timedelta(seconds=seconds))
    _current_s = seconds


@contextlib.contextmanager
def slow_phase(seconds: float) -> Iterator[None]:
    """Within the block the timeout is ``slow_timeout(seconds)``, then ``seconds`` again."""
    set_timeout(slow_timeout(seconds))
    try:
        yield
    finally:
        set_timeout(seconds)


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


_PEER_ERRORS = ("connection closed by peer", "connection reset by peer", "read error",
                "broken pipe", "remote worker", "glhf", "connection was likely closed",
                "did the remote server shutdown")


_SILENT = re.compile(r"rank\(s\) \[([\d, ]+)\] stopped answering")


def named_silent(text: str) -> list[int]:
    """The ranks a ``CollectiveTimeoutError`` in ``text`` names as silent ([] if none)."""
    return sorted({int(r) for m in _SILENT.finditer(text) for r in m[1].split(",")})


def lost_peer(text: str) -> bool:
    """Whether an error only says that another rank went away (gloo/NCCL wording)."""
    last = text.strip().splitlines()[-1].lower() if text.strip() else ""
    return any(p in last for p in _PEER_ERRORS)


@contextlib.contextmanager
def naming_silent_ranks(rank: int, world: int) -> Iterator[None]:
    """Re-raise a collective timeout inside the block as ``CollectiveTimeoutError``; so too
    the lost connection of a rank that was too slow (a peer's timeout mark is in the store:
    the peer gave up waiting for this rank, which is the cause, not the peer); and any failure
    once this rank's process group is gone (aborted under it) as ``GroupAbortedError``."""
    grouped = dist.is_available() and dist.is_initialized()
    try:
        yield
    except (RuntimeError, ValueError) as e:
        if isinstance(e, CollectiveTimeoutError) or world < 2:
            raise
        if grouped and not dist.is_initialized():  # aborted under this rank
            raise GroupAbortedError(f"rank {rank}'s process group was aborted under it, so "
                                    "its collectives cannot run") from e
        if not isinstance(e, RuntimeError):
            raise
        waited = f"{_current_s:g} s" if _current_s is not None else "its timeout"
        if not _is_timeout(e):
            waiting = _awaited_marks(rank, world) if lost_peer(str(e)) else []
            if not waiting:
                raise
            if len(waiting) < world - 1:  # [Note: a waiter's lost connection]
                _mark(rank)
                time.sleep(_MARK_WAIT_S)
                raise
            raise CollectiveTimeoutError(
                f"rank(s) [{rank}] stopped answering: rank(s) {waiting} waited {waited} for it "
                "in a collective (--collective-timeout) and the group stopped. Raise "
                "--collective-timeout if a step legitimately takes that long; resume from the "
                "newest checkpoint with --resume") from e
        silent = _silent_ranks(rank, world)
        if silent:
            what = (f"rank(s) {silent} stopped answering: rank {rank} waited {waited} in a "
                    "collective (--collective-timeout) and the group stopped")
        else:
            what = (f"every rank timed out after {waited} in a collective "
                    "(--collective-timeout): they waited on each other")
        raise CollectiveTimeoutError(
            f"{what}. Raise --collective-timeout if a step legitimately takes that long; "
            "resume from the newest checkpoint with --resume") from e


def _mark_prefix() -> str:
    return f"subnetdp/timeout/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


# [Note: a waiter's lost connection]
# A peer that times out closes its connections (gloo), so a rank that was waiting in the same
# collective sees "connection closed by peer", not a timeout; so does a slow rank that comes
# back after its peers gave up. The slow rank finds every other rank marked (it alone kept
# them waiting): it is named. A waiter finds a rank neither marked nor coming (the silent
# one): it marks itself as waiting, so that the census of the ranks that timed out names only
# the silent rank, and leaves that census's error to reach the launcher first.
_PEER_WAIT_S = 2.0  # a peer that timed out marks within this


def _mark(rank: int) -> None:
    with contextlib.suppress(RuntimeError, ValueError, dist.DistError):
        default_store().set(f"{_mark_prefix()}{rank}", "1")


def _awaited_marks(rank: int, world: int) -> list[int]:
    """The other ranks that timed out in a collective (or waited there) and left their mark,
    once all have or after ``_PEER_WAIT_S`` (best effort: [])."""
    deadline = time.monotonic() + _PEER_WAIT_S
    try:
        store = default_store()
        while True:
            marked = [r for r in range(world)
                      if r != rank and store.check([f"{_mark_prefix()}{r}"])]
            if len(marked) == world - 1 or time.monotonic() >= deadline:
                return marked
            time.sleep(0.1)
    except (RuntimeError, ValueError, dist.DistError):
        return []


def _silent_ranks(rank: int, world: int) -> list[int]:
    """Ranks that left no timeout mark within ``_MARK_WAIT_S`` (best effort: [] if the
    store is unreachable)."""
    try:
        store = default_store()
    except (RuntimeError, ValueError):
        return []
    prefix = _mark_prefix()
    try:
        store.set(f"{prefix}{rank}", "1")
        deadline = time.monotonic() + _MARK_WAIT_S
        while True:
            silent = [r for r in range(world) if not store.check([f"{prefix}{r}"])]
            if not silent or time.monotonic() >= deadline:
                return silent
            time.sleep(0.1)
    except (RuntimeError, dist.DistError):
        return []
