"""A step-level fault injector for rehearsing failures (a testing hook; ignored unless set).

``SUBNETDP_FAULT=RANK:STEP:PHASE:KIND`` makes rank ``RANK`` fail at step ``STEP`` (counted from
1) when it reaches ``PHASE``: ``forward`` (before the model's forward), ``backward`` (before the
backward), ``reduce`` (the end of the backward, while the holder groups' reductions are in
flight; SDP's holder-group reducer, not under ``--fsdp``), ``commit`` (entering the step's
commit, a rescuable run's step boundary: [Note: rescue]), ``optimizer`` (after the commit,
before the update) or ``checkpoint`` (before the step's checkpoint is written; a step without
one never reaches it).
``KIND`` ([Note: kinds of fault]): ``kill`` (SIGKILL itself: no cleanup, as an OOM kill or a
lost machine), ``segv`` (a real segmentation fault: a native crash), ``raise``
(``InjectedFault``, a Python exception), ``abort`` (its process groups aborted under it, as a
communicator's watchdog does; it goes on and its next collective fails), ``hang`` (sleep until
killed; peers wait for their collective timeout), ``gil`` (stuck in C code holding the GIL),
``slow`` or ``slow=S`` (a straggler: from ``STEP`` on, ``S`` seconds more at ``PHASE`` of every
step; default 1) or ``node`` (the first field is then a node: every rank of node ``RANK``
SIGKILLs itself, a lost machine). The fault fires once per run: the launcher disarms it (sets
it empty) for the groups it starts after a failure. torchft's ``EventInjector().fail_at(rank,
step)`` and its chaos kinds are the model.

[Note: kinds of fault]
- ``segv`` reads address 0 through ``ctypes``: the kernel's SIGSEGV, not a ``kill``, so it is
  what a crash in torch or an extension looks like (exit code -11).
- ``gil`` deadlocks in C: it locks a pthread mutex twice through ``ctypes.PyDLL``, which,
  unlike ``CDLL``, keeps the GIL during the call (and a mutex wait, unlike libc's ``sleep``,
  is not cut short by a signal): no Python runs in the process, not even a signal handler, so
  the launcher's SIGTERM does nothing and its SIGKILL ends it after the stop grace.
- ``abort`` aborts the rank's process groups (``torch_compat.abort_process_group``) and lets
  it go on: its next collective fails, and its peers see their connections to it close
  (gloo; NCCL not tried).
- ``node``: a rank's node is ``GROUP_RANK``, which torchrun and ``train --nnodes`` (the
  built-in launcher's emulated nodes, distributed/nodes.py) set. ``SUBNETDP_FAULT_NODES=K``,
  a testing override for a launch that runs every worker as node 0, puts the ranks on ``K``
  nodes in contiguous blocks (torchrun's numbering: ``rank * K // world``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable

__all__ = ["ENV", "KINDS", "NODES_ENV", "PHASES", "Fault", "InjectedFault", "at_step",
           "check_env", "parse", "point", "reached"]

ENV = "SUBNETDP_FAULT"
NODES_ENV = "SUBNETDP_FAULT_NODES"
PHASES = ("forward", "backward", "reduce", "commit", "optimizer", "checkpoint")
KINDS = ("kill", "segv", "raise", "abort", "hang", "gil", "slow", "node")
SLOW_S = 1.0  # a straggler's seconds per step unless ``slow=S`` says


class InjectedFault(RuntimeError):
    """The exception of a ``raise`` fault."""


@dataclasses.dataclass(frozen=True)
class Fault:
    rank: int  # the node, for ``node``
    step: int
    phase: str
    kind: str
    seconds: float = 0.0  # ``slow``: added at ``phase`` of every step from ``step`` on

    def fires(self, phase: str, step: int, rank: int, node: int) -> bool:
        where = node if self.kind == "node" else rank
        reached = step >= self.step if self.kind == "slow" else step == self.step
        return self.phase == phase and reached and where == self.rank


def parse(spec: str) -> Fault | None:
    """The fault ``spec`` names (None for an empty one); ``ValueError`` saying how to write it."""
    if not spec.strip():
        return None
    how = (f"{ENV}={spec!r} is not RANK:STEP:PHASE:KIND (e.g. 1:5:reduce:kill; phases "
           f"{', '.join(PHASES)}; kinds {', '.join(KINDS)}, slow=SECONDS)")
    parts = spec.strip().split(":")
    if len(parts) != 4 or not parts[0].isdigit() or not parts[1].isdigit():
        raise ValueError(how)
    kind, _, arg = parts[3].partition("=")
    seconds = SLOW_S if kind == "slow" and not arg else 0.0
    if arg:
        try:
            seconds = float(arg)
        except ValueError:
            raise ValueError(how) from None
        if kind != "slow" or not 0 < seconds < float("inf"):
            raise ValueError(how)
    fault = Fault(int(parts[0]), int(parts[1]), parts[2], kind, seconds)
    if fault.step < 1 or fault.phase not in PHASES or fault.kind not in KINDS:
        raise ValueError(how)
    return fault


def emulated_nodes(world: int) -> int:
    """``SUBNETDP_FAULT_NODES`` checked ([Note: kinds of fault]; 1 when unset)."""
    spec = os.environ.get(NODES_ENV, "").strip()
    if not spec:
        return 1
    if not spec.isdigit() or not 1 <= int(spec) <= world:
        raise ValueError(f"{NODES_ENV}={spec!r} must be a number of nodes from 1 to the run's "
                         f"{world} workers")
    return int(spec)


def check_env(world: int, *, nodes: int = 1, first: int = 1, last: int | None = None,
              unreached: Callable[[str, int], str | None] | None = None) -> None:
    """Refuse, before any worker starts, a malformed ``SUBNETDP_FAULT`` or one that would never
    fire: a rank (or node, of ``nodes``) the run lacks, a step outside ``first..last`` (the
    steps this run trains), or a phase the run never reaches at that step
    (``unreached(phase, step)``: why, or None)."""
    fault = parse(os.environ.get(ENV, ""))
    if fault is None:
        return
    if fault.kind == "node":
        nodes = max(nodes, emulated_nodes(world))
        if fault.rank >= nodes:
            raise ValueError(f"{ENV} names node {fault.rank}, but the run has {nodes} node(s) "
                             f"(nodes 0..{nodes - 1}; {NODES_ENV} emulates more)")
    elif fault.rank >= world:
        raise ValueError(f"{ENV} names rank {fault.rank}, but the run has {world} workers "
                         f"(ranks 0..{world - 1})")
    if fault.step < first or (last is not None and fault.step > last):
        span = f"steps {first}..{last}" if last is not None else f"steps from {first}"
        raise ValueError(f"{ENV} names step {fault.step}, but this run trains {span}, so it "
                         "would never fire; name a step in that range")
    why = unreached(fault.phase, fault.step) if unreached is not None else None
    if why:
        raise ValueError(f"{ENV} names phase {fault.phase}, which this run never reaches at "
                         f"step {fault.step} ({why}), so it would never fire; name another "
                         "phase or step")


_step = 0  # the step this worker is running (set by the training loop)
_reached: dict[str, float] = {}  # when this worker last reached each phase (perf_counter)


def at_step(step: int) -> None:
    """The training loop starts step ``step``."""
    global _step
    _step = step
    _reached.clear()


def reached(phase: str) -> float | None:
    """When this worker reached ``phase`` of the current step (``time.perf_counter``), or None:
    the step's timeline, which the straggler watch reads (distributed/stragglers.py)."""
    return _reached.get(phase)


def point(phase: str) -> None:
    """This worker reaches ``phase`` of the current step: fail here if the fault says so."""
    _reached[phase] = time.perf_counter()
    spec = os.environ.get(ENV)
    if not spec:
        return
    fault = parse(spec)
    if fault is None or not fault.fires(phase, _step, _rank(), _node()):
        return
    _fire(fault, phase)


def _fire(fault: Fault, phase: str) -> None:
    """Do what ``fault.kind`` says ([Note: kinds of fault])."""
    if fault.kind in ("kill", "node"):
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "segv":
        ctypes.string_at(0)  # SIGSEGV from the kernel
    if fault.kind == "raise":
        raise InjectedFault(f"injected fault: rank {fault.rank}, step {fault.step}, {phase}")
    if fault.kind == "abort":
        from subnetdp.torch_compat import abort_process_group

        abort_process_group()
        return
    if fault.kind == "slow":
        time.sleep(fault.seconds)
        return
    if fault.kind == "gil":  # a deadlock in C: a mutex locked twice, the GIL held throughout
        libc = ctypes.PyDLL(None)  # PyDLL keeps the GIL during the call; CDLL would drop it
        mutex = ctypes.create_string_buffer(64)  # zeroed: glibc's default, non-recursive mutex
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)  # never returns, not even for a signal
    while True:  # hang
        time.sleep(3600)


def _rank() -> int:
    dist = sys.modules.get("torch.distributed")  # not imported: no group to ask
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _node() -> int:
    """This worker's node ([Note: kinds of fault])."""
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1 or not os.environ.get(NODES_ENV):
        return int(os.environ.get("GROUP_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return _rank() * emulated_nodes(world) // world
