"""Model FLOPs of one rank's training step, for ``mfu(%)``."""

from __future__ import annotations

from typing import Any

import torch

from subnetdp.plan import Plan
from subnetdp.strategy import Strategy
from subnetdp.subnet.costs import example_input, measure_costs
from subnetdp.train.config import TrainConfig


def rank_step_flops(cfg: TrainConfig, recipe: Any, overrides: dict[str, Any], plan: Plan,
                    strategy: Strategy, rank: int) -> float | None:
    """Forward + backward FLOPs of this rank's step, counted on the meta device at the run's
    batch (``subnet.costs``): the shared part and the units the rank runs. Known for ddp (every
    unit) and b-sdp (its held units); None for the neuron-level and backward-masked strategies,
    whose per-rank work the per-unit counts do not describe. Activation recomputation (--ac) is
    not model FLOPs and is not counted, as in torchtitan."""
    if strategy.is_sdp and not strategy.drops_blocks:
        return None
    assert cfg.batch_size is not None
    with torch.device("meta"):
        model = recipe.build_model(**overrides)
    seq = cfg.seq_len if recipe.task == "lm" else None
    costs = measure_costs(model, recipe.adapter,
                          example_input(recipe.task, recipe.defaults, cfg.batch_size, seq),
                          seq=seq)
    held = range(len(costs.units)) if not strategy.is_sdp else plan.held_units(rank)
    return float(costs.shared.flops + sum(costs.units[u].flops for u in held))
