"""The one error boundary of every command: what escapes a command's own handling still ends
as one line that names the file and says the fix, never a traceback (issue 27).

A command refuses what it knows with its own words first; ``run_command`` catches the rest:
an ``OSError`` is told by its file and errno (``os_error_line``), a ``ValueError`` by its own
message, a collective that lost a peer (another rank died first: under torchrun every survivor
reports it) by that, and anything else is a bug in subnetdp, whose traceback goes to a file
named in the line.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys
import tempfile
import traceback

__all__ = ["os_error_line", "run_command"]

_FIXES = {
    errno.ENOSPC: "free space on that disk, or write somewhere else",
    errno.EDQUOT: "free space in your quota, or write somewhere else",
    errno.EROFS: "that file system is read-only; write somewhere else",
    errno.EACCES: "check its permissions, or use another path",
    errno.EPERM: "check its permissions, or use another path",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of that path is a file, not a folder; use another path",
    errno.EISDIR: "it is a folder; give a file",
    errno.ENAMETOOLONG: "use a shorter path",
    errno.ELOOP: "a symbolic link there points back into itself; fix the link or give the "
                 "real path",
}


def os_error_line(e: OSError) -> str:
    """``path: what happened; the fix`` for an ``OSError`` (the path when it has one)."""
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    what = e.strerror or str(e)
    fix = _FIXES.get(e.errno or 0)
    return f"{where + ': ' if where else ''}{what}{'; ' + fix if fix else ''}"


def run_command(args: argparse.Namespace) -> int:
    """``args.func(args)``, with every error it lets escape turned into one line on stderr:
    exit code 2 for a file or value the command could not use, 1 for a bug (its traceback is
    written to a file that the line names)."""
    name = f"subnetdp {args.command}"
    try:
        return int(args.func(args))
    except OSError as e:
        print(f"{name}: {os_error_line(e)}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug: its traceback goes to a file, the user gets one line
        loop = _symlink_loop(e)
        if loop is not None:
            print(f"{name}: {os_error_line(loop)}", file=sys.stderr)
            return 2
        lost = _lost_peer_line(e)
        if lost:  # under torchrun each survivor of a dead rank ends here: not our bug
            print(f"{name}: {lost}", file=sys.stderr)
            return 1
        fd, path = tempfile.mkstemp(prefix="subnetdp-error-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            traceback.print_exc(file=f)
        print(f"{name}: internal error {type(e).__name__}: {e}; please report it with the "
              f"traceback in {path}", file=sys.stderr)
        return 1


def _symlink_loop(e: Exception) -> OSError | None:
    """pathlib's ``resolve`` (before Python 3.13) reports a symbolic link loop as
    ``RuntimeError("Symlink loop from '<path>'")``: the ``OSError`` (ELOOP) that it is since."""
    found = re.fullmatch(r"Symlink loop from '(.*)'", str(e))
    if not isinstance(e, RuntimeError) or found is None:
        return None
    return OSError(errno.ELOOP, os.strerror(errno.ELOOP), found.group(1))


def _lost_peer_line(e: Exception) -> str | None:
    """The one line of a rank whose collective failed because another rank went away
    (gloo/NCCL's "connection closed by peer"), or None for any other error."""
    from subnetdp.distributed.timeouts import lost_peer

    text = str(e).strip()
    if not isinstance(e, RuntimeError) or not lost_peer(text):
        return None
    rank = os.environ.get("RANK")
    who = f"rank {rank}" if rank is not None else "this process"
    return (f"{who} lost its connection to another rank ({text.splitlines()[-1]}): another "
            "rank stopped first and its own message names the cause; resume from the newest "
            "checkpoint with --resume")
