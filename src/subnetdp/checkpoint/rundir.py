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
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from subnetdp.checkpoint.files import CheckpointError, checkpoints_root, list_checkpoints
from subnetdp.checkpoint.rescue import RescueUnavailableError, rescue_root, rescue_step
from subnetdp.filemode import FolderId, check_same_folder, open_nofollow

__all__ = ["LOCK", "RUN_ENTRIES", "RUN_FILES", "RunFolderBusyError", "check_fresh",
           "check_output", "check_run_inputs", "hold_run_folder", "is_run_folder",
           "set_aside_newer"]

LOCK = ".subnetdp.lock"
# What a run writes into its folder (metrics/ holds rank<N>.jsonl).
RUN_FILES = ("checkpoints", "metrics", "summary.json", "config.json", "plan.json")
# Every name a run writes at its top level, for [Note: no links inside a run folder]: with the
# worker logs, the run's tokenizer (hf/tokenizer.py), the --memory-gb plan (train/hetero.py),
# the shared-folder marker (train/shared_folder.py), TensorBoard's events and the survivors'
# copies of a rescue (checkpoint/rescue.py). (W&B's folder is its own: it links
# wandb/latest-run itself.)
RUN_ENTRIES = (LOCK, *RUN_FILES, "logs", "tokenizer.json", "budget_plan.json",
               ".subnetdp.shared", "tensorboard", "rescue")
SUPERSEDED = "superseded"  # in checkpoints/: what a resume from an older checkpoint set aside


class RunFolderBusyError(CheckpointError):
    """Another live run holds the run folder."""


@contextlib.contextmanager
def hold_run_folder(out: Path) -> Iterator[int]:
    """Hold ``out``'s lock for the block ([Note: run-folder ownership]); yields the locked
    descriptor, for the workers to hold too."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK
    while True:
        fd = open_nofollow(path, os.O_RDWR | os.O_CREAT, 0o644)  # a planted link: refused
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


def check_fresh(out: Path, *, resume: bool, overwrite: bool, folder: FolderId | None = None
                ) -> None:
    """A new run needs a folder without an earlier run's files; ``overwrite`` deletes them.
    Call it while holding the folder's lock; ``folder``: the identity ``out`` had when the lock
    was taken (``safe_files.folder_id``), checked before anything is deleted."""
    if resume:
        return
    if overwrite:
        _say_rescue_goes(out)
    earlier = [name for name in RUN_FILES if os.path.lexists(out / name)]
    if not earlier:
        return
    if overwrite:
        if folder is not None:
            check_same_folder(out, folder)
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


def _say_rescue_goes(out: Path) -> None:
    """A new run removes ``rescue/`` as it starts; copies that make a checkpoint (their
    launcher stopped before composing it) are not removed unsaid."""
    if not rescue_root(out).is_dir():
        return
    try:
        step = rescue_step(out)
    except RescueUnavailableError:
        return
    print(f"notice: --overwrite deletes the survivors' copies in {rescue_root(out)}, which "
          f"make a checkpoint of step {step} (`--resume {out}` would continue from it)",
          file=sys.stderr)


def set_aside_newer(ckpt: Path) -> Path | None:
    """Before resuming from ``ckpt``, an older checkpoint of its run, move the run's newer
    checkpoints (and the metrics and summary they belong to) into
    ``checkpoints/superseded/<time>/``, never deleting them: the resumed run writes its own
    checkpoints of those steps, and a later ``--resume RUN`` or ``prune`` must not take the
    abandoned trajectory's for this one's. Returns that folder (None: nothing was newer).
    Call it while holding the run folder's lock."""
    root = ckpt.parent
    newer = [p for p in list_checkpoints(root) if p.name > ckpt.name]
    if not newer:
        return None
    aside = root / SUPERSEDED / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    while aside.exists():  # two resumes in one second
        aside = aside.with_name(aside.name + "+")
    aside.mkdir(parents=True)
    for p in newer:
        os.replace(p, aside / p.name)
    run = root.parent
    for name in ("metrics", "summary.json"):  # the resumed run truncates/replaces them
        src = run / name
        if src.is_dir() and not src.is_symlink():
            shutil.copytree(src, aside / name, symlinks=True)
        elif src.is_file() and not src.is_symlink():
            shutil.copy2(src, aside / name)
    return aside


# [Note: outputs apart from sources]
# Nothing outside the folder a command was given is written or deleted. So an output is never
# equal to, inside or around what the command reads (``export R --out R --overwrite`` would
# replace the run it exports), and no command but ``train --out/--resume`` writes inside a run
# folder, except a new file beside a plotted run's own (``plot R``: ``R/curves.png``). Each
# check runs before anything is read or written and refuses in one line.
def is_run_folder(path: Path) -> bool:
    """A folder a run wrote: it holds a run's checkpoints, metrics, summary or lock."""
    return path.is_dir() and any(os.path.lexists(path / name) for name in
                                 ("checkpoints", "metrics", "summary.json", LOCK))


def _run_around(path: Path) -> Path | None:
    """The run folder that is ``path`` (resolved) or holds it."""
    return next((d for d in (path, *path.parents) if is_run_folder(d)), None)


def check_output(out: str | os.PathLike[str], *, flag: str = "--out",
                 sources: tuple[str | os.PathLike[str], ...] = (),
                 beside: tuple[str | os.PathLike[str], ...] = ()) -> None:
    """Refuse (``ValueError``) an output equal to, inside or around one of ``sources``, or
    inside a run folder unless as a new top-level file of one of the runs ``beside``
    ([Note: outputs apart from sources])."""
    o = Path(out).resolve()
    keep = "write it elsewhere (nothing was written)"
    for source in sources:
        s = Path(source).resolve()
        if o == s or o.is_relative_to(s):
            where = "is" if o == s else "lies inside"
            raise ValueError(f"{flag} {out} {where} the source {source}; {keep}")
        if s.is_relative_to(o):
            raise ValueError(f"{flag} {out} holds the source {source}, which replacing it "
                             f"would delete; {keep}")
    run = _run_around(o)
    if run is None:
        return
    if o.parent == run and o.name not in RUN_ENTRIES and any(
            Path(b).resolve() == run for b in beside):
        return
    where = "is the run folder" if o == run else "lies inside the run folder"
    raise ValueError(f"{flag} {out} {where} {run}: only `subnetdp train --out/--resume` "
                     f"writes a run's folder; {keep}")


def check_run_inputs(out: str | os.PathLike[str],
                     inputs: list[tuple[str, str | None]]) -> None:
    """A run folder ``out`` (``train --out``) neither holds nor lies inside what the run reads
    (``(flag, path)``: data, tokenizer, plan), nor inside another run folder; ``ValueError``
    otherwise ([Note: outputs apart from sources])."""
    o = Path(out).resolve()
    for flag, path in inputs:
        if path is None:
            continue
        p = Path(path).resolve()
        if is_run_folder(p):
            raise ValueError(f"{flag} {path} is a run folder (it holds a run's checkpoints or "
                             "metrics), not an input; name the file or folder to read")
        if p == o or p.is_relative_to(o):
            raise ValueError(f"{flag} {path} lies in the run folder --out {out}, which the run "
                             "writes (and --overwrite empties); copy it elsewhere first or "
                             "choose another --out (nothing was written)")
        if o.is_relative_to(p):
            raise ValueError(f"--out {out} lies inside {flag} {path}: the run would write into "
                             "what it reads; choose another --out (nothing was written)")
    outer = next((d for d in o.parents if is_run_folder(d)), None)
    if outer is not None:
        raise ValueError(f"--out {out} lies inside the run folder {outer}; runs are not nested: "
                         "choose an --out beside it (nothing was written)")
