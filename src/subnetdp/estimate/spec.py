"""One worker's model and optimizer for every strategy the benchmarks compare.

Every rank is built by ``subnetdp.parallelize``, the builder training uses too, so a
benchmark measures exactly what ``subnetdp train`` runs. A spec names its strategy as a
label (``strategy.label``): the baselines ``ddp``, ``ddp+ac``, ``fsdp`` (FSDP2 over the world,
ZeRO-3), ``fsdp+ac``, and every SDP strategy (``b-sdp``, ``n-sdp``, ...), optionally composed
(docs/method.md §7) with FSDP2 inside each holder group (``fsdp=True``) and activation
checkpointing (``ac=True``), labelled e.g. ``b-sdp+fsdp+ac (C=0.69)``.

``ddp`` is torch DDP with ``gradient_as_bucket_view=True`` ([Note: the fair DDP baseline] in
``runtime.rank``); torch's default is the separate estimator line ``ddp (default buckets)``
(one more gradient-sized buffer, see ``estimate.py``).

Precision (``dtype``, ``strategy.DTYPES``): ``fp32``; ``bf16`` (pure: parameters, gradients
and optimizer state in bf16); ``bf16-mixed`` (bf16 compute, fp32 master parameters, gradients
and optimizer state; FSDP all-gathers bf16 and reduce-scatters fp32, as torchtitan does).

Everything works on real tensors (gloo or NCCL workers) and inside ``FakeTensorMode`` over the
fake process group (the memory estimator): see ``parallelize``'s ``fake``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from subnetdp.models import Recipe, get_recipe
from subnetdp.parallelize import compute_dtype, outer_loop, parallelize, storage_dtype
from subnetdp.plan import Plan
from subnetdp.plan.objectives import DEFAULT_BALANCE
from subnetdp.runtime.local_steps import LocalSteps
from subnetdp.runtime.optim import fast_path
from subnetdp.runtime.rank import RankModel
from subnetdp.strategy import (
    BASELINES,
    DTYPES,
    REDUCE_DTYPES,
    SDP_NAMES,
    Composition,
    PlanSpec,
    RankSpec,
    Strategy,
    composition_of,
    local_steps_problems,
    parse_label,
)
from subnetdp.subnet.planning import build_plan


def optimizer_states(recipe: str) -> int:
    """Optimizer tensors per parameter of the named recipe (``Recipe.optimizer_states``)."""
    return get_recipe(recipe).optimizer_states


def all_strategies() -> tuple[str, ...]:
    return (*BASELINES, *SDP_NAMES)


@dataclass(frozen=True)
class BenchSpec:
    """One configuration to measure or estimate. ``coverage`` only matters for SDP; ``seq``
    only for language models (image recipes take the recipe's image size).

    ``strategy``: a baseline label (``ddp``, ``ddp+ac``, ``fsdp``, ``fsdp+ac``) or an SDP
    strategy, which ``fsdp``/``ac`` compose with FSDP2 over each holder group and with
    activation checkpointing. ``dtype``: ``fp32``, ``bf16`` (pure) or ``bf16-mixed``.
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
    # the SDP plan (plan.schemes.make_plan): scheme, what balanced balances (subnet.costs,
    # measured at this spec's batch), per-rank capacities (heterogeneous workers; balanced
    # only, ``coverage`` then unused) and the minimum holders per unit
    scheme: str = "spread"
    balance: str = DEFAULT_BALANCE
    capacities: tuple[float, ...] | None = None
    min_holders: int = 1
    fsdp_prefetch: bool = True  # SDP + FSDP: prefetch adjacent held blocks (runtime.fsdp)
    ring_reduce_scatter: bool = True  # FSDP over gloo: runtime.ring's reduce-scatter
    async_unshard: bool = True  # FSDP over gloo: all-gathers overlap compute (runtime.ring)
    zero: int = 0  # SDP: ZeRO-1/2 inside holder groups (runtime.zero); baselines: ddp+zero1/2
    # the rest of strategy.Composition, as a run sets them (reduce_dtype needs fsdp)
    reduce_dtype: str | None = None
    output_scaling: str | None = None
    refresh_every: int = 1
    # MiB of device memory per communicator (estimate.communicators); 0: not counted (what
    # CPU measurements see); the CLI's --comm-mem-mb defaults to NCCL's DEFAULT_COMM_MB
    comm_mem_mb: float = 0.0
    # holder groups split from the world communicator share its buffers
    # (NCCL_COMM_SPLIT_SHARE_RESOURCES=1; estimate.communicators.split_shared)
    comm_split_shared: bool = False
    # local steps (runtime.local_steps, --sync-every H): measured by bench step only, whose
    # timed steps are whole sync windows
    sync_every: int = 1
    sync_fragments: int = 1
    outer_dtype: str | None = None

    def __post_init__(self) -> None:
        _ = self.rank  # decoded and checked now: a bad spec fails where it is made

    @classmethod
    def of(cls, strategy: str, comp: Composition, plan: PlanSpec | None = None, *,
           recipe: str, world: int, batch: int, seq: int,
           model_args: Mapping[str, Any] | None = None, **measure: Any) -> BenchSpec:
        """A run's sections (its ``Composition``, its ``PlanSpec``: train.options) plus a shape
        (recipe, world, batch, seq); ``measure``: how the estimate counts (``comm_mem_mb``,
        ``comm_split_shared``)."""
        plan = plan or PlanSpec()
        return cls(recipe=recipe, strategy=strategy, world=world, batch=batch, seq=seq,
                   **composition_fields(comp), coverage=plan.coverage, scheme=plan.scheme,
                   balance=plan.balance, capacities=plan.capacities,
                   min_holders=plan.min_holders, seed=plan.seed,
                   model_args=tuple(sorted((model_args or {}).items())), **measure)

    @functools.cached_property
    def rank(self) -> RankSpec:
        """The label decoded once, with the flags composed onto it (checked): what every
        property and the builders read."""
        strategy, named = parse_label(self.strategy)  # a baseline's fsdp/ac are in its name
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not 0.0 < self.coverage <= 1.0:
            raise ValueError(f"coverage must be in (0, 1], got {self.coverage}")
        if self.world < 1 or self.batch < 1 or self.seq < 2:
            raise ValueError("world and batch must be >= 1 and seq >= 2")
        if (self.fsdp or self.ac or self.zero) and not strategy.is_sdp:
            raise ValueError(f"fsdp/ac compose SDP strategies; for the baseline use the strategy "
                             f"name ({', '.join(BASELINES)}), not {self.strategy!r} + flags")
        comp = composition_of(self).replace(fsdp=self.fsdp or named.fsdp,
                                            ac=self.ac or named.ac, zero=self.zero or named.zero)
        problems = local_steps_problems(self.sync_every, self.sync_fragments, zero=comp.zero,
                                        fsdp=comp.fsdp)
        if self.outer_dtype not in (None, *REDUCE_DTYPES):
            problems.append(f"--outer-dtype must be one of {', '.join(REDUCE_DTYPES)}, got "
                            f"{self.outer_dtype!r}")
        if problems:
            raise ValueError(problems[0])
        return RankSpec(strategy, comp)

    @property
    def strategy_value(self) -> Strategy:
        """The strategy without its composition (``fsdp+ac`` is ``ddp``)."""
        return self.rank.strategy

    def composition(self) -> Composition:
        return self.rank.comp

    @property
    def plan_spec(self) -> PlanSpec:
        """How this spec's SDP plan is made (``subnet.planning.build_plan``)."""
        return PlanSpec(coverage=self.coverage, scheme=self.scheme, balance=self.balance,
                        capacities=self.capacities, min_holders=self.min_holders,
                        seed=self.seed)

    @property
    def is_sdp(self) -> bool:
        return self.strategy_value.is_sdp

    @property
    def uses_ac(self) -> bool:
        return self.composition().ac

    @property
    def uses_fsdp(self) -> bool:
        """FSDP2 anywhere: the ``fsdp`` baselines, or SDP composed with it."""
        return self.composition().fsdp

    @property
    def param_bytes(self) -> int:
        """Bytes per element of parameters, gradients and optimizer state (master copy)."""
        return storage_dtype(self.composition()).itemsize

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The compute dtype under mixed precision, else None (compute in the storage dtype)."""
        return compute_dtype(self.composition())

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
        return self.rank.label()

    @property
    def label(self) -> str:
        """The strategy's label; with local steps, its window (and fragments) too."""
        local = "" if self.sync_every == 1 else f" H={self.sync_every}" + (
            f"/{self.sync_fragments}" if self.sync_fragments > 1 else "")
        return self.rank.label(self.coverage) + local

    def replace(self, **changes: Any) -> BenchSpec:
        return dataclasses.replace(self, **changes)


# Composition fields a BenchSpec does not take: the labelled torch-DDP default (a baseline's
# label, never a run's) and torch.compile (fake mode compiles nothing: estimated as eager);
# fsdp_prefetch: no option sets it, the spec's default is the run's
_NOT_ESTIMATED = ("ddp_bucket_view", "fsdp_prefetch", "compile")


def composition_fields(comp: Composition) -> dict[str, Any]:
    """A run's composition as ``BenchSpec`` fields, the one mapping: ``train --memory-gb``
    and ``plan --memory-gb`` estimate a run with it (``estimate.hetero.budget_spec``)."""
    return {f.name: getattr(comp, f.name) for f in dataclasses.fields(comp)
            if f.name not in _NOT_ESTIMATED}


@dataclass
class Built:
    """One rank's trainable model and optimizer, and the plan it trains (SDP; None for the
    baselines, whose fake-mode stand-in keeps its everyone-holds-everything plan inside)."""

    rank: RankModel
    optimizer: torch.optim.Optimizer
    plan: Plan | None
    local: LocalSteps | None = None  # the outer loop of --sync-every H (``with_local_steps``)


def meta_model(spec: BenchSpec, *, check_seq: bool = True) -> tuple[Recipe, nn.Module]:
    """The recipe and its full model on the meta device, in ``spec.dtype`` (nothing allocated).
    ``check_seq=False``: callers whose figures do not depend on the sequence (communication)
    accept any ``spec.seq``."""
    recipe = get_recipe(spec.recipe)
    if recipe.task not in ("lm", "image"):
        raise ValueError(f"the benchmarks drive language and image models; {spec.recipe} is "
                         f"{recipe.task}")
    with torch.device("meta"):
        model = recipe.build_model(**dict(spec.model_args))
    max_seq = getattr(getattr(model, "config", None), "max_seq_len", spec.seq)
    if check_seq and recipe.task == "lm" and spec.seq > max_seq:
        raise ValueError(f"--seq-len {spec.seq} exceeds {spec.recipe}'s max_seq_len {max_seq}; "
                         "use a shorter sequence")
    return recipe, model.to(storage_dtype(spec.composition()))


def make_bench_plan(spec: BenchSpec, model: nn.Module, recipe: Recipe) -> Plan:
    """The plan of an SDP spec (``subnet.planning.build_plan``; balanced: the units' costs at
    this spec's batch); baselines get the everyone-holds-everything block plan."""
    def costs(balance: str) -> Any:
        from subnetdp.subnet.costs import recipe_costs

        return recipe_costs(recipe, batch=spec.batch, seq=spec.seq,
                            model_args=dict(spec.model_args)).weights(balance)

    return build_plan(model, recipe.adapter, spec.strategy_value, spec.plan_spec,
                      world=spec.world, costs=costs)


def build_rank(
    spec: BenchSpec, *, device: torch.device | str = "cpu", fake: bool = False,
    prebuilt: tuple[Recipe, nn.Module] | None = None,
) -> Built:
    """This rank's model and optimizer (the recipe's: ``optimizer_states``) for ``spec``
    (process group already up), built
    by ``parallelize``. ``fake=True``: inside ``FakeTensorMode`` (the estimator).
    ``prebuilt``: the ``meta_model(spec)`` pair, when it must be built outside fake mode."""
    recipe, model = prebuilt if prebuilt is not None else meta_model(spec)
    plan = make_bench_plan(spec, model, recipe) if spec.is_sdp else None
    rank = parallelize(model, adapter=recipe.adapter, strategy=spec.rank, plan=plan,
                       device=device, seed=spec.seed, fake=fake)
    return Built(rank, optimizer_for(rank, recipe, device=device), plan)


def with_local_steps(spec: BenchSpec, built: Built, *, start: int) -> Built:
    """``built`` with the outer loop of ``spec.sync_every`` (``runtime.local_steps``, as
    ``train`` builds it), ``start`` inner steps into its first window (a benchmark aligns its
    timed steps with whole windows); unchanged at H = 1."""
    if spec.sync_every == 1:
        return built
    plan = built.plan
    if plan is None:  # a baseline: the everyone-holds-everything plan (plain DiLoCo)
        recipe, meta = meta_model(spec)
        plan = make_bench_plan(spec, meta, recipe)
    local = outer_loop(built.rank, plan, built.optimizer, every=spec.sync_every, start=start,
                       fragments=spec.sync_fragments, outer_dtype=spec.outer_dtype,
                       bucket_cap_mb=spec.bucket_cap_mb)
    return dataclasses.replace(built, local=local)


def optimizer_for(rank: RankModel, recipe: Recipe, *,
                  device: torch.device | str = "cpu") -> torch.optim.Optimizer:
    """The recipe's optimizer over this rank's parameters (sharded under zero: runtime.zero;
    ddp+zero1: ZeroRedundancyOptimizer). What training builds (``runtime.optim.fast_path``):
    fused on CUDA, which keeps no per-tensor temporaries; foreach over FSDP's DTensors
    elsewhere; else the per-tensor loop (``foreach=False``), whose temporaries (one
    parameter's size) the estimator models the same way on every device."""
    dtensors = any(isinstance(p, DTensor) for p in rank.parameters())
    impl: dict[str, Any] = (fast_path(torch.device(device).type, dtensors=dtensors)
                            or {"foreach": False})
    if optimizer_states(recipe.name) < 2:  # the image recipes train with SGD
        return rank.optimizer(torch.optim.SGD, lr=1e-4, **impl,
                              momentum=float(recipe.defaults.get("momentum", 0.9)))
    return rank.optimizer(torch.optim.AdamW, lr=1e-4, betas=(0.9, 0.95), **impl)


def lm_step(
    built: Built, tokens: torch.Tensor, *, after_step: Callable[[], None] | None = None
) -> float:
    """One language-model training step on ``tokens`` ``[batch, seq + 1]`` (``train_step``)."""
    return train_step(built, tokens[:, :-1], tokens[:, 1:], after_step=after_step)


def train_step(
    built: Built, inputs: torch.Tensor, targets: torch.Tensor, *,
    after_step: Callable[[], None] | None = None,
) -> float:
    """One training step: forward, cross-entropy, backward (reduction included), optimizer step.

    ``targets`` has the shape of the logits without their last (class) dimension: next tokens
    ``[batch, seq]`` or image labels ``[batch]``. ``after_step`` runs after ``optimizer.step()``
    and before gradients are released (the estimator reads the state bytes there).
    """
    model, opt, local = built.rank.model, built.optimizer, built.local
    with contextlib.nullcontext() if local is None else local.inner(model):
        logits = model(inputs)  # mixed precision is inside (parallelize)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                               targets.reshape(-1))
        loss.backward()
    opt.step()
    if local is not None:
        local.after_step()
    if after_step is not None:
        after_step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach()) if not _is_fake(loss) else 0.0


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def example_batch(spec: BenchSpec, generator: torch.Generator | None = None, *,
                  vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (inputs, targets) of ``spec``'s shape: tokens ``[batch, seq]`` and the next
    tokens, or images ``[batch, C, H, W]`` (the recipe's size, the storage dtype) and labels.
    ``vocab``: ``vocab_size(spec)``, passed in under fake mode (it builds a meta model)."""
    recipe = get_recipe(spec.recipe)
    if recipe.task == "lm":
        tokens = torch.randint(0, vocab or vocab_size(spec), (spec.batch, spec.seq + 1),
                               generator=generator)
        return tokens[:, :-1], tokens[:, 1:]
    d = recipe.defaults
    side = int(d["image_size"])
    images = torch.randn(spec.batch, int(d["in_channels"]), side, side, generator=generator,
                         dtype=storage_dtype(spec.composition()))
    return images, torch.randint(0, int(d["num_classes"]), (spec.batch,), generator=generator)


def vocab_size(spec: BenchSpec) -> int:
    _, model = meta_model(spec)
    config: Any = getattr(model, "config", None)
    if config is None or not hasattr(config, "vocab_size"):
        raise ValueError(f"{spec.recipe}'s model has no config.vocab_size; the benchmarks "
                         "need a token-level language model")
    return int(config.vocab_size)
