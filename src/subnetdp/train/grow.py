"""Grow back: workers that join a running group at a step boundary, their state received from
the holders, with no checkpoint read and no step replayed.

[Note: growing a run]
``train --max-nproc M`` (local launches): the launcher starts ``M`` worker processes while the
run trains with ``--nproc N`` of them (the *members*, ranks ``0..N-1``); the other ``M - N``
are *joiners*. After an elastic shrink ([Note: elastic shrink] in train/elastic.py) the next
group again gets joiners up to ``M``: a killed worker is restarted and rejoins. The steps:

1. A joiner announces itself in the launch's store (``ready/<rank>``) and waits.
2. After each step the members agree, in one scalar all-reduce, whether every joiner has
   announced itself (rank 0 looks; the all-reduce tells the others, so all decide at the same
   step). The last step never grows.
3. At the agreed step ``S`` every member flushes its metrics (a log step), writes a checkpoint
   if one is due, takes what its checkpoint file would hold (``Checkpointer.owned_state``: the
   pieces it owns and their optimizer state, the schedule, the step) into memory, and leaves
   its group; rank 0 admits the joiners (``admit``: the new world and ``S``).
4. Members and joiners form a new group of ``N + J`` ranks (a store prefix of its own), and
   all-gather the members' states: every rank then holds the checkpoint of step ``S`` in
   memory (``HeldCheckpoint``), each piece from its owner. Each re-plans for the larger world
   and loads it as ``--resume <step S> --reshard`` would load the same checkpoint from files
   (``Checkpointer.restore_held``): the same values, every rank reseeded from (seed, S, rank).
5. Training goes on from step ``S + 1``. Nothing is replayed or lost: the continued run
   equals, bit for bit, ``train --resume RUN/checkpoints/step_S --reshard --nproc N+J``
   (tests/faults/test_grow.py).

Costs: one scalar all-reduce per step while joiners wait, one store lookup per step on rank 0,
and at the growth every rank receives the whole model and optimizer state once (an
all-gather; a joiner needs only its held part: sending each rank only its pieces is the next
step). When the members finish without growing, rank 0 tells the joiners (``admit`` = done),
which end without training. Under torchrun, growth is torchrun's: ``--nnodes MIN:MAX``
re-forms the group with the new node and every worker resumes the newest checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from subnetdp.checkpoint.checkpointer import Checkpointer, RunStoppedError
from subnetdp.checkpoint.reshard import HeldCheckpoint
from subnetdp.distributed.process_group import init_group, shutdown_distributed
from subnetdp.distributed.timeouts import naming_silent_ranks, slow_timeout
from subnetdp.plan import Plan, PlanError
from subnetdp.train.config import TrainConfig

__all__ = ["GrowAt", "Growth", "check_growth", "grow_worker", "grows"]

POLL_S = 0.2  # how often a waiting joiner looks for its admission


class GrowAt(Exception):  # not an error: the members' way out of the loop
    """The members leave their group after step ``step`` to form a larger one; ``state`` is
    this rank's ``Checkpointer.owned_state``."""

    def __init__(self, step: int, state: tuple[dict[str, torch.Tensor], dict[str, Any]]) -> None:
        super().__init__(f"growing after step {step}")
        self.step, self.state = step, state


def check_growth(cfg: TrainConfig, make: Callable[[int, int], Plan]) -> None:
    """Refuse, before any worker starts, a ``--max-nproc`` world that cannot be planned
    (``make(world, min_holders)``: the run's plan); one line naming the cause."""
    if cfg.max_nproc is None or cfg.max_nproc == cfg.nproc:
        return
    grow = f"--max-nproc {cfg.max_nproc} grows the run beyond --nproc {cfg.nproc}"
    if cfg.plan_file:
        raise ValueError(f"{grow}, which a --plan-file (a plan for {cfg.nproc} workers) cannot "
                         "plan; use --coverage/--scheme, or drop --max-nproc")
    if cfg.capacities is not None or cfg.memory_gb is not None:
        flag = "--capacities" if cfg.capacities is not None else "--memory-gb"
        raise ValueError(f"{grow}, but {flag} gives one value per worker of --nproc; drop one "
                         "of them")
    try:
        make(cfg.max_nproc, cfg.min_holders)
    except PlanError as e:
        raise PlanError(f"{grow}, where its plan fails ({str(e).rstrip('.')})") from None


def grows(cfg: TrainConfig) -> bool:
    """This worker is one of a launch with joiners ([Note: growing a run])."""
    return cfg.max_nproc is not None and int(os.environ.get("WORLD_SIZE", "1")) > cfg.nproc


class _Keys:
    """The launch's growth keys (torch elastic's restart count apart: a restarted group's)."""

    def __init__(self) -> None:
        self.root = f"subnetdp/grow/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.admit = f"{self.root}/admit"

    def ready(self, rank: int) -> str:
        return f"{self.root}/ready/{rank}"

    def group(self, generation: int) -> str:
        return f"{self.root}/group{generation}"


class Growth:
    """The members' side of [Note: growing a run]: ``due`` after each step, ``handover`` at
    the agreed one."""

    def __init__(self, store: dist.Store, *, rank: int, joiners: list[int], last: int) -> None:
        self.store, self.rank, self.joiners, self.last = store, rank, joiners, last
        self.keys = _Keys()
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if dist.get_backend() == "nccl" else torch.device("cpu"))

    def due(self, done: int) -> bool:
        """Every joiner is waiting (agreed by all ranks: collective); never after the last."""
        if done >= self.last:
            return False
        ready = self.rank == 0 and self.store.check([self.keys.ready(j) for j in self.joiners])
        flag = torch.tensor([1.0 if ready else 0.0], device=self.device)
        dist.all_reduce(flag)
        return bool(flag.item() > 0)

    def handover(self, done: int, ckpt: Checkpointer) -> GrowAt:
        """This rank's state after step ``done``, to leave the loop with (collective)."""
        return GrowAt(done, ckpt.owned_state(done))


Run = Callable[..., dict[str, Any]]  # trainer._run(cfg, rank, world, plan, held=, grow=)


def grow_worker(cfg: TrainConfig, plan: Plan | None, run: Run) -> dict[str, Any]:
    """One worker of a launch with joiners: a member trains, grows, and goes on; a joiner
    waits, is admitted and goes on ([Note: growing a run]). Returns ``run``'s stats (a joiner
    never admitted: ``{"joined": False}``)."""
    launched, timeout = int(os.environ["RANK"]), slow_timeout(cfg.collective_timeout)
    store = _launch_store(launched, timeout)
    joiners = list(range(cfg.nproc, int(os.environ["WORLD_SIZE"])))
    keys = _Keys()
    try:
        if launched in joiners:
            store.set(keys.ready(launched), "1")
            admitted = _admission(store, keys)
            if admitted is None:
                return {"joined": False}
            state = None
        else:
            ended = _member(cfg, plan, run, store, keys, joiners, timeout)
            if not isinstance(ended, GrowAt):
                return ended
            state = ended.state
        rank, world = launched, cfg.nproc + len(joiners)
        init_group(dist.PrefixStore(keys.group(1), store), rank=rank, world=world,
                   backend=_backend(cfg), timeout=timeout)
        held = _gathered(state, world)
        if rank == 0:
            print(f"grew to {world} workers after step {held.manifest['step']}: the joiners "
                  "received their state from the holders (no checkpoint read, no step "
                  "replayed)", flush=True)
        # the launch's nodes (torchrun's variables: [Note: emulated nodes]), the joiners' too
        nnodes = min(world, int(os.environ.get("GROUP_WORLD_SIZE", "1")))
        grown = dataclasses.replace(cfg, nproc=world, reshard=True, nnodes=nnodes)
        with naming_silent_ranks(rank, world):
            return run(grown, rank, world, None, held=held)
    except RunStoppedError as e:  # as train_worker: every rank stopped at the same step
        return {"error": str(e)}
    finally:
        shutdown_distributed()


def _member(cfg: TrainConfig, plan: Plan | None, run: Run, store: dist.Store, keys: _Keys,
            joiners: list[int], timeout: float) -> dict[str, Any] | GrowAt:
    """A member's run in the first group, until it ends (its stats) or grows (``GrowAt``,
    the group left); rank 0 then admits the joiners, or tells them the run ended, whatever
    ended it (a joiner never waits on a group that is gone)."""
    rank, world = int(os.environ["RANK"]), cfg.nproc
    said: dict[str, Any] = {"done": True}
    try:
        init_group(dist.PrefixStore(keys.group(0), store), rank=rank, world=world,
                   backend=_backend(cfg), timeout=timeout)
        with naming_silent_ranks(rank, world):
            return run(cfg, rank, world, plan,
                       grow=Growth(store, rank=rank, joiners=joiners, last=cfg.steps))
    except GrowAt as g:
        said = {"world": world + len(joiners), "step": g.step}
        shutdown_distributed()
        return g
    finally:
        if rank == 0:
            with contextlib.suppress(RuntimeError):  # the store's host may be gone
                store.set(keys.admit, json.dumps(said))


def _backend(cfg: TrainConfig) -> str | None:
    return "gloo" if cfg.device == "cpu" else None


def _launch_store(launched: int, timeout: float) -> dist.Store:
    """The launch's TCP store: the elastic agent's, or (``--max-restarts``: the agent keeps
    its own) one hosted by launched rank 0, as torch's ``env://`` rendezvous makes it."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=not agent and launched == 0,
                         timeout=timedelta(seconds=timeout), wait_for_workers=False)


def _admission(store: dist.Store, keys: _Keys) -> dict[str, Any] | None:
    """Wait until rank 0 admits the joiners (the new world) or ends the run (None); a store
    that went away is a run that ended too."""
    try:
        while not store.check([keys.admit]):
            time.sleep(POLL_S)
        said = json.loads(store.get(keys.admit))
    except RuntimeError:  # the store's host ended
        return None
    return None if said.get("done") else dict(said)


def _gathered(state: tuple[dict[str, torch.Tensor], dict[str, Any]] | None,
              world: int) -> HeldCheckpoint:
    """Every member's state on every rank (a joiner gives none): the checkpoint of the
    growth step, in memory."""
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, state)
    return HeldCheckpoint.merged([p for p in parts if p is not None])
