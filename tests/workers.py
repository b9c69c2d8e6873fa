"""Patch library code inside the workers of the next local launches.

Local launches start workers from a fork server, so a monkeypatch made in the test process does
not reach them; forking them from the test process instead can deadlock a worker on a lock that
one of pytest's threads held at the fork. ``patch_workers`` makes ``subnetdp train`` start each
worker with ``patch()``: a module-level function (or a ``functools.partial`` of one), pickled by
reference and run in the worker before it trains.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest


def patch_workers(monkeypatch: pytest.MonkeyPatch, patch: Callable[[], None]) -> None:
    """Every worker that ``run_training`` starts from now on runs ``patch()`` first."""
    # run_training looks train_worker up when it is called, so this reaches it
    monkeypatch.setattr("subnetdp.train.trainer.train_worker",
                        functools.partial(_patched_worker, patch))


def _patched_worker(patch: Callable[[], None], *args: Any) -> Any:
    import subnetdp.train.trainer as trainer

    patch()
    return trainer.train_worker(*args)  # the worker's own module: unpatched there
