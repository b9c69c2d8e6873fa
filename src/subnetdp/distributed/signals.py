"""SIGTERM/SIGINT inside a training worker: stop cleanly, after a checkpoint when one is near.

The elastic agent passes a signal it gets (a scheduler's preemption SIGTERM, Ctrl-C's SIGINT)
on to the workers and kills them ``launch.SHUTDOWN_GRACE_S`` later. A worker with
``GracefulStop`` installed only notes the signal; after each step it either continues to the
checkpoint that is due within ``grace_s`` seconds (at its measured step time), writes it and
exits, or exits at once. Exiting is ``SystemExit``: nothing half-written is published (a
checkpoint appears only by an atomic rename of a complete folder, checkpoint/files.py), so a rank
that exits while its peers still write leaves the previous checkpoint the newest.
"""

from __future__ import annotations

import contextlib
import signal
import time
from types import FrameType

__all__ = ["GRACE_S", "GracefulStop", "steps_to_checkpoint"]

GRACE_S = 15.0  # below launch.SHUTDOWN_GRACE_S, leaving time for the write itself


def steps_to_checkpoint(done: int, every: int, total: int) -> int | None:
    """Steps from ``done`` to the next checkpoint (every ``every`` steps and at ``total``)."""
    if every <= 0 or done >= total:
        return None
    return min(every - done % every, total - done)


class GracefulStop:
    """Installs SIGTERM/SIGINT handlers that record the signal; ``after_step`` acts on it."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.signum: int | None = None
        self._at = 0.0
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread: keep the defaults
                signal.signal(sig, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum, self._at = signum, time.monotonic()

    def after_step(self, done: int, *, every: int, total: int, step_s: float,
                   saved: bool) -> None:
        """Call after step ``done`` (and its checkpoint, ``saved``): exit when signalled,
        unless the next checkpoint is due within the grace period."""
        if self.signum is None:
            return
        left = steps_to_checkpoint(done, every, total)
        remaining = self.grace_s - (time.monotonic() - self._at)
        if saved or left is None or left * step_s > remaining:
            raise SystemExit(128 + self.signum)
