"""One worker's model and optimizer for every strategy the benchmarks compare.

Baselines are composed here from PyTorch's own pieces, in torchtitan's order (activation
checkpointing per block first, then the data-parallel wrapper):

- ``ddp``      torch ``DistributedDataParallel`` with ``gradient_as_bucket_view=True``.
- ``ddp+ac``   the same, each block under ``torch.utils.checkpoint`` (non-reentrant).
- ``fsdp``     FSDP2 ``fully_shard`` (ZeRO-3): each block, then the root.
- ``fsdp+ac``  the same over checkpointed blocks.
- every SDP strategy of ``subnetdp.runtime.wrapper.STRATEGIES`` (``b-sdp``, ``n-sdp``, ...).

[Note: the fair DDP baseline]
torch DDP's default (``gradient_as_bucket_view=False``) keeps each gradient twice: in
``param.grad`` and in the flat bucket it all-reduces. subnetdp's reducer lets autograd write
straight into the bucket (one copy), so comparing it with DDP's default would credit SDP with a
whole extra gradient copy that has nothing to do with subnetworks. The benchmarks therefore use
``gradient_as_bucket_view=True`` for ``ddp`` and report the default as a separate line
(``ddp (default buckets)``: one more gradient-sized buffer, see ``estimate.py``).

Blocks are found through the recipe's adapter (its units), so nothing here names a model.
Everything works on real tensors (gloo or NCCL workers) and inside ``FakeTensorMode`` over the
fake process group (the memory estimator), except torch DDP, whose C++ reducer needs real
storage; see ``build_rank``'s ``fake``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from subnetdp.models import Recipe, get_recipe
from subnetdp.plan import Plan, make_plan
from subnetdp.subnet.build import build_full_model
from subnetdp.subnet.units import describe_units, unit_modules

BASELINES = ("ddp", "ddp+ac", "fsdp", "fsdp+ac")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPTIMIZER_STATES = 2  # AdamW: exp_avg and exp_avg_sq, each as wide as its parameter


def sdp_strategies() -> tuple[str, ...]:
    """The SDP variants the runtime offers today (read at call time: the list grows)."""
    from subnetdp.runtime.wrapper import STRATEGIES

    return tuple(STRATEGIES)


def all_strategies() -> tuple[str, ...]:
    return (*BASELINES, *sdp_strategies())


@dataclass(frozen=True)
class BenchSpec:
    """One configuration to measure or estimate. ``coverage`` only matters for SDP.

    ``dtype`` is the dtype of parameters, gradients and optimizer state alike (pure bf16
    training, not mixed precision: that composition is not built yet).
    """

    recipe: str
    strategy: str
    world: int
    batch: int
    seq: int
    coverage: float = 1.0
    dtype: str = "fp32"
    seed: int = 0
    bucket_cap_mb: float = 25.0
    # recipe overrides as sorted (name, value) pairs (hashable), e.g. (("n_layers", 2),)
    model_args: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.strategy not in all_strategies():
            raise ValueError(
                f"unknown strategy {self.strategy!r}; choose one of {all_strategies()}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if not 0.0 < self.coverage <= 1.0:
            raise ValueError(f"coverage must be in (0, 1], got {self.coverage}")
        if self.world < 1 or self.batch < 1 or self.seq < 2:
            raise ValueError("world and batch must be >= 1 and seq >= 2")

    @property
    def is_sdp(self) -> bool:
        return self.strategy not in BASELINES

    @property
    def uses_ac(self) -> bool:
        return self.strategy.endswith("+ac")

    @property
    def param_bytes(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def label(self) -> str:
        return f"{self.strategy} (C={self.coverage:g})" if self.is_sdp else self.strategy

    def replace(self, **changes: Any) -> BenchSpec:
        return dataclasses.replace(self, **changes)


@dataclass
class Built:
    """One rank's trainable model and what the benchmarks read from it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    plan: Plan | None  # SDP (and the SDP-emulated DDP of the estimator); None for FSDP/DDP
    comm_counter: Any = None  # DDPCommCounter for torch DDP


def meta_model(spec: BenchSpec) -> tuple[Recipe, nn.Module]:
    """The recipe and its full model on the meta device, in ``spec.dtype`` (nothing allocated)."""
    recipe = get_recipe(spec.recipe)
    if recipe.task != "lm":
        raise ValueError(f"the benchmarks drive language models; {spec.recipe} is {recipe.task}")
    with torch.device("meta"):
        model = recipe.build_model(**dict(spec.model_args))
    max_seq = getattr(getattr(model, "config", None), "max_seq_len", spec.seq)
    if spec.seq > max_seq:
        raise ValueError(f"--seq {spec.seq} exceeds {spec.recipe}'s max_seq_len {max_seq}; "
                         "use a shorter sequence")
    return recipe, model.to(DTYPES[spec.dtype])


def make_bench_plan(spec: BenchSpec, model: nn.Module, recipe: Recipe) -> Plan:
    """The plan of an SDP spec; baselines get the everyone-holds-everything block plan."""
    if spec.strategy in ("n-sdp", "nb-sdp"):
        from subnetdp.subnet.neurons import make_neuron_plan

        return make_neuron_plan(model, recipe.adapter, world=spec.world,
                                coverage=spec.coverage, seed=spec.seed)
    units, shared = describe_units(model, recipe.adapter)
    coverage = spec.coverage if spec.is_sdp else 1.0
    return make_plan(world=spec.world, units=units, coverage=coverage, seed=spec.seed,
                     shared_size=shared)


def checkpoint_units(model: nn.Module, recipe: Recipe) -> int:
    """Put every unit (block) under activation checkpointing; returns how many.

    ``checkpoint_wrapper`` is a module around the block, so parameter names gain a prefix;
    that is harmless for DDP/FSDP, which never look names up in a plan.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    found = unit_modules(model, recipe.adapter)
    for name, block in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, checkpoint_wrapper(block))
    return len(found)


def build_rank(
    spec: BenchSpec, *, device: torch.device | str = "cpu", mesh: Any = None, fake: bool = False,
    prebuilt: tuple[Recipe, nn.Module] | None = None,
) -> Built:
    """This rank's model and AdamW optimizer for ``spec`` (process group already up).

    ``mesh`` is the 1-D world ``DeviceMesh`` FSDP needs (build it *outside* fake mode).
    ``fake=True`` (estimator): ``ddp``/``ddp+ac`` become the SDP reducer with a plan where
    everyone holds everything, which keeps exactly DDP's ``gradient_as_bucket_view=True``
    memory (full parameters, gradients living in flat all-reduce buckets) while running on fake
    tensors; ``tests/dist/test_bench_measure.py`` checks the estimate against real torch DDP.
    ``prebuilt``: the ``meta_model(spec)`` pair, when it must be built outside fake mode.
    """
    recipe, model = prebuilt if prebuilt is not None else meta_model(spec)
    if spec.is_sdp or (fake and spec.strategy.startswith("ddp")):
        from subnetdp.runtime import SubnetDataParallel

        plan = make_bench_plan(spec, model, recipe)
        sdp = SubnetDataParallel(
            model, plan=plan, adapter=recipe.adapter,
            strategy=spec.strategy if spec.is_sdp else "b-sdp",
            device=device, init_seed=spec.seed, bucket_cap_mb=spec.bucket_cap_mb,
        )
        if spec.uses_ac:
            checkpoint_units(sdp.module, recipe)
        return Built(sdp, _adamw(sdp), plan)
    full = build_full_model(model, recipe.adapter, device=device, seed=spec.seed)
    if spec.uses_ac:
        checkpoint_units(full, recipe)
    if spec.strategy.startswith("fsdp"):
        return Built(_fully_shard(full, recipe, mesh), _adamw(full), None)
    return _torch_ddp(spec, full, device)


def _fully_shard(model: nn.Module, recipe: Recipe, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        raise ValueError("FSDP needs a DeviceMesh: pass mesh=init_device_mesh(device, (world,))")
    # Blocks first, so each is one all-gather/reduce-scatter group; the root then takes what is
    # left (embeddings, final norm, output layer). Unit paths name the blocks before wrapping,
    # and a checkpoint wrapper sits at the same path, so shard what is there now.
    names = recipe.adapter.unit_paths(model) if not _has_ac(model) else _ac_paths(model)
    for name in names:
        fully_shard(model.get_submodule(name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _has_ac(model: nn.Module) -> bool:
    return any("_checkpoint_wrapped_module" in n for n, _ in model.named_modules())


def _ac_paths(model: nn.Module) -> list[str]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return [n for n, m in model.named_modules() if isinstance(m, CheckpointWrapper)]


def _torch_ddp(spec: BenchSpec, full: nn.Module, device: torch.device | str) -> Built:
    import torch.distributed as dist

    from subnetdp.train.build import DDPCommCounter

    dev = torch.device(device)
    ddp = nn.parallel.DistributedDataParallel(
        full, device_ids=[dev.index] if dev.type == "cuda" else None,
        bucket_cap_mb=spec.bucket_cap_mb, gradient_as_bucket_view=True,  # [Note: fair DDP]
    )
    counter = DDPCommCounter()
    if dist.get_world_size() > 1:
        ddp.register_comm_hook(None, counter.make_hook())
    return Built(ddp, _adamw(ddp), None, counter)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    # foreach=False on every device: the per-tensor loop keeps optimizer temporaries to one
    # parameter's size, the same on CPU and GPU, so estimates do not depend on the device.
    return torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), foreach=False)


def lm_step(
    built: Built, tokens: torch.Tensor, *, after_step: Callable[[], None] | None = None
) -> float:
    """One training step: forward, loss, backward (reduction included), optimizer step.

    ``tokens`` is ``[batch, seq + 1]``; ``after_step`` runs after ``optimizer.step()`` and
    before gradients are released (the estimator reads the state bytes there).
    """
    model, opt = built.model, built.optimizer
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    if after_step is not None:
        after_step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach()) if not _is_fake(loss) else 0.0


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def vocab_size(spec: BenchSpec) -> int:
    _, model = meta_model(spec)
    config: Any = getattr(model, "config", None)
    if config is None or not hasattr(config, "vocab_size"):
        raise ValueError(f"{spec.recipe}'s model has no config.vocab_size; the benchmarks "
                         "need a token-level language model")
    return int(config.vocab_size)
