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
from subnetdp.runtime.checkpointing import checkpoint_blocks
from subnetdp.runtime.fsdp import shard_over_mesh
from subnetdp.subnet.build import build_full_model
from subnetdp.subnet.neurons import make_neuron_plan
from subnetdp.subnet.units import describe_units, unit_modules
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
) -> tuple[nn.Module, DDPCommCounter | FSDPCommCounter | None]:
    """DDP: the full model under torch's own DDP (``--fsdp``: FSDP2 over the world). SDP:
    SubnetDataParallel on a meta model, so units this rank does not hold are never
    allocated."""
    with torch.device("meta"):
        model = recipe.build_model(**overrides)
    param_dtype = COMPUTE_DTYPES[cfg.dtype]
    if cfg.strategy == "ddp":
        full = build_full_model(model, recipe.adapter, device=device, seed=cfg.seed)
        if cfg.ac:
            checkpoint_blocks(full, [name for name, _ in unit_modules(full, recipe.adapter)])
        if cfg.fsdp:
            return fully_shard_baseline(full, recipe, device, param_dtype,
                                        REDUCE_DTYPES[cfg.reduce_dtype or "fp32"])
        apply_ddp_baselines(cfg, recipe, full)
        if param_dtype is not None:
            autocast_forward(full, param_dtype)
        ids = [device.index] if device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel(
            full, device_ids=ids, bucket_cap_mb=cfg.bucket_cap_mb,
            # a block skipped by stochastic depth on this rank has no gradient here
            find_unused_parameters=cfg.stochastic_depth > 0,
        )
        counter = DDPCommCounter()
        if dist.get_world_size() > 1:
            ddp.register_comm_hook(None, counter.make_hook())
        return ddp, counter
    sdp = SubnetDataParallel(model, plan=plan, adapter=recipe.adapter, strategy=cfg.strategy,
                             device=device, init_seed=cfg.seed, bucket_cap_mb=cfg.bucket_cap_mb,
                             output_scaling=cfg.output_scaling, refresh_every=cfg.refresh_every,
                             fsdp=cfg.fsdp, activation_checkpointing=cfg.ac,
                             param_dtype=param_dtype,
                             reduce_dtype=REDUCE_DTYPES[cfg.reduce_dtype or "fp32"]
                             if cfg.fsdp else None)
    return sdp, None


# the compute dtype: None = no mixed precision (parameters' own dtype, fp32)
COMPUTE_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
# the dtype FSDP averages gradients in (stated explicitly: FSDP's own default is param_dtype)
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class FSDPCommCounter:
    """The FSDP baseline's traffic: its sharded sizes and dtypes give the bytes of every step's
    all-gathers and reduce-scatters (``count_step`` after each step)."""

    step_bytes: int
    total_bytes: int = 0
    collective: str = "fsdp"

    def count_step(self) -> None:
        self.total_bytes += self.step_bytes


def fully_shard_baseline(
    model: nn.Module, recipe: Recipe, device: torch.device, param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype,
) -> tuple[nn.Module, FSDPCommCounter]:
    """The FSDP2 baseline (ZeRO-3 over the world): every block, then the root."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = DeviceMesh.from_group(dist.distributed_c10d._get_default_group(), device.type)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    traffic = shard_over_mesh(model, [b for _, b in unit_modules(model, recipe.adapter)], mesh,
                              policy)
    param_bytes = (param_dtype or torch.float32).itemsize
    return model, FSDPCommCounter(sum(t.bytes(param_bytes, reduce_dtype.itemsize)
                                      for t in traffic))


def autocast_forward(model: nn.Module, dtype: torch.dtype) -> None:
    """Run ``model``'s forward under ``torch.autocast`` (bf16 compute, fp32 parameters)."""
    inner = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(next(model.parameters()).device.type, dtype=dtype):
            return inner(*args, **kwargs)

    model.forward = forward  # type: ignore[method-assign]


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
