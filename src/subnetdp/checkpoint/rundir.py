"""Who owns a run folder: one writer at a time, and no silent mixing with an earlier run.

[Note: run-folder ownership]
The launching process (under torchrun: rank 0, before the process group exists, so before any
rank writes) takes an exclusive ``flock`` on ``<out>/.subnetdp.lock`` for the whole run,
elastic restarts and shrinks included, and writes its pid, host and start time into it. A
second run into the same folder is refused with a message naming that holder. A lock left by a
dead process is no lock: the kernel drops ``flock`` locks when their holder dies, so the next
run simply takes it. Every worker holds a duplicate of the launcher's descriptor (``launch``'s
``hold_fd``), so the lock lasts until the last process of the run has ended: after a
``kill -9`` of the launcher its workers die within moments ([Note: workers die with their
launcher] in distributed/lifeline.py), and only then is the folder free. The file is unlinked
while still locked; a taker re-checks that the path still names the inode it locked, so two
runs can never each hold a different file. A new run (no ``--resume``) into a folder that
holds any earlier run's files is refused unless ``--overwrite``, which deletes exactly those
files first.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from subnetdp.checkpoint.files import CheckpointError, checkpoints_root, list_checkpoints

__all__ = ["LOCK", "RUN_FILES", "RunFolderBusyError", "check_fresh", "hold_run_folder"]

LOCK = ".subnetdp.lock"
# What a run writes into its folder (metrics/ holds rank<N>.jsonl).
RUN_FILES = ("checkpoints", "metrics", "summary.json", "config.json", "plan.json")


class RunFolderBusyError(CheckpointError):
    """Another live run holds the run folder."""


@contextlib.contextmanager
def hold_run_folder(out: Path) -> Iterator[int]:
    """Hold ``out``'s lock for the block ([Note: run-folder ownership]); yields the locked
    descriptor, for the workers to hold too."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise RunFolderBusyError(_busy_message(out, path)) from None
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder unlinked it between our open and our lock: try again
    try:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        yield fd
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def _busy_message(out: Path, path: Path) -> str:
    try:
        info: dict[str, Any] = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    pid, host = info.get("pid", "?"), info.get("host", "?")
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"])) \
        if isinstance(info.get("since"), (int, float)) else "?"
    state = ""
    if host == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
        state = " (that launcher is gone; its worker processes still run)"
    return (f"{out} is in use by another run: pid {pid} on host {host}, since {since}{state}; "
            "wait for it to finish or stop it, or use another --out (nothing was changed)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_fresh(out: Path, *, resume: bool, overwrite: bool) -> None:
    """A new run needs a folder without an earlier run's files; ``overwrite`` deletes them.
    Call it while holding the folder's lock."""
    if resume:
        return
    earlier = [name for name in RUN_FILES if (out / name).exists()]
    if not earlier:
        return
    if overwrite:
        for name in earlier:
            p = out / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        return
    found = list_checkpoints(checkpoints_root(out))
    if found:
        raise CheckpointError(
            f"{out} already holds checkpoints (latest {found[-1].name}) of an earlier run; "
            f"continue it with --resume {out}, replace it with --overwrite, or start a new run "
            "with another --out (nothing was overwritten)")
    raise CheckpointError(
        f"{out} already holds an earlier run's files ({', '.join(earlier)}); replace them with "
        "--overwrite or start a new run with another --out (nothing was overwritten)")
