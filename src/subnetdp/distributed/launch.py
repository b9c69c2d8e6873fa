"""Start local worker processes.

``launch(fn, args, nproc=4, run_id=...)`` runs ``fn(*args)`` in ``nproc`` processes through torch's
elastic launcher (the engine behind ``torchrun``) and returns ``{rank: return value}``. Under
``torchrun`` (or any launcher that sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``) it runs ``fn`` in
the current process instead, so one entry point serves both. Inside a worker,
``process_group.init_distributed()`` sets up the process group.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import reduction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from subnetdp._moved import moved_name
from subnetdp.distributed.lifeline import LAUNCHER_PID_VAR, tie_worker
from subnetdp.distributed.process_group import (
    LAUNCHER_VARS,
    default_env,
    gloo_loopback,
    under_launcher,
)
from subnetdp.distributed.timeouts import lost_peer, named_silent
from subnetdp.filemode import append_text, share
from subnetdp.torch_compat import launch_grace

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

__all__ = [
    "RunInterruptedError",
    "WorkerFailedError",
    "WorkerStartTimeoutError",
    "free_port",
    "launch",
]

logger = logging.getLogger(__name__)

# The elastic agent installs its own handlers for these; we restore the caller's afterwards so
# that e.g. pytest or a notebook keeps its Ctrl-C behaviour.
_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


class WorkerFailedError(RuntimeError):
    """A worker process failed; ``failures`` maps global rank to (exit code, error text).

    ``str()`` holds every failed rank's traceback (for a log file); ``summary`` is one line."""

    def __init__(self, message: str, failures: dict[int, tuple[int, str]],
                 first: int | None = None) -> None:
        super().__init__(message)
        self.failures = failures
        # the rank that failed first: the cause (the others often only lost their peer)
        self.first = next(iter(failures)) if first is None else first
        self.log: str | None = None  # where the caller wrote ``str(self)``, if it did
        self.mapped: list[str] = []  # files the workers memory-map, when the caller knows

    @property
    def summary(self) -> str:
        """The causing rank's own error line, e.g. ``rank 1: ValueError: ...``: the first to
        fail among those that did not only lose a peer."""
        rank = self._causing_rank()
        code, text = self.failures[rank]
        last = _cause_line(code, text, self.mapped)
        others = f" (and {len(self.failures) - 1} more rank(s))" if len(self.failures) > 1 \
            else ""
        where = f"; tracebacks in {self.log}" if self.log else ""
        return (f"rank {rank} failed (exit code {code}): {last or 'no error text'}{others}"
                f"{where}")

    @property
    def cause(self) -> str:
        """What happened, as a clause of another line (the launcher's rescue or shrink): the
        causing rank and its error, or every rank killed by the same signal and how."""
        rank = self._causing_rank()
        code, text = self.failures[rank]
        line = _cause_line(code, text, self.mapped).split("; ")[0].split(". ")[0]
        same = [r for r, (c, _) in self.failures.items() if c == code] if code < 0 else [rank]
        kind, sep, msg = line.partition(": ")
        if sep and " " not in kind and msg.startswith("rank"):  # the error names its rank
            return msg
        return f"rank {rank}: {line}" if len(same) == 1 else f"ranks {same}: {line}"

    @property
    def silent(self) -> list[int]:
        """The ranks that their peers' collective timeouts named as silent."""
        return sorted({r for _, text in self.failures.values() for r in named_silent(text)})

    def _causing_rank(self) -> int:
        # a rank whose own collective timed out names the silent one: that is the cause,
        # whatever the silent rank reported when it came back to a group that had gone
        return min(self.failures, key=lambda r: (
            "CollectiveTimeoutError" not in self.failures[r][1],
            lost_peer(self.failures[r][1]), r != self.first))


class RunInterruptedError(RuntimeError):
    """The launching process got SIGTERM/SIGINT/...; the workers were stopped (``signal``)."""

    def __init__(self, signame: str) -> None:
        super().__init__(f"interrupted by {signame}")
        self.signal = signame


class WorkerStartTimeoutError(RuntimeError):
    """Some workers did not start within the start-up timeout (``missing``: their ranks)."""

    def __init__(self, missing: list[int], timeout_s: float) -> None:
        super().__init__(
            f"worker rank(s) {missing} did not start within {timeout_s:g} s (the others were "
            "stopped); the machine may be overloaded, or a worker hung while starting. "
            "Try again, or raise --collective-timeout")
        self.missing = missing


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    nproc: int,
    run_id: str,
    max_restarts: int = 0,
    log_dir: str | None = None,
    start_method: str | None = None,
    start_timeout: float = 300.0,
    tee_rank0: bool = False,
    hold_fd: int | None = None,
) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nproc`` local processes and return ``{rank: fn's return value}``.

    Workers get ``OMP_NUM_THREADS=1`` unless the caller set it, because ``nproc`` processes each
    using every core oversubscribe the CPU (torchrun does the same). ``start_method=None`` picks
    ``"forkserver"`` ([Note: why not fork]; ``fn`` and ``args`` must be picklable, i.e.
    module-level), or ``"spawn"`` once this process has initialised CUDA or a process group.
    ``"fork"`` stays available for closures (this process's garbage collector is then paused
    until the workers finish: [Note: fork and the garbage collector]). With ``log_dir`` each
    worker's stdout/stderr and the elastic agent's log go to files there instead of this
    terminal (``tee_rank0``: rank 0's stdout also here). ``max_restarts`` restarts the whole
    group that many times. A worker that has not started running ``fn`` after
    ``start_timeout`` seconds stops the group. Workers die with this process, even when it is
    killed by SIGKILL ([Note: workers die with their launcher]); ``hold_fd``: an open file
    every worker holds a duplicate of until it ends (a run folder's lock: the lock then lasts
    as long as any process of the run can write).

    Raises ``WorkerFailedError`` naming the failed rank(s), exit code and traceback,
    ``WorkerStartTimeoutError`` naming the ranks that did not start, and
    ``RunInterruptedError`` when this process gets SIGTERM/SIGINT/SIGHUP/SIGQUIT.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    start_method = _start_method(start_method)
    if under_launcher():
        # Already a worker (e.g. under torchrun): the launcher owns the processes.
        return {int(os.environ["RANK"]): fn(*args)}

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    if start_method == "forkserver":
        _preload_fork_server(fn)
    port = free_port()
    errors = tempfile.TemporaryDirectory(prefix="subnetdp-errors-")
    logs = _shared_logs(DefaultLogsSpecs, errors.name)(
        log_dir=log_dir,
        redirects=Std.ALL if log_dir else Std.NONE,
        tee={0: Std.OUT} if log_dir and tee_rank0 else Std.NONE,
    )
    config = _launch_config(nproc, run_id, port=port, max_restarts=max_restarts,
                            start_method=start_method, logs=logs)
    with (
        errors,
        _preserved_process_state(),
        default_env(OMP_NUM_THREADS="1", **_restart_env(max_restarts)),
        _launcher_pid(),
        _gc_paused(start_method == "fork") as gc_was_enabled,
        _agent_log(log_dir),
        _StartWatch(nproc, start_timeout) as watch,
    ):
        entry = _Worker(fn, watch.folder, gc_was_enabled if start_method == "fork" else None,
                        hold_fd)
        try:
            return dict(elastic_launch(config, entry)(*args))
        except ChildFailedError as e:
            raise _worker_failed(e, nproc, run_id) from e
        except SignalException as e:
            if watch.fired:
                raise WorkerStartTimeoutError(watch.missing(), start_timeout) from None
            raise RunInterruptedError(signal.Signals(e.sigval).name) from None


SHUTDOWN_GRACE_S = 30  # SIGTERM to the workers, then SIGKILL after this many seconds


def _start_method(start_method: str | None) -> str:
    """``start_method``, checked; None: forkserver, or spawn once this process has initialised
    CUDA or a process group."""
    if start_method is None:
        # [Note: why not fork]. A child of the fork server would still inherit CUDA state it
        # cannot use and this process's default group (so its own init_distributed would
        # return the parent's world): spawn then.
        parent_state = torch.cuda.is_initialized() or (
            dist.is_available() and dist.is_initialized()
        )
        start_method = "spawn" if parent_state else "forkserver"
    if start_method not in ("fork", "spawn", "forkserver"):
        raise ValueError(
            f"start_method must be 'fork', 'spawn' or 'forkserver', got {start_method!r}"
        )
    return start_method


def _preload_fork_server(fn: Callable[..., Any]) -> None:
    """The server imports torch and fn's module once, when it starts (the first launch of
    this process); each worker then forks from it (fast, and clean)."""
    multiprocessing.set_forkserver_preload(
        ["__main__", "subnetdp.distributed._fork_server", "torch", "torch._dynamo",
         "torch.distributed", getattr(fn, "__module__", "torch")])


def _launch_config(nproc: int, run_id: str, *, port: int, max_restarts: int,
                   start_method: str, logs: Any) -> Any:
    """torch elastic's ``LaunchConfig`` of one node's ``nproc`` workers."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{port}",
        # Single node: the agent hosts the store itself and workers reuse it (no second port).
        rdzv_configs={"is_host": True},
        max_restarts=max_restarts,
        monitor_interval=0.05,  # workers' exit is noticed sooner; polling is cheap
        start_method=start_method,
        local_addr="127.0.0.1",
        logs_specs=logs,
        # a SIGTERM/SIGINT is passed on to the workers, which may finish a checkpoint that is
        # due (distributed/signals.py) before they are killed
        **launch_grace(SHUTDOWN_GRACE_S),
        log_line_prefix_template="[rank ${rank}] ",  # tee'd lines (default: [default_role0]:)
    )


def _restart_env(max_restarts: int) -> dict[str, str]:
    """With restarts, the agent must not share its rendezvous TCPStore with the workers: the
    store outlives an attempt, so a restarted group's init_process_group reads the dead
    group's gloo/NCCL addresses from it and fails to connect (pytorch/pytorch#135712).
    Disabled, rank 0 of each attempt hosts a fresh store."""
    return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if max_restarts > 0 else {}


def _worker_failed(e: ChildFailedError, nproc: int, run_id: str) -> WorkerFailedError:
    """torch elastic's ``ChildFailedError`` as one error naming each failed rank, its exit
    code and its traceback."""
    failures = {
        rank: (f.exitcode, _failure_text(f)) for rank, f in sorted(e.failures.items())
    }
    lines = [f"{len(failures)} of {nproc} worker(s) of run {run_id!r} failed:"]
    for rank, (code, text) in failures.items():
        lines.append(f"--- rank {rank} (exit code {code}) ---\n{text}")
    return WorkerFailedError("\n".join(lines), failures, first=e.get_first_failure()[0])


def _shared_logs(base: type, errors: str) -> type:
    """``base`` (torch's DefaultLogsSpecs, imported with the launch) whose per-run log folder,
    a ``mkdtemp`` (0700), gets the umask's mode: teammates read a failed run's logs. Each
    worker's error file (its traceback, for the agent) lies in ``errors``, a temporary folder
    off the run's disk: a worker whose error was a full disk still reports it (an empty error
    file fails the agent with a JSONDecodeError instead)."""
    attempts = itertools.count()

    class SharedLogsSpecs(base):  # type: ignore[misc,valid-type]
        def reify(self, envs: dict[int, dict[str, str]]) -> Any:
            specs = super().reify(envs)
            run_dir = getattr(self, "_run_log_dir", None)
            if run_dir and os.path.isdir(run_dir):
                share(run_dir)
            attempt = next(attempts)
            for rank in specs.error_files:
                if not envs[rank].get("TORCHELASTIC_ERROR_FILE"):  # logs off: none
                    continue
                path = os.path.join(errors, f"{attempt}-{rank}.json")
                specs.error_files[rank] = envs[rank]["TORCHELASTIC_ERROR_FILE"] = path
            return specs

    return SharedLogsSpecs


# [Note: why not fork]
# The launching process has threads by the time it starts workers (the elastic agent's TCP
# store, tokenizers' pool, an earlier launch's leftovers). A forked child inherits every lock as
# it was, held or not, with none of the threads that would release it; in about 2 of 45
# launches on a loaded machine a child blocked forever on a glibc lock (the resolver's) before
# running a line of Python. A fork server is a fresh single-threaded process that imports torch
# once and forks each worker from that clean state, so no lock is inherited locked; and the
# start-up watch (``_StartWatch``) bounds what is left: a worker that never reaches ``fn``.


class _StartWatch:
    """Stops the launch (SIGTERM to this process: the elastic agent then stops the workers)
    when some rank has not started ``fn`` within ``timeout`` seconds. Workers mark their start
    with a file in ``folder``."""

    def __init__(self, nproc: int, timeout: float) -> None:
        self.nproc, self.timeout = nproc, timeout
        self.folder = tempfile.mkdtemp(prefix="subnetdp-start-")
        self.fired = False
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="subnetdp-start")

    def missing(self) -> list[int]:
        up = {int(p.name) for p in Path(self.folder).iterdir() if p.name.isdigit()}
        return [r for r in range(self.nproc) if r not in up]

    def _watch(self) -> None:
        deadline = time.monotonic() + self.timeout
        while not self._done.wait(0.1):
            if not self.missing():
                return
            if time.monotonic() >= deadline:
                with self._lock:  # never after __exit__: the agent's handler is gone by then
                    if not self._done.is_set():
                        self.fired = True
                        os.kill(os.getpid(), signal.SIGTERM)
                return

    def __enter__(self) -> _StartWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._done.set()
        self._thread.join()
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def _launcher_pid() -> Iterator[None]:
    """This process's pid in ``LAUNCHER_PID_VAR`` for the fork server it may start (an
    inherited value would name another process)."""
    saved = os.environ.get(LAUNCHER_PID_VAR)
    os.environ[LAUNCHER_PID_VAR] = str(os.getpid())
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(LAUNCHER_PID_VAR, None)
        else:
            os.environ[LAUNCHER_PID_VAR] = saved


@contextlib.contextmanager
def _agent_log(log_dir: str | None) -> Iterator[None]:
    """The elastic agent's own log (start-up, failures with every rank's traceback, shutdown)
    goes to ``log_dir/agent.log`` instead of this terminal; without ``log_dir`` it stays."""
    if log_dir is None:
        yield
        return
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    # not logging.FileHandler: it would append through a link planted at agent.log
    handler = _QuietHandler(append_text(Path(log_dir) / "agent.log"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic",
                                              "torch.distributed.launcher",
                                              "torch.multiprocessing")]
    saved = [lg.propagate for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
    try:
        yield
    finally:
        for lg, prop in zip(loggers, saved, strict=True):
            lg.removeHandler(handler)
            lg.propagate = prop
        handler.close()
        with contextlib.suppress(OSError):  # a full disk: the buffered tail is lost
            handler.stream.close()


class _QuietHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """agent.log is a copy for later reading: a write that fails (a full disk) is skipped
    silently, not printed as a traceback on the terminal; the failure that matters is the
    workers', which the launch reports."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass


# [Note: fork and the garbage collector]
# A forked worker inherits every object of this process, including cyclic garbage not yet
# collected here (the previous launch's queues/locks, MemTracker's hook objects, ...). When the
# child's collector frees such inherited garbage, destructors run against state that only made
# sense in the parent; we saw workers die with SIGSEGV "Garbage-collecting" this way, depending
# on what earlier tests left behind. So: collect here, keep the collector off while the agent
# forks (children inherit "off"), and in the child freeze everything inherited (never
# traversed or freed there, which also avoids copy-on-write of those pages) before turning the
# collector back on for the worker's own objects.


@contextlib.contextmanager
def _gc_paused(active: bool) -> Iterator[bool]:
    """Collect now and disable the collector until the block ends; yields the prior state."""
    enabled = gc.isenabled()
    if not active:
        yield enabled
        return
    gc.collect()
    gc.disable()
    try:
        yield enabled
    finally:
        if enabled:
            gc.enable()


# What the elastic agent sets in each worker's environment (and TORCHELASTIC_*); everything
# else a worker takes from the launching process as it was at the launch.
_AGENT_VARS = frozenset({
    *LAUNCHER_VARS, "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"})


class _Worker:
    """A worker's entry point: die with the launcher, take the launch's environment, mark the
    start for ``_StartWatch``, then run ``fn``. Forked (``gc_enabled`` not None): first freeze
    the inherited objects. ``hold_fd`` travels as a duplicate (``DupFd``) that the worker keeps
    open until it ends."""

    def __init__(self, fn: Callable[..., Any], start_folder: str,
                 gc_enabled: bool | None, hold_fd: int | None = None) -> None:
        self.fn = fn
        self.start_folder = start_folder
        self.gc_enabled = gc_enabled
        self.launcher = os.getpid()
        self.hold_fd: Any = hold_fd
        # A fork server's children inherit the environment of the server's start (this
        # process's first launch), not this one's: a variable set since (NCCL_DEBUG, say)
        # would be missing. Values that torch read when the server imported it stay.
        # Local workers' gloo talks over loopback unless the user names an interface.
        self.env = {**gloo_loopback(), **{
            k: v for k, v in os.environ.items()
            if k not in _AGENT_VARS and not k.startswith("TORCHELASTIC_")}}
        # The elastic agent names the worker after its entry point in logs and errors.
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self.hold_fd is not None:  # pickled for a spawned or fork-server child
            state["hold_fd"] = reduction.DupFd(self.hold_fd)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.hold_fd is not None:
            self.hold_fd = self.hold_fd.detach()  # an fd of this process, open until it ends

    def __call__(self, *args: Any) -> Any:
        tie_worker(self.launcher)
        os.environ.update(self.env)
        if self.gc_enabled is not None:
            gc.freeze()
            if self.gc_enabled:
                gc.enable()
        with contextlib.suppress(OSError):  # the watch may be gone (a restarted group)
            Path(self.start_folder, os.environ.get("RANK", "0")).touch()
        try:
            return self.fn(*args)
        except RuntimeError as e:
            if lost_peer(str(e)):
                # A peer failed first; give its own error time to reach the agent, which
                # reports the failures it has seen when the first worker exits.
                time.sleep(PEER_GRACE_S)
            raise


PEER_GRACE_S = 3.0


def _cause_line(code: int, text: str, mapped: list[str] | None = None) -> str:
    """The line that says why a worker ended: its exception's last line, or for a worker
    ended by a signal (no traceback: torch's text is then a link to its docs) the signal and
    its likely cause; ``mapped``: the files the workers memory-map, named for SIGBUS."""
    sig = -code if code < 0 else code - 128 if code > 128 else 0
    if sig and (not text.strip() or "pytorch.org" in text or text.startswith("Signal ")):
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        how = "killed by" if code < 0 else "stopped on"
        return f"{how} {name}{_signal_cause(name, mapped or [])}"
    last = next((ln for ln in reversed(text.splitlines()) if ln.strip()), "")
    kind, sep, msg = last.partition(": ")
    if sep and " " not in kind:  # "pkg.module.SomeError: msg" -> "SomeError: msg"
        last = f"{kind.rsplit('.', 1)[-1]}: {msg}"
    return last


# [Note: signals from inside]
# SIGBUS, SIGSEGV, SIGILL and SIGFPE are raised by the worker's own memory access or
# instruction, not sent by kill or a scheduler. SIGBUS on a healthy machine means a
# memory-mapped file (the token files) shrank or changed under the run: --resume alone maps the
# same file again, so the line says to restore it first. The others are a native crash.
_NATIVE = frozenset({"SIGSEGV", "SIGILL", "SIGFPE"})


def _signal_cause(name: str, mapped: list[str]) -> str:
    """What a worker's death by signal ``name`` most likely means, and what to do."""
    if name == "SIGBUS":
        files = f" (the run maps {', '.join(mapped)})" if mapped else ""
        return (f": a memory-mapped file was truncated or changed under the run{files}; "
                "restore or rebuild it (a token cache is rebuilt when its folder is removed) "
                "before --resume, which maps it again")
    if name in _NATIVE:
        return (": a native crash inside the worker (torch, a compiled kernel or an "
                "extension), not a signal from outside; PYTHONFAULTHANDLER=1 shows where in the "
                "worker's log")
    return " from outside the run (kill, a scheduler or the OOM killer); resume with --resume"


def _failure_text(f: Any) -> str:
    """The worker's traceback when it wrote one (a Python exception), else why it died."""
    data = getattr(f, "error_file_data", None) or {}
    msg = data.get("message", {})
    if isinstance(msg, dict):
        stack = msg.get("extraInfo", {}).get("py_callstack")
        if stack:
            return str(stack).rstrip()
        if msg.get("message"):
            return str(msg["message"])
    # No error file: the process was killed by a signal or called os._exit.
    return str(getattr(f, "message", "")) or "no traceback (killed by a signal or os._exit?)"


@contextlib.contextmanager
def _preserved_process_state() -> Iterator[None]:
    """Undo the elastic agent's process-wide side effects (signal handlers, env vars)."""
    saved_env = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    saved: dict[signal.Signals, Any] = {}
    with contextlib.suppress(ValueError):  # signal.getsignal is fine; signal() only in main thread
        for name in _SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                saved[sig] = signal.getsignal(sig)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
        if saved_env is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = saved_env


def __getattr__(name: str) -> Any:  # process-group set-up lived here (subnetdp/_moved.py)
    return moved_name(__name__, name)
