"""A collective method called on some ranks only: an error that names them, not a hang.

[Note: collective calls on some ranks]
``full_state_dict()``, ``subnetdp.save`` and ``subnetdp.load`` are collective: every rank sends
or receives its pieces. A script that calls one under ``if rank == 0:`` used to crash rank 0
with gloo's "connection closed by peer" (the others had exited) or leave it waiting in a
collective the others never join (NCCL hangs until its watchdog kills the process). So each
call first checks in to the process group's store: one small write of the call's name under a
key numbered by how many such calls this process made (the same number on every rank that calls
in the same order); no collective, no wait.
- gloo: the collective then runs as before. If it raises, the store says whether a rank never
  called, and that becomes the error (the original one is its cause).
- NCCL: a collective whose peer is missing does not fail, it hangs; so each rank first waits in
  the store for every rank's check-in, up to the store's timeout (the group's), and a rank
  that is still missing then, or that checked in to another call, is named. In a correct
  script this costs two store round trips.
A rank that never calls cannot be told apart from one that is merely slower before the
deadline, so under gloo a mismatch that hangs rather than fails (the others are in another
collective) is still named only when gloo's own timeout ends it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

from subnetdp.torch_compat import default_store

__all__ = ["CollectiveCallError", "called_by_all"]

_calls = itertools.count()  # per process: the check-in keys of the n-th collective call


class CollectiveCallError(RuntimeError):
    """A collective method was called on some ranks only."""


@contextlib.contextmanager
def called_by_all(what: str, *, hint: str = "", wait: bool | None = None,
                  timeout: float | None = None) -> Iterator[None]:
    """Run the block, which issues the collectives of the call ``what`` (e.g.
    ``"full_state_dict()"``); raise ``CollectiveCallError`` naming the ranks that did not call
    it ([Note: collective calls on some ranks]), ``hint`` added to its message. ``wait``: wait
    for every rank's check-in first (None: under NCCL); ``timeout``: seconds to wait (None:
    the store's timeout, which is the group's)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    store = default_store()
    keys = [f"subnetdp/called/{next(_calls)}/{r}" for r in range(world)]
    store.set(keys[rank], what)
    if wait is None:
        wait = "nccl" in str(dist.get_backend())
    if wait:
        try:
            # the store's timeout (a property torch's stubs lack) is the group's
            limit: timedelta = (store.timeout if timeout is None  # type: ignore[attr-defined]
                                else timedelta(seconds=timeout))
            store.wait(keys, limit)
        except RuntimeError as e:  # DistStoreError: the timeout
            _raise_named(what, hint, store, keys, e)
        error = _error(what, hint, store, keys, all_present=True)  # to this very call?
        if error is not None:
            raise error
    try:
        yield
    except RuntimeError as e:
        _raise_named(what, hint, store, keys, e)


def _raise_named(what: str, hint: str, store: dist.Store, keys: list[str],
                 cause: RuntimeError) -> NoReturn:
    """Raise the error naming the ranks that did not call, else ``cause`` itself."""
    error = _error(what, hint, store, keys)
    if error is None:
        raise cause
    raise error from cause


def _error(what: str, hint: str, store: dist.Store, keys: list[str], *,
           all_present: bool = False) -> CollectiveCallError | None:
    """The error naming the ranks that did not check in to this call, or checked in to another
    one (None: every rank called it)."""
    try:
        calls = ([v.decode() for v in store.multi_get(keys)] if all_present else
                 [store.get(k).decode() if store.check([k]) else None for k in keys])
    except RuntimeError:  # the store went away with the rank that hosted it: nothing to tell
        return None
    missing = [r for r, c in enumerate(calls) if c is None]
    other = {r: c for r, c in enumerate(calls) if c is not None and c != what}
    if not missing and not other:
        return None
    found = ", ".join([*([f"rank(s) {missing} did not call it"] if missing else []),
                       *(f"rank {r} called {c} instead" for r, c in other.items())])
    return CollectiveCallError(
        f"{what} is collective: every rank must call it, in the same order, but {found}; call "
        f"it on every rank, not under `if rank == 0:`{hint}")
