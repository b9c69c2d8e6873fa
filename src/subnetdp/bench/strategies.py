"""One worker's model and optimizer for every strategy the benchmarks compare.

Baselines are composed here from PyTorch's own pieces, in torchtitan's order (activation
checkpointing per block first, then the data-parallel wrapper):

- ``ddp``      torch ``DistributedDataParallel`` with ``gradient_as_bucket_view=True``.
- ``ddp+ac``   the same, each block under ``torch.utils.checkpoint`` (non-reentrant).
- ``fsdp``     FSDP2 ``fully_shard`` (ZeRO-3): each block, then the root.
- ``fsdp+ac``  the same over checkpointed blocks.
- every SDP strategy of ``subnetdp.runtime.wrapper.STRATEGIES`` (``b-sdp``, ``n-sdp``, ...),
  optionally composed (method.md §7) with FSDP2 inside each holder group (``fsdp=True``) and
  activation checkpointing (``ac=True``), labelled e.g. ``b-sdp+fsdp+ac (C=0.69)``; the
  ``SubnetDataParallel`` wrapper does the composing.

Precision (``dtype``): ``fp32``; ``bf16`` (pure: parameters, gradients and optimizer state in
bf16); ``bf16-mixed`` (bf16 compute, fp32 master parameters, gradients and optimizer state:
torch.autocast for DDP and non-FSDP SDP, FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` under FSDP, so FSDP all-gathers bf16 and reduce-scatters fp32, as
torchtitan does).

Activation checkpointing is ``runtime.checkpointing.checkpoint_blocks`` everywhere (each block's
forward under non-reentrant ``torch.utils.checkpoint``, parameter names unchanged), applied
before the data-parallel wrapper.

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
# storage dtype of parameters, gradients and optimizer state (the master copy)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16-mixed": torch.float32}
# compute dtype where it differs from storage (mixed precision)
COMPUTE_DTYPES = {"bf16-mixed": torch.bfloat16}
# SDP strategies the benchmarks compose with FSDP: block-level ones. nb-sdp does not compose by
# design (runtime.wrapper); n-sdp + FSDP is being built in the runtime, and its analytic bytes
# (estimate.analytic_state, comm.analytic_comm) need its shard layout first.
FSDP_COMPOSABLE = ("b-sdp", "bb-sdp")
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

    ``dtype``: ``fp32``, ``bf16`` (pure) or ``bf16-mixed`` (bf16 compute, fp32 master state).
    ``fsdp``/``ac`` compose an SDP strategy with FSDP2 over each holder group and with
    activation checkpointing; baselines carry theirs in the name (``ddp+ac``, ``fsdp+ac``).
    """

    recipe: str
    strategy: str
    world: int
    batch: int
    seq: int
    coverage: float = 1.0
    dtype: str = "fp32"
    fsdp: bool = False
    ac: bool = False
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
        if (self.fsdp or self.ac) and not self.is_sdp:
            raise ValueError(f"fsdp/ac compose SDP strategies; for the baseline use the strategy "
                             f"name ({', '.join(BASELINES)}), not {self.strategy!r} + flags")
        if self.fsdp and self.strategy not in FSDP_COMPOSABLE:
            raise ValueError(f"{self.strategy} + fsdp is not benchmarked (nb-sdp does not compose "
                             f"with FSDP; n-sdp's is not built yet); use one of {FSDP_COMPOSABLE}")

    @property
    def is_sdp(self) -> bool:
        return self.strategy not in BASELINES

    @property
    def uses_ac(self) -> bool:
        return self.ac or self.strategy.endswith("+ac")

    @property
    def uses_fsdp(self) -> bool:
        """FSDP2 anywhere: the ``fsdp`` baselines, or SDP composed with it."""
        return self.fsdp or self.strategy.startswith("fsdp")

    @property
    def param_bytes(self) -> int:
        """Bytes per element of parameters, gradients and optimizer state (master copy)."""
        return DTYPES[self.dtype].itemsize

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The compute dtype under mixed precision, else None (compute in the storage dtype)."""
        return COMPUTE_DTYPES.get(self.dtype)

    @property
    def gather_bytes(self) -> int:
        """Bytes per element FSDP all-gathers (parameters, cast to the compute dtype first)."""
        dt = self.compute_dtype
        return dt.itemsize if dt is not None else self.param_bytes

    @property
    def reduce_bytes(self) -> int:
        """Bytes per element of gradient reductions (mixed precision reduces in fp32)."""
        return self.param_bytes

    @property
    def name(self) -> str:
        """The strategy with its composition, e.g. ``b-sdp+fsdp+ac``."""
        return self.strategy + ("+fsdp" if self.fsdp else "") + ("+ac" if self.ac else "")

    @property
    def label(self) -> str:
        return f"{self.name} (C={self.coverage:g})" if self.is_sdp else self.name

    def replace(self, **changes: Any) -> BenchSpec:
        return dataclasses.replace(self, **changes)


@dataclass
class Built:
    """One rank's trainable model and what the benchmarks read from it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    plan: Plan | None  # SDP (and the SDP-emulated DDP of the estimator); None for FSDP/DDP
    comm_counter: Any = None  # DDPCommCounter for torch DDP
    autocast: torch.dtype | None = None  # run forward under torch.autocast (mixed-precision DDP)


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
    """Put every unit (block) under activation checkpointing; returns how many. Names do not
    change (``runtime.checkpointing``), so FSDP still finds the blocks at their unit paths."""
    from subnetdp.runtime.checkpointing import checkpoint_blocks

    return checkpoint_blocks(model, [name for name, _ in unit_modules(model, recipe.adapter)])


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
            fsdp=spec.fsdp, activation_checkpointing=spec.uses_ac,
            param_dtype=spec.compute_dtype, reduce_dtype=_reduce_dtype(spec) if spec.fsdp else None,
        )
        return Built(sdp, _adamw(sdp), plan)
    full = build_full_model(model, recipe.adapter, device=device, seed=spec.seed)
    if spec.uses_ac:  # before the data-parallel wrapper (torchtitan's order)
        checkpoint_units(full, recipe)
    if spec.strategy.startswith("fsdp"):
        return Built(_fully_shard(spec, full, recipe, mesh), _adamw(full), None)
    return _torch_ddp(spec, full, device)


def _reduce_dtype(spec: BenchSpec) -> torch.dtype | None:
    """FSDP's reduce dtype: fp32 under mixed precision (the master dtype), else the default."""
    return DTYPES[spec.dtype] if spec.compute_dtype is not None else None


def _fully_shard(spec: BenchSpec, model: nn.Module, recipe: Recipe, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from subnetdp.runtime.fsdp import shard_over_mesh

    if mesh is None:
        raise ValueError("FSDP needs a DeviceMesh: pass mesh=init_device_mesh(device, (world,))")
    policy = MixedPrecisionPolicy(param_dtype=spec.compute_dtype, reduce_dtype=_reduce_dtype(spec))
    blocks = [model.get_submodule(name) for name in recipe.adapter.unit_paths(model)]
    shard_over_mesh(model, blocks, mesh, policy)
    return model


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
    return Built(ddp, _adamw(ddp), None, counter, autocast=spec.compute_dtype)


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
    if built.autocast is not None:
        with torch.autocast(tokens.device.type, dtype=built.autocast):
            logits = model(tokens[:, :-1])
    else:
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
