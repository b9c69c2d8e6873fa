"""From a config to a wrapped model, its plan and its optimizer (DDP or SDP)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from subnetdp.models import Recipe
from subnetdp.plan import Plan, make_plan
from subnetdp.runtime import SubnetDataParallel
from subnetdp.subnet.build import build_full_model
from subnetdp.subnet.neurons import make_neuron_plan
from subnetdp.subnet.units import describe_units
from subnetdp.train.config import TrainConfig


@dataclass
class DDPCommCounter:
    """Counts the bytes torch DDP all-reduces, through a comm hook that then does exactly
    what DDP's default does (divide by the world size, all-reduce)."""

    total_bytes: int = 0
    buckets: list[int] = field(default_factory=list)

    def make_hook(self) -> Any:
        # No annotations on purpose: DDP checks them at registration and rejects the strings
        # that `from __future__ import annotations` turns them into.
        def hook(_state, bucket):  # type: ignore[no-untyped-def]
            buf = bucket.buffer()
            self.total_bytes += buf.numel() * buf.element_size()
            return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

        return hook


def build_plan(cfg: TrainConfig, model: nn.Module, recipe: Recipe, world: int) -> Plan:
    """The run's plan: from --plan-file, or from the scheme; DDP is the everyone-holds-all plan."""
    if cfg.plan_file:
        plan = Plan.from_json(Path(cfg.plan_file).read_text())
        plan.validate(world)
        return plan
    if cfg.strategy in ("n-sdp", "nb-sdp"):
        return make_neuron_plan(model, recipe.adapter, world=world, coverage=cfg.coverage,
                                scheme=cfg.scheme, seed=cfg.seed, groups=cfg.neuron_groups,
                                kinds=cfg.neuron_kinds, rotate=cfg.rotate)
    units, shared = describe_units(model, recipe.adapter)
    coverage = 1.0 if cfg.strategy == "ddp" else cfg.coverage
    return make_plan(world=world, units=units, coverage=coverage, scheme=cfg.scheme,
                     seed=cfg.seed, shared_size=shared)


def wrap_model(
    cfg: TrainConfig, recipe: Recipe, plan: Plan, device: torch.device, overrides: dict[str, Any]
) -> tuple[nn.Module, DDPCommCounter | None]:
    """DDP: the full model under torch's own DDP. SDP: SubnetDataParallel on a meta model, so
    units this rank does not hold are never allocated."""
    with torch.device("meta"):
        model = recipe.build_model(**overrides)
    if cfg.strategy == "ddp":
        full = build_full_model(model, recipe.adapter, device=device, seed=cfg.seed)
        ids = [device.index] if device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel(
            full, device_ids=ids, bucket_cap_mb=cfg.bucket_cap_mb
        )
        counter = DDPCommCounter()
        if dist.get_world_size() > 1:
            ddp.register_comm_hook(None, counter.make_hook())
        return ddp, counter
    sdp = SubnetDataParallel(model, plan=plan, adapter=recipe.adapter, strategy=cfg.strategy,
                             device=device, init_seed=cfg.seed, bucket_cap_mb=cfg.bucket_cap_mb,
                             output_scaling=cfg.output_scaling, refresh_every=cfg.refresh_every)
    return sdp, None


def make_optimizer(
    cfg: TrainConfig, recipe: Recipe, model: nn.Module
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW or SGD as the recipe says; no weight decay on vectors (norms, biases); linear
    warm-up then cosine decay to 10% of the peak."""
    assert cfg.lr is not None and cfg.weight_decay is not None and cfg.warmup is not None
    # requires_grad: under backward masking, non-held parameters are frozen (no state at all).
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    opt: torch.optim.Optimizer
    if recipe.defaults.get("optimizer", "adamw") == "sgd":
        opt = torch.optim.SGD(groups, lr=cfg.lr, momentum=recipe.defaults.get("momentum", 0.9))
    else:
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
    warmup, steps = cfg.warmup, cfg.steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def save_plan(plan: Plan, path: Path) -> None:
    path.write_text(json.dumps(plan.to_dict(), indent=1))
