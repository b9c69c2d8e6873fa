"""No worker outlives its launcher.

[Note: workers die with their launcher]
A ``kill -9`` of the launching process runs none of its handlers: without help its workers
(children of the fork server, or of the launcher under spawn/fork) are re-parented to init and
train on, writing checkpoints into a folder whose lock is gone. So every process between the
launcher and a worker asks the kernel for SIGKILL when its parent dies (Linux
``prctl(PR_SET_PDEATHSIG)``): the fork server when it starts (``tie_server``, its parent being
the launcher), each worker when its entry point starts (``tie_worker``). Both then check that
the parent they meant is still their parent (it may have died before the request), and end at
once otherwise. Where ``prctl`` is missing a daemon thread polls the launcher instead
(``POLL_S``), in workers only: the fork server must stay single-threaded ([Note: why not fork]
in launch.py), and it already exits when the launcher's end of its pipe closes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading

__all__ = ["LAUNCHER_PID_VAR", "POLL_S", "pid_alive", "set_parent_death_signal", "tie_server",
           "tie_worker"]

LAUNCHER_PID_VAR = "SUBNETDP_LAUNCHER_PID"  # set by launch() for the fork server it starts
POLL_S = 0.5  # the watchdog's poll interval where prctl is missing
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; False where that
    cannot be asked (not Linux, or no libc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _end() -> None:
    """This process's parent is gone: end now, as the signal would have."""
    os.kill(os.getpid(), signal.SIGKILL)


def _ppid_of(pid: int) -> int | None:
    """The parent of ``pid`` (Linux /proc), None when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tie_server() -> None:
    """In the fork server (preloaded): die with the launcher that started it."""
    launcher = int(os.environ.get(LAUNCHER_PID_VAR, "0"))
    if set_parent_death_signal() and launcher and os.getppid() != launcher:
        _end()  # the launcher died before the request could take effect


def tie_worker(launcher: int) -> None:
    """In a worker, first thing: die with the launcher (pid ``launcher``), whether the worker's
    parent is the launcher itself (spawn, fork) or a fork server the launcher started."""
    parent = os.getppid()
    if set_parent_death_signal():
        # the parent we asked about must still be ours, and be the launcher or its child
        if os.getppid() != parent or launcher not in (parent, _ppid_of(parent)):
            _end()
        return
    threading.Thread(target=_watch, args=(launcher,), daemon=True,
                     name="subnetdp-lifeline").start()


def _watch(launcher: int) -> None:
    while pid_alive(launcher) and os.getppid() != 1:
        threading.Event().wait(POLL_S)
    _end()
