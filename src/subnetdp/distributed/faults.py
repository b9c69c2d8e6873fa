"""A step-level fault injector for rehearsing failures (a testing hook; ignored unless set).

``SUBNETDP_FAULT=RANK:STEP:PHASE:KIND`` makes rank ``RANK`` fail at step ``STEP`` (counted from
1) when it reaches ``PHASE``: ``forward`` (before the model's forward), ``backward`` (before the
backward), ``reduce`` (the end of the backward, while the holder groups' reductions are in
flight; SDP's holder-group reducer, not under ``--fsdp``), ``commit`` (entering the step's
commit, a rescuable run's step boundary: [Note: rescue]), ``optimizer`` (after the commit,
before the update) or ``checkpoint`` (before the step's checkpoint is written; a step without
one never reaches it).
``KIND``: ``kill`` (SIGKILL itself: no cleanup, as an OOM kill or a lost machine), ``raise``
(``InjectedFault``, a Python exception) or ``hang`` (sleep until killed; peers wait for their
collective timeout). The fault fires once per run: the launcher disarms it (sets it empty) for
the groups it starts after a failure. torchft's ``EventInjector().fail_at(rank, step)`` is the
model.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable

__all__ = ["ENV", "KINDS", "PHASES", "Fault", "InjectedFault", "at_step", "check_env", "parse",
           "point"]

ENV = "SUBNETDP_FAULT"
PHASES = ("forward", "backward", "reduce", "commit", "optimizer", "checkpoint")
KINDS = ("kill", "raise", "hang")


class InjectedFault(RuntimeError):
    """The exception of a ``raise`` fault."""


@dataclasses.dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    phase: str
    kind: str


def parse(spec: str) -> Fault | None:
    """The fault ``spec`` names (None for an empty one); ``ValueError`` saying how to write it."""
    if not spec.strip():
        return None
    how = (f"{ENV}={spec!r} is not RANK:STEP:PHASE:KIND (e.g. 1:5:reduce:kill; phases "
           f"{', '.join(PHASES)}; kinds {', '.join(KINDS)})")
    parts = spec.strip().split(":")
    if len(parts) != 4 or not parts[0].isdigit() or not parts[1].isdigit():
        raise ValueError(how)
    fault = Fault(int(parts[0]), int(parts[1]), parts[2], parts[3])
    if fault.step < 1 or fault.phase not in PHASES or fault.kind not in KINDS:
        raise ValueError(how)
    return fault


def check_env(world: int, *, first: int = 1, last: int | None = None,
              unreached: Callable[[str, int], str | None] | None = None) -> None:
    """Refuse, before any worker starts, a malformed ``SUBNETDP_FAULT`` or one that would never
    fire: a rank the run lacks, a step outside ``first..last`` (the steps this run trains), or
    a phase the run never reaches at that step (``unreached(phase, step)``: why, or None)."""
    fault = parse(os.environ.get(ENV, ""))
    if fault is None:
        return
    if fault.rank >= world:
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


def at_step(step: int) -> None:
    """The training loop starts step ``step``."""
    global _step
    _step = step


def point(phase: str) -> None:
    """This worker reaches ``phase`` of the current step: fail here if the fault says so."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    fault = parse(spec)
    if fault is None or fault.phase != phase or fault.step != _step or fault.rank != _rank():
        return
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "raise":
        raise InjectedFault(f"injected fault: rank {fault.rank}, step {fault.step}, {phase}")
    while True:  # hang
        time.sleep(3600)


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))
