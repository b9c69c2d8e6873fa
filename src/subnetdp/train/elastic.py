"""Elastic shrink: a run that loses a worker for good goes on with the survivors.

[Note: elastic shrink]
Local launches (``--min-nproc N``): torch elastic first restarts the whole group at its size
(``--max-restarts``); when a worker died by a signal (killed, OOM-killed, its device gone) and
the restarts are used up, the launcher starts the group again without the workers lost (one
fewer for each), down to ``N``, resuming the newest checkpoint resharded ([Note: resharded
resume]); or, when the survivors' copies cover the whole model, from the step in flight, with
none replayed
([Note: rescue] in train/rescue.py). Every world it may reach is planned when the run
starts ([Note: shrinking plans] in plan/shrink.py), and a shrunk group re-plans with the
``--min-holders`` that decided. Under
``torchrun --nnodes MIN:MAX`` torch elastic itself re-forms the group with the nodes left; the
restarted workers resume the newest checkpoint and, seeing another world size, reshard.

What is kept, bit for bit: every value of the newest checkpoint (weights, optimizer state, LR
schedule position, step). What is replayed: the steps after that checkpoint, recomputed by the
survivors under the new plan, which differ from the first attempt's (new data split, new masks,
a smaller global batch). What is lost: the computation since the checkpoint, and the metrics
lines the lost rank wrote after it (dropped, so every file ends at the checkpoint before the
survivors continue). The data is not lost: batches are cut from the corpus by world size, so
the survivors' shards cover all of it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from subnetdp.checkpoint.files import checkpoints_root, newest_checkpoint, read_manifest
from subnetdp.checkpoint.rescue import RescueUnavailableError, clear_rescue, compose_rescue
from subnetdp.distributed import faults
from subnetdp.distributed.launch import WorkerFailedError, launch
from subnetdp.distributed.nodes import emulate_nodes
from subnetdp.distributed.process_group import under_launcher
from subnetdp.distributed.timeouts import (
    CollectiveTimeoutError,
    GroupAbortedError,
    lost_peer,
    named_silent,
)
from subnetdp.metrics.sinks import rank_jsonl_path
from subnetdp.plan import Plan
from subnetdp.plan.nodes import node_of
from subnetdp.plan.shrink import replan_blocker, shrink_plans
from subnetdp.train.config import TrainConfig, config_keys
from subnetdp.train.rescue import rescue_blocker
from subnetdp.train.resume import truncate_metrics

__all__ = ["check_replan_options", "launch_shrinking", "replanned", "rescued_config",
           "shrink_holders", "shrunk_config"]


def check_replan_options(cfg: TrainConfig) -> None:
    """Refuse ``--reshard``/``--min-nproc`` settings that cannot work, before anything starts."""
    if cfg.reshard and not cfg.resume:
        raise ValueError("--reshard re-plans a resumed checkpoint; use it with --resume RUN")
    if cfg.accept_new_data and not cfg.resume:
        raise ValueError("--accept-new-data accepts a changed corpus for a resumed run; use it "
                         "with --resume RUN")
    if cfg.min_nproc is None:
        return
    blocker = replan_blocker(nproc=cfg.nproc, min_nproc=cfg.min_nproc,
                             plan_file=bool(cfg.plan_file), capacities=cfg.capacities is not None,
                             memory_gb=cfg.memory_gb is not None)
    if blocker is not None:
        raise ValueError(blocker)
    if cfg.ckpt_every < 1:
        raise ValueError("--min-nproc continues from the newest checkpoint; add --ckpt-every N")


def shrink_holders(cfg: TrainConfig, make: Callable[[int, int], Plan]) -> dict[int, int]:
    """The ``--min-holders`` of each world the run may shrink to ([Note: shrinking plans] in
    plan/shrink.py; ``make(world, min_holders)``: the run's plan); ``PlanError`` (a
    ``ValueError``, one line) when one of them cannot be planned. Call after
    ``check_replan_options``."""
    if cfg.min_nproc is None:
        return {}
    return {r.world: r.min_holders for r in shrink_plans(
        make, nproc=cfg.nproc, min_nproc=cfg.min_nproc, min_holders=cfg.min_holders)}


def launch_shrinking(fn: Callable[..., Any], cfg: TrainConfig, *, run_id: str,
                     plan: Plan | None = None, start_method: str | None = None,
                     holders: dict[int, int] | None = None, **launch_kw: Any) -> dict[int, Any]:
    """``launch(fn, (cfg, plan), **launch_kw)``, shrinking by one worker after each loss for
    good ([Note: elastic shrink]). ``plan``: the run's plan, handed to the first group (a
    shrunk group re-plans for its world: ``fn`` then gets the config alone); ``holders``:
    ``shrink_holders``' answer. Returns the last attempt's ``{rank: result}``."""
    armed = os.environ.get(faults.ENV)
    nodes = cfg.nnodes  # the emulated machines: joiners replace a lost node's ranks
    try:
        while True:
            args = (cfg.to_dict(),) if plan is None else (cfg.to_dict(), plan)
            procs = max(cfg.nproc, cfg.max_nproc or 0)
            if not under_launcher():  # an earlier group's contributions never mix in
                clear_rescue(cfg.out)
            try:
                # --max-nproc: the workers beyond --nproc join at a step boundary (grow.py)
                return launch(emulate_nodes(fn, nodes if procs > cfg.nproc else cfg.nnodes),
                              args, nproc=procs, run_id=run_id, max_restarts=cfg.max_restarts,
                              start_method=start_method, **launch_kw)
            except WorkerFailedError as e:
                os.environ[faults.ENV] = ""  # an injected fault fires once per run
                smaller, why = rescued_config(cfg, e.silent)
                if smaller is not None:
                    cfg, plan = replanned(smaller, holders or {})
                    print(f"subnetdp train: {e.cause}; {why}{_fewer(cfg, smaller)}",
                          file=sys.stderr)
                    continue
                smaller = shrunk_config(cfg, e.failures)
                if smaller is None:
                    if why and newest_checkpoint(checkpoints_root(cfg.out)) is None:
                        print(f"subnetdp train: {e.cause}; no rescue: {why}; and no "
                              "checkpoint yet to fall back to", file=sys.stderr)
                    raise
                if why:
                    print(f"subnetdp train: no rescue: {why}; falling back to the newest "
                          "checkpoint", file=sys.stderr)
                went, plan = replanned(smaller, holders or {})
                print(f"subnetdp train: {e.cause}; {_lost(e.failures)} of {cfg.nproc} workers "
                      f"lost for good; going on with {smaller.nproc} from {smaller.resume} "
                      f"(resharded; the steps after it are replayed){_fewer(went, smaller)}",
                      file=sys.stderr)
                cfg = went
    finally:
        if armed is None:
            os.environ.pop(faults.ENV, None)
        else:
            os.environ[faults.ENV] = armed


def replanned(smaller: TrainConfig, holders: dict[int, int]) -> tuple[TrainConfig, None]:
    """The shrunk group's configuration with the ``--min-holders`` its world keeps
    ([Note: shrinking plans]), and no plan: the group re-plans for its world."""
    kept = holders.get(smaller.nproc, smaller.min_holders)
    return dataclasses.replace(smaller, min_holders=kept), None


def _fewer(went: TrainConfig, asked: TrainConfig) -> str:
    """What a shrunk world's plan gives up, said once in the shrink's line."""
    if went.min_holders == asked.min_holders:
        return ""
    return (f"; re-planned with --min-holders {went.min_holders} ({went.nproc} workers at "
            f"--coverage {went.coverage:g} cannot hold {asked.min_holders} copies of every unit, "
            f"and at --min-nproc {went.nproc} no loss is rescued)")


def rescued_config(cfg: TrainConfig, silent: Sequence[int] = ()) -> tuple[TrainConfig | None,
                                                                          str]:
    """The next attempt's configuration from the survivors' copies ([Note: rescue]) and the
    line that says so; or None and why not ("" when the run does not use rescue). ``silent``:
    ranks their peers' timeouts named (lost, whatever they saved)."""
    if cfg.min_nproc is None:
        return None, ""
    blocker = rescue_blocker(cfg)
    if blocker is not None:
        return None, blocker if cfg.rescue else ""
    try:
        ckpt, step, survivors = compose_rescue(cfg.out, silent)
    except RescueUnavailableError as e:
        return None, str(e)
    if len(survivors) < cfg.min_nproc:
        return None, f"{len(survivors)} survivors are fewer than --min-nproc {cfg.min_nproc}"
    # the lost group's world: --nproc, or more when it had grown ([Note: growing a run])
    world = int(read_manifest(ckpt, config_keys=config_keys())["world"])
    # the survivors stay on their nodes: a node whose every rank was lost is gone
    nodes = {node_of(r, world, cfg.nnodes) for r in survivors}
    smaller = dataclasses.replace(cfg, nproc=len(survivors), resume=str(ckpt), reshard=True,
                                  nnodes=len(nodes))
    for rank in range(smaller.nproc, world):  # the lost ranks' lines after the step
        truncate_metrics(rank_jsonl_path(Path(cfg.out), rank), step)
    lost = sorted(set(range(world)) - set(survivors))
    return smaller, (f"rank(s) {lost} of {world} lost; rescued step {step} from the "
                     f"survivors' copies ({ckpt}); going on with "
                     f"{smaller.nproc} workers, resharded, no step replayed")


def shrunk_config(cfg: TrainConfig, failures: dict[int, tuple[int, str]]) -> TrainConfig | None:
    """The next attempt's configuration after ``failures``: the workers that were not lost
    (a lost node takes several), or None if the run cannot shrink (no ``--min-nproc``, fewer
    left than it, no checkpoint yet, or a failure that is a Python exception: that would only
    fail again on fewer workers)."""
    lost = _lost(failures)
    if cfg.min_nproc is None or cfg.nproc - lost < cfg.min_nproc or not lost:
        return None
    if any(_own_error(code, text) for code, text in failures.values()):
        return None
    newest = newest_checkpoint(checkpoints_root(cfg.out))
    if newest is None:
        return None
    step = int(read_manifest(newest, config_keys=config_keys())["step"])
    smaller = dataclasses.replace(cfg, nproc=cfg.nproc - lost, resume=str(newest), reshard=True,
                                  nnodes=min(cfg.nnodes, cfg.nproc - lost))
    for rank in range(smaller.nproc, cfg.nproc):  # the lost ranks' lines after the checkpoint
        path = rank_jsonl_path(Path(cfg.out), rank)
        truncate_metrics(path, step)
    return smaller


def _lost(failures: dict[int, tuple[int, str]]) -> int:
    """Workers lost: dead by a signal other than the agent's own SIGTERM to the survivors,
    named silent by a peer's timeout, or with their process group aborted under them."""
    lost = {r for r, (code, text) in failures.items()
            if (code < 0 and -code != signal.SIGTERM) or GroupAbortedError.__name__ in text}
    return len(lost | {r for _, text in failures.values() for r in named_silent(text)})


def _own_error(code: int, text: str) -> bool:
    """A rank's own Python exception (it would fail again on fewer workers), not a lost peer,
    a timeout or an aborted group."""
    return code >= 0 and not lost_peer(text) and not any(
        e.__name__ in text for e in (CollectiveTimeoutError, GroupAbortedError))
