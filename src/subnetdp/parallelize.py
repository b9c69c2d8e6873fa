"""``parallelize``: one rank's model for every strategy, the only builder train, bench and the
study use (torchtitan's ``parallelize_<model>`` shape).

The order, the same for every strategy:

1. **Precision of storage.** ``dtype="bf16"`` stores everything in bf16: the (meta) model is
   cast first, so what is materialised, trained and reduced is bf16. ``bf16-mixed`` keeps
   fp32 storage and sets a bf16 compute dtype applied at step 4.
2. **Materialise.** Baselines allocate the full model with subnetdp's name-seeded init (so a
   baseline starts from exactly the values the subnetworks' union starts from); SDP leaves it
   on the meta device and ``SubnetDataParallel`` allocates only the held units.
3. **Compile and activation checkpointing** per block, before any data-parallel wrapper, so
   that FSDP's hooks stay outside the recomputed region (SDP: inside the wrapper, same
   position); ``--compile`` compiles each block's forward, which checkpointing then wraps.
4. **The data-parallel wrapper:** torch DDP (the fair one: [Note: the fair DDP baseline]),
   FSDP2 over the world, or ``SubnetDataParallel`` (holder reducer, or FSDP2 per holder group);
   mixed precision is torch.autocast around DDP's and the reducer's forward, FSDP's
   ``MixedPrecisionPolicy`` under FSDP (gradients reduced in fp32 unless ``reduce_dtype``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from subnetdp.plan import Plan, make_plan
from subnetdp.runtime.checkpointing import checkpoint_blocks
from subnetdp.runtime.compile import compile_blocks
from subnetdp.runtime.local_steps import LocalSteps
from subnetdp.runtime.rank import FSDPRank, RankModel, TorchDDPRank
from subnetdp.strategy import HOLDER_REDUCER, Composition, RankSpec, Strategy
from subnetdp.subnet.adapter import UnitAdapter
from subnetdp.subnet.build import build_full_model
from subnetdp.subnet.units import describe_units, unit_modules

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def storage_dtype(comp: Composition) -> torch.dtype:
    """Parameters, gradients and optimizer state (the master copy)."""
    return torch.bfloat16 if comp.dtype == "bf16" else torch.float32


def compute_dtype(comp: Composition) -> torch.dtype | None:
    """The compute dtype under mixed precision, else None (compute in the storage dtype)."""
    return torch.bfloat16 if comp.dtype == "bf16-mixed" else None


def reduce_dtype(comp: Composition) -> torch.dtype | None:
    """The dtype FSDP averages gradients in: as asked, else the master dtype under mixed
    precision (FSDP's own default would be the compute dtype), else FSDP's default."""
    if comp.reduce_dtype is not None:
        return _TORCH_DTYPES[comp.reduce_dtype]
    return storage_dtype(comp) if compute_dtype(comp) is not None else None


def parallelize(
    model: nn.Module,
    *,
    adapter: UnitAdapter,
    strategy: RankSpec | Strategy | str,
    plan: Plan | None = None,
    comp: Composition | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    prepare_full: Callable[[nn.Module], None] | None = None,
    find_unused_parameters: bool = False,
    fake: bool = False,
) -> RankModel:
    """This rank's model (the process group is up). ``model`` is the full model, best on the
    meta device (SDP then never allocates what this rank does not hold).

    ``strategy``: a ``RankSpec`` (checked: ``comp`` is then its own and nothing is checked
    again), or a strategy (value or name) that ``comp`` (default: none) composes.

    ``plan``: required for SDP strategies. ``prepare_full``: applied to a baseline's full
    model after materialising (the study's stochastic-depth and neuron-dropout baselines);
    ``find_unused_parameters`` is then DDP's. ``fake``: inside ``FakeTensorMode`` (the memory
    estimator), where torch DDP's C++ reducer cannot run on fake storage: ``ddp`` is then
    built as the holder reducer with everyone holding everything, which has exactly DDP's
    bucket-view memory (``tests/estimate/test_measured.py`` checks it against real DDP)."""
    spec = strategy if isinstance(strategy, RankSpec) else RankSpec.of(strategy, comp)
    rank = _parallelize(model, adapter, spec, plan, torch.device(device), seed, prepare_full,
                        find_unused_parameters, fake)
    if spec.comp.dtype == "bf16":
        # pure bf16: a float batch (images) meets bf16 weights, which no kernel takes; FSDP's
        # ``cast_forward_inputs`` only casts to a ``param_dtype``, which pure bf16 has not
        _cast_forward_inputs(rank.model, storage_dtype(spec.comp))
    return rank


def _parallelize(
    model: nn.Module, adapter: UnitAdapter, spec: RankSpec, plan: Plan | None,
    dev: torch.device, seed: int, prepare_full: Callable[[nn.Module], None] | None,
    find_unused_parameters: bool, fake: bool,
) -> RankModel:
    strat, comp = spec.strategy, spec.comp
    model.to(storage_dtype(comp))  # 1. precision of storage
    if not strat.is_sdp and not comp.fsdp and (fake or comp.zero == 2):
        # ddp+zero2 is the holder reducer at full coverage with zero=2 (one gradient copy,
        # the shards over the world): DDP's own reducer cannot shard gradients
        units, shared = describe_units(model, adapter)
        plan = make_plan(world=dist.get_world_size(), units=units, coverage=1.0,
                         shared_size=shared)
        # (SDP has no default-bucket variant: its reducer is bucket-view already)
        held = RankSpec(HOLDER_REDUCER, comp.replace(ddp_bucket_view=True))
        return _sdp(model, adapter, held, plan, dev, seed)
    if strat.is_sdp:
        if plan is None:
            raise ValueError(f"{strat.name} needs a plan (subnetdp.make_plan)")
        return _sdp(model, adapter, spec, plan, dev, seed)
    full = build_full_model(model, adapter, device=dev, seed=seed)  # 2. materialise
    if prepare_full is not None:
        prepare_full(full)
    blocks = [name for name, _ in unit_modules(full, adapter)]
    if comp.compile:  # 3.
        compile_blocks(full, blocks)
    if comp.ac:
        checkpoint_blocks(full, blocks)
    if comp.fsdp:  # 4.
        return _fsdp(full, adapter, strat, comp, dev)
    if (dtype := compute_dtype(comp)) is not None:
        _autocast_forward(full, dtype)
    return TorchDDPRank(full, strategy=strat, device=dev, bucket_cap_mb=comp.bucket_cap_mb,
                        bucket_view=comp.ddp_bucket_view,
                        zero_optimizer=comp.zero == 1,
                        find_unused_parameters=find_unused_parameters)


def _sdp(
    model: nn.Module, adapter: UnitAdapter, spec: RankSpec, plan: Plan, dev: torch.device,
    seed: int,
) -> RankModel:
    from subnetdp.runtime.wrapper import SubnetDataParallel

    # Steps 2-4 happen inside: materialise held units, checkpoint blocks, then the backend.
    comp = spec.comp
    return SubnetDataParallel(
        model, plan=plan, adapter=adapter, spec=spec, device=dev, init_seed=seed,
        param_dtype=compute_dtype(comp), reduce_dtype=reduce_dtype(comp) if comp.fsdp else None,
    )


def _fsdp(
    full: nn.Module, adapter: UnitAdapter, strat: Strategy, comp: Composition, dev: torch.device
) -> RankModel:
    """FSDP2 over the world (ZeRO-3): every block, then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from subnetdp.runtime.fsdp import shard_over_mesh, world_mesh
    from subnetdp.runtime.ring import GlooComms

    param, red = compute_dtype(comp), reduce_dtype(comp)
    policy = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=red)
    traffic = shard_over_mesh(full, [b for _, b in unit_modules(full, adapter)],
                              world_mesh(dev.type), policy,
                              gloo=GlooComms(comp.ring_reduce_scatter, comp.async_unshard))
    master = storage_dtype(comp).itemsize
    return FSDPRank(full, strategy=strat, traffic=traffic,
                    param_bytes=(param.itemsize if param is not None else master),
                    reduce_bytes=(red.itemsize if red is not None else master))


def _cast_forward_inputs(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``model``'s floating-point tensor arguments to ``dtype`` before its forward (token
    ids and other integer inputs pass as they are)."""
    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}

    model.register_forward_pre_hook(hook, with_kwargs=True)


def _autocast_forward(model: nn.Module, dtype: torch.dtype) -> None:
    """Run ``model``'s forward under ``torch.autocast`` (bf16 compute, fp32 parameters)."""
    inner = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(next(model.parameters()).device.type, dtype=dtype):
            return inner(*args, **kwargs)

    model.forward = forward  # type: ignore[method-assign]


def outer_loop(model: RankModel, plan: Plan, opt: torch.optim.Optimizer, *, every: int,
               start: int, fragments: int, outer_dtype: str | None, bucket_cap_mb: float,
               end: int | None = None, lr: float = 0.7, momentum: float = 0.9) -> LocalSteps:
    """This rank's outer loop of ``--sync-every every`` (``runtime.local_steps``), as ``train``
    and ``bench step`` build it, ``start`` inner steps into the run; ``outer_dtype``: the
    ``--outer-dtype`` name (None: the parameters' dtype)."""
    return LocalSteps(model.sync_layout(), plan, opt, model.comm_stats, rank=dist.get_rank(),
                      every=every, start=start, end=end, lr=lr, momentum=momentum,
                      dtype=_TORCH_DTYPES[outer_dtype] if outer_dtype else None,
                      fragments=fragments, bucket_cap_bytes=int(bucket_cap_mb * 2**20))
