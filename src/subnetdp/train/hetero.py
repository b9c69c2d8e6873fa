"""Heterogeneous workers in ``subnetdp train``: ``--capacities`` and ``--memory-gb``.

``--capacities 1,0.5,0.5,0.5``: every rank builds the same balanced plan (deterministic, from
the cost model) with rank i holding about ``capacities[i]`` of the units' cost. ``--memory-gb
80,40,40,40``: the launching process turns the budgets into such a plan (balanced on memory)
with ``estimate.hetero.plan_for_budgets`` (every rank checked by the fake-tensor estimator,
which needs a process without a process group) before the pre-launch checks, which check that
plan; it is written to the run folder and handed to the workers, so they never run the
estimator. Both refuse bad input before any worker starts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from subnetdp.filemode import write_atomic
from subnetdp.plan import Plan
from subnetdp.train.config import TrainConfig

BUDGET_PLAN = "budget_plan.json"  # in the run folder: the plan --memory-gb made


def check_world(cfg: TrainConfig, world: int, *, worker: bool = False) -> None:
    """Before the workers start: one --capacities/--memory-gb value per worker.
    ``worker``: this process is already one of the workers (torchrun)."""
    values = cfg.capacities if cfg.capacities is not None else cfg.memory_gb
    if values is None:
        return
    if worker and cfg.memory_gb is not None:
        raise ValueError("under torchrun, make the plan first: subnetdp plan --recipe ... "
                         "--memory-gb ... --save plan.json, then train with --plan-file "
                         "plan.json")
    name = "--capacities" if cfg.capacities is not None else "--memory-gb"
    if len(values) != world:
        raise ValueError(f"{name} has {len(values)} values for {world} workers; give one per "
                         "worker (or change --nproc)")


def budget_plan(cfg: TrainConfig, world: int) -> Plan | None:
    """--memory-gb: the balanced plan in which every rank's estimated peak fits its budget
    (None without --memory-gb). Made before the pre-launch checks, which check this plan."""
    if cfg.memory_gb is None:
        return None
    check_world(cfg, world)
    from subnetdp.estimate.communicators import comm_mem_mb
    from subnetdp.estimate.hetero import (
        BudgetError,
        budget_spec,
        format_budget_plan,
        plan_for_budgets,
    )
    from subnetdp.train.device import device_name

    assert cfg.batch_size is not None
    # the communicators count as `plan --memory-gb` counts them; the run's collectives are
    # NCCL's on CUDA (distributed.process_group.init_distributed), gloo's on CPU
    nccl = device_name(cfg.device) == "cuda"
    # the one builder plan --memory-gb A,B,... uses too (--compile is estimated as eager)
    spec = budget_spec(cfg.recipe, cfg.strategy_value.name, world=world,
                       batch=cfg.batch_size, seq=max(2, cfg.seq_len or 2),
                       comp=cfg.composition(), model_args=cfg.model_args, seed=cfg.seed,
                       min_holders=cfg.min_holders,
                       comm_mem_mb=comm_mem_mb(cfg.comm_mem_mb, nccl=nccl))
    try:
        bp = plan_for_budgets(spec, cfg.memory_gb)
    except BudgetError as e:
        raise ValueError(str(e)) from None
    if cfg.progress:
        print(format_budget_plan(bp))
    return bp.plan()


def write_budget_plan(cfg: TrainConfig, plan: Plan | None) -> TrainConfig:
    """The --memory-gb plan into the run folder (once the folder is this run's); the returned
    config names it, so that a resume or a replay reads the same plan."""
    if plan is None or cfg.memory_gb is None:
        return cfg
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / BUDGET_PLAN, plan.to_json() + "\n")
    # the plan stands for the budgets it was made for (--memory-gb, --comm-mem-mb): a replay
    # of the recorded config.json reads it, not the budgets
    return dataclasses.replace(cfg, memory_gb=None, comm_mem_mb=None,
                               plan_file=str(out / BUDGET_PLAN))
