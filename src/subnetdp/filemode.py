"""Files a team reads get the user's umask, as a plain ``open`` would give them.

Some writers create owner-only files whatever the umask: ``tempfile.mkstemp`` (0600, the
temporary of an atomic write that becomes the final file by rename), ``tempfile.mkdtemp``
(0700: torch elastic's per-run log folder) and safetensors' ``save_file`` (0600). On a shared
filesystem that hides runs, checkpoints and exports from teammates, so each such file or folder
is given ``0o666 & ~umask`` (folders ``0o777 & ~umask``) once written.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DIR_MODE", "FILE_MODE", "UMASK", "share"]


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
