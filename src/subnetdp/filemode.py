"""Files a team reads get the user's umask, as a plain ``open`` would give them, and are never
written through a symbolic link.

Some writers create owner-only files whatever the umask: ``tempfile.mkstemp`` (0600, the
temporary of an atomic write that becomes the final file by rename), ``tempfile.mkdtemp``
(0700: torch elastic's per-run log folder) and safetensors' ``save_file`` (0600). On a shared
filesystem that hides runs, checkpoints and exports from teammates, so each such file or folder
is given ``0o666 & ~umask`` (folders ``0o777 & ~umask``) once written.

The same writers never write through a symbolic link:

[Note: no links inside a run folder]
A run folder is often on a shared filesystem where others can create files. A link planted at
a name the run writes (``.subnetdp.lock``, ``logs/failure.log``, ``metrics/rank0.jsonl``, a
checkpoint's manifest) would make the run truncate, append to or replace its target: any file
the user (or root) may write. So:

- before anything is written, the launching process refuses a run folder in which any name the
  run writes is a link (``check_no_links``), in one line naming it; nothing is written then;
- every write opens its final component with ``O_NOFOLLOW`` (``open_nofollow``, appends) or
  writes a fresh temporary (``O_EXCL``) renamed over the name (``write_atomic``): a rename
  replaces a link planted mid-run instead of writing through it;
- the run folder itself may be a link (``runs -> /scratch/runs``): it is the folder the user
  named. Its identity (device, inode) is taken once when the run starts (``folder_id``) and
  checked before anything is deleted or published (``check_same_folder``), so a folder swapped
  for another one mid-run is never pruned or written into.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import IO

__all__ = ["DIR_MODE", "FILE_MODE", "UMASK", "FolderId", "LinkedFileError", "append_text",
           "check_no_links", "check_same_folder", "folder_id", "open_nofollow", "share",
           "write_atomic"]


def _read_umask() -> int:
    # /proc shows it without changing it; os.umask can only read it by setting it, which
    # another thread creating a file at that moment would see
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = _read_umask()  # process-wide, read once: nothing in subnetdp changes it
FILE_MODE = 0o666 & ~UMASK
DIR_MODE = 0o777 & ~UMASK


def share(path: str | os.PathLike[str]) -> None:
    """Give ``path`` (a file or folder this process just wrote) the mode the umask allows."""
    os.chmod(path, DIR_MODE if os.path.isdir(path) else FILE_MODE)


# -- writes that never follow links ([Note: no links inside a run folder]) ---------------
FolderId = tuple[int, int]  # (st_dev, st_ino)


class LinkedFileError(ValueError):
    """A name a run writes is a symbolic link ([Note: no links inside a run folder])."""


def _linked(path: Path) -> LinkedFileError:
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return LinkedFileError(f"{path} is a symbolic link{target}; subnetdp never writes a run "
                           "folder's files through links: remove it (nothing was written to "
                           "its target)")


def open_nofollow(path: str | os.PathLike[str], flags: int, mode: int = FILE_MODE) -> int:
    """``os.open`` that refuses a link at ``path``'s final component (``LinkedFileError``)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP or (e.errno == errno.EEXIST and os.path.islink(path)):
            raise _linked(Path(path)) from None
        raise


def append_text(path: str | os.PathLike[str]) -> IO[str]:
    """``path`` opened for appending text (created with the umask's mode), never a link."""
    fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(fd, "a", encoding="utf-8")


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *, durable: bool = False
                 ) -> None:
    """``data`` at ``path`` through a fresh temporary renamed over it: readers see the old
    file or the new one, and a link at ``path`` is replaced, never written through.
    ``durable``: fsync the file before the rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, FILE_MODE)  # mkstemp's 0600 would hide the file from the team
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_no_links(run_dir: Path, names: tuple[str, ...]) -> None:
    """Refuse (``LinkedFileError``) a link at any of ``names`` in ``run_dir`` or anywhere
    below those of them that are folders."""
    for name in names:
        top = run_dir / name
        if top.is_symlink():
            raise _linked(top)
        if not top.is_dir():
            continue
        for folder, dirs, files in os.walk(top):  # does not follow links
            for entry in sorted(dirs + files):
                if os.path.islink(os.path.join(folder, entry)):
                    raise _linked(Path(folder) / entry)


def folder_id(path: Path) -> FolderId:
    """The identity of the folder ``path`` names now (a link to it names it too)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def check_same_folder(path: Path, expected: FolderId) -> None:
    """Raise ``OSError`` unless ``path`` still names the folder it named at start."""
    try:
        now: FolderId | None = folder_id(path)
    except OSError:
        now = None
    if now != expected:
        raise OSError(errno.ESTALE, f"{path} is no longer the run folder this run started in "
                                    "(it was moved, deleted or replaced, e.g. by a link); "
                                    "nothing was deleted or published there")
