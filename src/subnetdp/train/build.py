"""From a run's config to its plan, this rank's model (``parallelize``) and its optimizer."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from subnetdp.filemode import write_atomic
from subnetdp.models import Recipe
from subnetdp.parallelize import outer_loop, parallelize
from subnetdp.plan import Plan
from subnetdp.runtime.local_steps import LocalSteps
from subnetdp.runtime.optim import fast_path
from subnetdp.runtime.rank import RankModel
from subnetdp.subnet.planning import build_plan
from subnetdp.train.config import TrainConfig


def run_plan(cfg: TrainConfig, model: nn.Module, recipe: Recipe, world: int) -> Plan:
    """The run's plan (``subnet.planning.build_plan``): from --plan-file or the scheme; balanced
    plans balance the units' costs measured at the run's batch."""
    def costs(balance: str) -> Any:
        from subnetdp.subnet.costs import recipe_costs

        return recipe_costs(recipe, batch=cfg.batch_size, seq=cfg.seq_len,
                            model_args=cfg.model_args).weights(balance)

    return build_plan(model, recipe.adapter, cfg.strategy_value, cfg.plan_spec, world=world,
                      costs=costs)


def replanner(cfg: TrainConfig, overrides: dict[str, Any]) -> Callable[[int, int], Plan]:
    """``(world, min_holders) -> run_plan``: the run's plan for another world, as a shrunk
    group makes it ([Note: shrinking plans] in plan/shrink.py); the model on the meta device."""
    from subnetdp.models import get_recipe

    recipe = get_recipe(cfg.recipe)
    with torch.device("meta"):
        model = recipe.build_model(**overrides)
    return lambda world, holders: run_plan(dataclasses.replace(cfg, min_holders=holders), model,
                                           recipe, world)


def build_rank(
    cfg: TrainConfig, recipe: Recipe, plan: Plan, device: torch.device, overrides: dict[str, Any]
) -> RankModel:
    """This rank's model for the run (``subnetdp.parallelize``), built from a meta model so
    that SDP never allocates units this rank does not hold."""
    with torch.device("meta"):
        model = recipe.build_model(**overrides)
    return parallelize(
        model, adapter=recipe.adapter, strategy=cfg.rank_spec, plan=plan, device=device,
        seed=cfg.seed, prepare_full=lambda full: apply_ddp_baselines(cfg, recipe, full),
        # a block skipped by stochastic depth on this rank has no gradient here
        find_unused_parameters=cfg.stochastic_depth > 0,
    )


def apply_ddp_baselines(cfg: TrainConfig, recipe: Recipe, model: nn.Module) -> None:
    """Stochastic depth / neuron dropout on the full model of a DDP run (the baselines SDP's
    block and neuron constructions come from); masks drawn independently on every rank."""
    if cfg.stochastic_depth <= 0 and cfg.neuron_dropout <= 0:
        return
    from subnetdp.subnet.regularize import (
        apply_neuron_dropout,
        apply_stochastic_depth,
        rank_generator,
    )

    rank = dist.get_rank() if dist.is_initialized() else 0
    if cfg.stochastic_depth > 0:
        apply_stochastic_depth(model, recipe.adapter, cfg.stochastic_depth,
                               rank_generator(cfg.seed, rank))
    if cfg.neuron_dropout > 0:
        kinds = set(cfg.neuron_kinds.split(",")) if cfg.neuron_kinds else None
        apply_neuron_dropout(model, recipe.adapter, cfg.neuron_dropout,
                             rank_generator(cfg.seed + 7777, rank), kinds=kinds)


def make_optimizer(
    cfg: TrainConfig, recipe: Recipe, rank: RankModel
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW or SGD as the recipe says, fused on CUDA (``runtime.optim.fast_path``); no weight
    decay on vectors (norms, biases); linear warm-up then cosine decay to 10% of the peak."""
    assert cfg.lr is not None and cfg.weight_decay is not None and cfg.warmup is not None
    # Frozen parameters (the user's, and non-held ones under backward masking) are not in
    # rank.parameters(): no optimizer state, no weight decay.
    params = list(rank.parameters())
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # fused on CUDA, whatever the meshes; foreach over DTensors elsewhere ([Note: optimizers
    # across meshes])
    impl = fast_path(params[0].device.type,
                     dtensors=any(isinstance(p, DTensor) for p in params)) if params else {}
    # rank.optimizer: the optimizer class over these groups, on shards under --zero
    opt: torch.optim.Optimizer
    if recipe.defaults.get("optimizer", "adamw") == "sgd":
        opt = rank.optimizer(torch.optim.SGD, groups, lr=cfg.lr,
                             momentum=recipe.defaults.get("momentum", 0.9), **impl)
    else:
        opt = rank.optimizer(torch.optim.AdamW, groups, lr=cfg.lr, betas=(0.9, 0.95), **impl)
    warmup, steps = cfg.warmup, cfg.steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def local_steps(cfg: TrainConfig, model: RankModel, plan: Plan, opt: torch.optim.Optimizer,
                start: int) -> LocalSteps | None:
    """The outer loop of ``--sync-every H`` (``runtime.local_steps``) continuing after step
    ``start``; None at H = 1, where every step averages gradients as before."""
    if cfg.sync_every == 1:
        return None
    return outer_loop(model, plan, opt, every=cfg.sync_every, start=start, end=cfg.steps,
                      lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                      fragments=cfg.sync_fragments, outer_dtype=cfg.outer_dtype,
                      bucket_cap_mb=cfg.bucket_cap_mb)


def save_plan(plan: Plan, path: Path) -> None:
    write_atomic(path, json.dumps(plan.to_dict(), indent=1))
