"""Heterogeneous workers in ``subnetdp train``: ``--capacities`` and ``--memory-gb``.

``--capacities 1,0.5,0.5,0.5``: every rank builds the same balanced plan (deterministic, from
the cost model) with rank i holding about ``capacities[i]`` of the units' cost. ``--memory-gb
80,40,40,40``: the launching process turns the budgets into such a plan (balanced on memory)
with ``estimate.hetero.plan_for_budgets`` (every rank checked by the fake-tensor estimator,
which needs a process without a process group), writes it to the run folder and hands the
workers that plan file, so they never run the estimator. Both refuse bad input before any
worker starts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from subnetdp.train.config import TrainConfig

BUDGET_PLAN = "budget_plan.json"  # in the run folder: the plan --memory-gb made


def prepare_hetero(cfg: TrainConfig, world: int, *, worker: bool = False) -> TrainConfig:
    """Before the workers start: check the number of values against the world, and turn
    --memory-gb into a plan file in the run folder (the returned config names it).
    ``worker``: this process is already one of the workers (torchrun)."""
    values = cfg.capacities if cfg.capacities is not None else cfg.memory_gb
    if values is None:
        return cfg
    if worker and cfg.memory_gb is not None:
        raise ValueError("under torchrun, make the plan first: subnetdp plan --recipe ... "
                         "--memory-gb ... --save plan.json, then train with --plan-file "
                         "plan.json")
    name = "--capacities" if cfg.capacities is not None else "--memory-gb"
    if len(values) != world:
        raise ValueError(f"{name} has {len(values)} values for {world} workers; give one per "
                         "worker (or change --nproc)")
    if cfg.memory_gb is None:
        return cfg
    from subnetdp.estimate.hetero import BudgetError, format_budget_plan, plan_for_budgets
    from subnetdp.estimate.spec import BenchSpec, make_bench_plan, meta_model

    assert cfg.batch_size is not None
    spec = BenchSpec(recipe=cfg.recipe, strategy=cfg.strategy, world=world,
                     batch=cfg.batch_size, seq=max(2, cfg.seq_len or 2), dtype=cfg.dtype,
                     fsdp=cfg.fsdp, ac=cfg.ac, seed=cfg.seed, bucket_cap_mb=cfg.bucket_cap_mb,
                     zero=cfg.zero if cfg.strategy_value.is_sdp else 0,
                     model_args=tuple(sorted(cfg.model_args.items())),
                     min_holders=cfg.min_holders)
    try:
        bp = plan_for_budgets(spec, cfg.memory_gb)
    except BudgetError as e:
        raise ValueError(str(e)) from None
    recipe, meta = meta_model(bp.spec)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / BUDGET_PLAN).write_text(make_bench_plan(bp.spec, meta, recipe).to_json() + "\n")
    if cfg.progress:
        print(format_budget_plan(bp))
    return dataclasses.replace(cfg, memory_gb=None, plan_file=str(out / BUDGET_PLAN))
