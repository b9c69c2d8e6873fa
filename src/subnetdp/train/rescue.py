"""Rescue, the workers' side: the step boundary of a rescuable run, and saving what a rank holds
when a peer is lost. The launcher's side (composing a checkpoint from what the survivors saved)
is ``checkpoint/rescue.py``.

[Note: rescue]
A run with ``--min-nproc`` whose plan gives every unit two or more holders holds the whole model
several times over; when a worker is lost, the survivors together still hold it, so the run can
go on from the step in flight instead of from the newest checkpoint.

The step boundary (a commit). Each rank reduces its gradients (holder groups), computes the
clipped norm, then enters a *commit*: a one-element all-reduce over the whole world, and only
after it returns applies the update (``opt.step``, ``sched.step``). A rank keeps two facts:
``applied`` (the last step whose update it applied) and ``ready`` (it entered the commit of
step ``applied + 1``: its reduced, clipped gradients are complete and still in place).

Claim: the survivors always share a step at which each of them can save its exact state.
- An all-reduce returns on a rank only after every rank contributed: if any rank applied step
  ``s``, every rank entered the commit of ``s``, so every survivor is ready for ``s`` or
  applied it. No rank can apply ``s + 1`` before every rank applied ``s`` (or entered its
  commit), so the survivors' ``applied`` differ by at most one.
- On a lost peer (a collective fails or times out, or the launcher's stop signal arrives) a
  survivor saves its state at ``applied``; if it is ``ready`` it then applies the update
  itself, *rolling forward* (the update needs only its own reduced gradients, optimizer state
  and schedule, exactly what the commit would have released), and saves ``applied + 1`` too.
- So if some survivor applied ``s``, all survivors have a save at ``s``; if none did, all
  have one at ``s - 1``. The launcher takes the newest step that every survivor saved.
No survivor ever mixes steps: every file of the composed checkpoint is of one step, and each
value is what the uninterrupted run has at that step (the oracle test checks it bit for bit).
The cost: one scalar all-reduce per step, and only in rescuable runs.

What is saved (``Checkpointer.save_held``): every piece this rank holds (not only those it
owns), their optimizer state, the LR schedule and the step, with a checksum per tensor; no
collective, so a lost peer cannot block it. RNG streams are not saved: the continuation is a
resharded resume, which reseeds every rank ([Note: resharded resume]).

When it cannot work, the launcher falls back to the newest checkpoint ([Note: elastic shrink])
and says why in one line: a unit whose only holder was lost (a single-holder plan), copies that
disagree (checksums), survivors without a common step, or a run whose holder groups shard
their state (``--zero``, ``--fsdp``: a lost rank's shard exists nowhere else; a second replica
of each shard is not built). Metrics lines of the steps since the last log step are not
written for the steps rescued (they wait for a collective that cannot happen).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from subnetdp.checkpoint.checkpointer import Checkpointer, RunStoppedError
from subnetdp.checkpoint.rescue import rescue_attempt_dir
from subnetdp.distributed import faults
from subnetdp.train.grow import GrowAt

__all__ = ["StepCommit", "rescue_blocker", "rescue_enabled", "save_rescue", "unreached_phase"]


def rescue_blocker(cfg: Any) -> str | None:
    """Why a run with this configuration cannot be rescued (None: it can, plan permitting)."""
    if cfg.min_nproc is None:
        return "the run is not elastic (no --min-nproc)"
    if not cfg.rescue:
        return "--no-rescue"
    if cfg.zero:
        return (f"--zero {cfg.zero} shards each holder group's optimizer state, so a lost "
                "rank's shard exists nowhere else")
    if cfg.fsdp:
        return "--fsdp shards each holder group's parameters, so a lost rank's shard exists " \
               "nowhere else"
    if cfg.sync_every > 1:
        return (f"--sync-every {cfg.sync_every}: between syncs each holder has its own copy, "
                "so the survivors do not hold a lost rank's")
    return None


def unreached_phase(cfg: Any, phase: str, step: int) -> str | None:
    """Why a run with this configuration never reaches fault ``phase`` at ``step`` (None: it
    does), so that a ``SUBNETDP_FAULT`` that could never fire is refused before the start."""
    if phase == "commit" and (blocker := rescue_blocker(cfg)) is not None:
        return f"only a rescuable run commits its steps, and this one is not: {blocker}"
    if phase == "reduce" and cfg.fsdp:
        return "--fsdp reduces in FSDP's own hooks, not the holder groups' reducer"
    if phase == "checkpoint" and not cfg.saves_at(step):
        return (f"no checkpoint is written at step {step}: --ckpt-every {cfg.ckpt_every}, "
                f"--steps {cfg.steps}" + ("" if cfg.save_final else ", no final checkpoint"))
    return None


def rescue_enabled(cfg: Any) -> bool:
    return rescue_blocker(cfg) is None


class StepCommit:
    """The step boundary of [Note: rescue]: ``reduced`` before the update, ``applied_step``
    after it. Disabled, both do nothing."""

    def __init__(self, enabled: bool, *, applied: int, device: torch.device) -> None:
        self.enabled, self.applied, self.ready = enabled, applied, False
        self._flag = torch.ones(1, device=device) if enabled else None

    def reduced(self) -> None:
        if self._flag is None:
            return
        self.ready = True
        faults.point("commit")
        dist.all_reduce(self._flag)  # returns once every rank has entered it

    def applied_step(self) -> None:
        self.applied += 1
        self.ready = False


@contextlib.contextmanager
def save_rescue(commit: StepCommit, ckpt: Checkpointer, opt: torch.optim.Optimizer, sched: Any,
                out: Path) -> Iterator[None]:
    """On a failure inside the block (a lost peer's collective error or timeout, the
    launcher's stop), save this rank's state at its last applied step and, when ready, at the
    next one, rolled forward ([Note: rescue]); then let the failure go on."""
    try:
        yield
    except BaseException as e:
        # the run's own agreed stop, Ctrl-C, an injected crash of this rank, a growth
        # ([Note: growing a run], train/grow.py) and a rank whose process group was aborted
        # under it (the lost one: its peers saw it go) save nothing
        if commit.enabled and dist.is_initialized() and not isinstance(
                e, RunStoppedError | KeyboardInterrupt | faults.InjectedFault | GrowAt):
            _save(commit, ckpt, opt, sched, out)
        raise


def _save(commit: StepCommit, ckpt: Checkpointer, opt: torch.optim.Optimizer, sched: Any,
          out: Path) -> None:
    folder = rescue_attempt_dir(out)
    try:
        ckpt.save_held(folder, commit.applied)
        if commit.ready:  # roll forward: the commit's release, done here
            with torch.no_grad():
                opt.step()
            sched.step()
            commit.applied_step()
            ckpt.save_held(folder, commit.applied)
    except Exception as e:  # the original failure goes on regardless
        print(f"rank {ckpt.rank}: rescue save failed: {e}", file=sys.stderr)
