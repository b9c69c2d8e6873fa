"""``SubnetDataParallel``: a drop-in for ``DistributedDataParallel`` that trains subnetworks."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from subnetdp.plan import Plan, PlanError
from subnetdp.runtime.assemble import (
    broadcast_from_owners,
    gather_full_state_dict,
    owns,
    shard,
    sync_buffers,
)
from subnetdp.runtime.checkpointing import checkpoint_blocks
from subnetdp.runtime.fsdp import (
    ShardRefresher,
    local_full_state,
    local_grad_sq_norm,
    local_tensor,
    shard_blocks,
)
from subnetdp.runtime.grouped import GroupedLayer, group_layers, ungroup_state
from subnetdp.runtime.groups import HolderGroups
from subnetdp.runtime.masking import Trainable, backward_trainable, forward_trainable
from subnetdp.runtime.reducer import CommStats, HolderReducer
from subnetdp.runtime.refresh import Refresher
from subnetdp.subnet.adapter import UnitAdapter
from subnetdp.subnet.build import drop_units, is_on_meta, materialize, narrow_tensors
from subnetdp.subnet.neurons import NeuronGroup, plan_groups, unit_size
from subnetdp.subnet.pieces import full_pieces, local_pieces, local_slices, reduction_order
from subnetdp.subnet.units import describe_units, unit_modules

STRATEGIES = ("b-sdp", "n-sdp", "bb-sdp", "nb-sdp")
BACKWARD_MASKED = ("bb-sdp", "nb-sdp")  # full forward; gradients only for held units
NEURON_LEVEL = ("n-sdp", "nb-sdp")
OUTPUT_SCALINGS = ("none", "keep")


class SubnetDataParallel(nn.Module):
    """Wrap a model so this rank trains only the units the plan gives it.

    Usage mirrors DDP::

        with torch.device("meta"):
            model = Llama(cfg)                      # nothing allocated yet
        model = SubnetDataParallel(model, plan=plan, adapter=LLAMA_ADAPTER)
        opt = torch.optim.AdamW(model.parameters())  # only held + shared parameters
        loss = loss_fn(model(x), y); loss.backward()  # grads come back holder-averaged
        opt.step()

    A meta-device model is materialised with only the held units, each initialised from a seed
    derived from its name so that all holders agree (and the full model equals the union of
    the pieces). A model that is already materialised has its non-held units dropped, and its
    remaining values are broadcast from their owners so that holders start identical.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        plan: Plan,
        adapter: UnitAdapter,
        strategy: str = "b-sdp",
        device: torch.device | str | None = None,
        init_seed: int = 0,
        bucket_cap_mb: float = 25.0,
        output_scaling: str | None = None,
        refresh_every: int = 1,
        fsdp: bool = False,
        activation_checkpointing: bool = False,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        """``fsdp``: shard each held unit over its holders (FSDP2) and shared parameters over
        all workers (``runtime.fsdp``); ``activation_checkpointing``: recompute every block in
        backward (``runtime.checkpointing``); ``param_dtype``: compute dtype (e.g. bf16) while
        parameters, gradients and optimizer state stay fp32 (FSDP's mixed-precision policy
        under ``fsdp``, ``torch.autocast`` otherwise); ``reduce_dtype``: the dtype gradients
        are averaged in (FSDP only; default: fp32)."""
        super().__init__()
        if strategy not in STRATEGIES:
            raise ValueError(
                f"strategy {strategy!r} is not available in SubnetDataParallel; "
                f"choose one of {STRATEGIES} (use torch DDP for 'ddp')"
            )
        if output_scaling is None:  # measured default: see _scale_kept_outputs
            output_scaling = "keep" if strategy == "n-sdp" else "none"
        if output_scaling not in OUTPUT_SCALINGS:
            raise ValueError(f"output_scaling must be one of {OUTPUT_SCALINGS}, got "
                             f"{output_scaling!r}")
        if refresh_every < 1:
            raise ValueError(f"refresh_every must be >= 1 (1 = exact), got {refresh_every}")
        if output_scaling != "none" and strategy != "n-sdp":
            raise ValueError("output_scaling applies to n-sdp only (forward-masked neurons)")
        if fsdp and strategy == "nb-sdp":
            raise ValueError("nb-sdp does not compose with fsdp: a partly held layer would need "
                             "one FSDP mesh per neuron group; use n-sdp, b-sdp or bb-sdp")
        if reduce_dtype is not None and not fsdp:
            raise ValueError("reduce_dtype needs fsdp=True (the plain reducer averages in the "
                             "gradients' own dtype, fp32)")
        if not dist.is_initialized():
            raise RuntimeError("call torch.distributed.init_process_group before wrapping")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        plan.validate(self.world)
        self.plan, self.adapter, self.strategy = plan, adapter, strategy
        neuron_groups = _match_plan(plan, module, adapter, strategy)
        self.unit_names = [u.name for u in plan.units]
        # The full model's state cut along unit boundaries, and where this rank's pieces live.
        self.pieces = full_pieces(module, self.unit_names, neuron_groups)
        self.full_state_keys = list(module.state_dict().keys())
        self.held_units = plan.held_units(self.rank)
        self.backward_masked = strategy in BACKWARD_MASKED
        # Forward masking keeps only held units locally; backward masking keeps the full model.
        local_units = range(plan.num_units) if self.backward_masked else self.held_units
        self.local = local_pieces(self.pieces, local_units)
        slices = local_slices(self.pieces, local_units)

        if strategy == "b-sdp":
            drop_units(module, adapter, self.held_units)
        if device is None:
            device = _default_device()
        if is_on_meta(module):
            materialize(module, adapter, device=device, seed=init_seed, slices=slices)
            needs_broadcast = False
        else:
            narrow_tensors(module, slices)
            module.to(device)
            needs_broadcast = True
        self.module = module
        if set(module.state_dict()) != set(self.local):
            raise RuntimeError("internal: the local model's state keys do not match its pieces")

        everyone = tuple(range(self.world))
        self.groups = HolderGroups([*plan.holder_sets(), everyone], world=self.world,
                                   singletons=fsdp)
        if needs_broadcast:
            broadcast_from_owners(module.state_dict(), self.local, plan, self.groups,
                                  rank=self.rank)
        if fsdp and strategy in NEURON_LEVEL:  # one sub-layer per neuron group (FSDP needs it)
            group_layers(module, self.local)
        self._scaling_hooks = (
            _scale_kept_outputs(module, neuron_groups, self.held_units)
            if output_scaling == "keep" and neuron_groups else []
        )
        if activation_checkpointing:  # before sharding: FSDP's hooks stay outside recompute
            checkpoint_blocks(module, [name for name, m in unit_modules(module, adapter)
                                       if any(True for _ in m.parameters())])
        self.param_dtype = param_dtype
        self.fsdp = fsdp
        # (under fsdp, _compose_fsdp replaces it with the sharded parameters)
        self.trainable = (
            backward_trainable(module, self.local, set(self.held_units),
                               lambda sp: self.reducer.mark_ready(sp))
            if self.backward_masked else Trainable({}, {}) if fsdp
            else forward_trainable(module, self.local)
        )
        self._sync = True  # gradients are averaged in backward (False under no_sync)
        self.refresh_every = refresh_every
        if fsdp:
            self._compose_fsdp(module, adapter, reduce_dtype, device)
            return
        self.reducer: HolderReducer = HolderReducer(
            self.trainable.params,
            self.trainable.local,
            reduction_order(self.pieces),
            plan,
            rank=self.rank,
            groups=self.groups,
            bucket_cap_bytes=int(bucket_cap_mb * 2**20),
            external=self.trainable.external,
        )
        # The trainable pieces this rank owns: each counted once in the full model's grad norm.
        self._owned = [(p, lp) for key, p in self.trainable.params.items()
                       for lp in self.trainable.local[key] if owns(lp.piece, self.plan, self.rank)]
        self.stats = self.reducer.stats
        self.refresher: Refresher | ShardRefresher | None = (
            Refresher(dict(module.named_parameters()), self.local, plan, rank=self.rank)
            if self.backward_masked else None
        )
        self._refreshed_through = 0  # reductions already followed by a refresh

    def _compose_fsdp(
        self, module: nn.Module, adapter: UnitAdapter, reduce_dtype: torch.dtype | None,
        device: torch.device | str,
    ) -> None:
        """Shard held blocks over their holders and the rest over the world (runtime.fsdp)."""
        held = set(self.held_units)
        units = list(enumerate(unit_modules(module, adapter)))
        if self.strategy in NEURON_LEVEL:  # the per-group parts of grouped layers
            shardable = [(u, part) for layer in module.modules() if isinstance(layer, GroupedLayer)
                         for u, part in zip(layer.units, layer.parts, strict=True)]
        else:
            shardable = [(u, block) for u, (_, block) in units if u in held]
        frozen = [p for p in module.parameters() if not p.requires_grad]
        if self.backward_masked and self.param_dtype is not None:
            # non-held copies only ever run forward (in param_dtype): store them narrow
            for u, (_, block) in units:
                if u not in held:
                    block.to(self.param_dtype)
        # FSDP would reduce in param_dtype when reduce_dtype is None; we promise fp32
        if reduce_dtype is None and self.param_dtype is not None:
            reduce_dtype = torch.float32
        stored = local_tensor(next(module.parameters())).dtype
        self._wire = ((self.param_dtype or stored).itemsize, (reduce_dtype or stored).itemsize)
        policy = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=reduce_dtype)
        self.sharded, self.traffic = shard_blocks(
            module, shardable, self.plan,
            self.groups, device_type=torch.device(device).type, mp_policy=policy, frozen=frozen,
            reshard_after_forward=self.strategy not in NEURON_LEVEL,  # [Note: neuron groups]
        )
        self.trainable = Trainable(
            {k: p for k, p in module.named_parameters() if p.requires_grad}, {}
        )
        self.stats = CommStats(collective="fsdp")
        self.refresher = (
            ShardRefresher([(u, block) for u, (_, block) in units], self.plan, rank=self.rank)
            if self.backward_masked else None
        )
        self._refreshed_through = 0

    # -- the DDP surface ------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.backward_masked:
            self._maybe_refresh()
        if self.fsdp:
            out = self.module(*args, **kwargs)
            if torch.is_grad_enabled() and self._sync:
                _on_backward_end(out, self._count_reduction)
            return out
        if torch.is_grad_enabled() and self.reducer.enabled:
            self.reducer.attach_grad_views()
        if self.param_dtype is not None:
            with torch.autocast(next(self.module.parameters()).device.type,
                                dtype=self.param_dtype):
                return self.module(*args, **kwargs)
        return self.module(*args, **kwargs)

    def _count_reduction(self) -> None:
        """End of a synced backward under fsdp: count the step and its FSDP traffic (payload
        bytes from the unsharded sizes, without FSDP's padding to a multiple of the mesh size,
        and the gathered and reduced dtypes: all-gathers and the reduce-scatter)."""
        self.stats.reductions += 1
        step = 0
        for t in self.traffic:
            b = t.bytes(*self._wire)
            if b:
                self.stats.by_group[t.ranks] = self.stats.by_group.get(t.ranks, 0) + b
                step += b
        self.stats.last_step_bytes = step
        self.stats.total_bytes += step

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (gradient accumulation); the next backward outside
        this context reduces the accumulated sum."""
        prev, self._sync = self._sync, False
        self._set_sync(False)
        try:
            yield
        finally:
            self._sync = prev
            self._set_sync(prev)

    def _set_sync(self, on: bool) -> None:
        if self.fsdp:
            self.sharded[-1].set_requires_gradient_sync(on)  # the root; recurses
        else:
            self.reducer.enabled = on

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """What the optimizer should train: the local model's parameters, except that under
        backward masking frozen (non-held) parameters are left out and partly held ones are
        replaced by their held slices (``runtime.masking``)."""
        del recurse, remove_duplicate
        for name, p in self.trainable.params.items():
            local = name in self.local  # a local state key, not a slice's piece name
            yield (f"{prefix}{'module' if local else 'slices'}.{name}".lstrip("."), p)

    # -- what subnetdp adds ---------------------------------------------------------------
    @property
    def comm_stats(self) -> CommStats:
        return self.stats

    @property
    def params_held(self) -> int:
        """Parameter elements this rank stores (under backward masking: the full model; under
        fsdp: its shards)."""
        return sum(local_tensor(p).numel() for p in self.module.parameters())

    @property
    def params_trained(self) -> int:
        """Parameter elements this rank trains (with gradients and optimizer state)."""
        return sum(local_tensor(p).numel() for p in self.trainable.params.values())

    def tracked_modules(self) -> list[nn.Module]:
        """Modules whose parameters a memory tracker must count: the local model, and under
        nb-sdp the held slice parameters (views whose gradients and optimizer state live
        outside the model)."""
        extra = [nn.ParameterList(self.trainable.external)] if self.trainable.external else []
        return [self.module, *extra]

    def grad_buffers(self) -> list[torch.Tensor]:
        """The reducer's flat gradient buffers (parameters' ``.grad`` are views into them)."""
        if self.fsdp:
            return []
        return [b.buffer for b in self.reducer.buckets if b.buffer is not None]

    @torch.no_grad()
    def refresh(self) -> int:
        """Backward masking: send each unit's current values from its owner to the workers
        that do not hold it (collective over the world). Runs by itself before the forward
        that follows every ``refresh_every``-th reduced backward; call it to refresh now.
        Returns the bytes this rank sent."""
        if self.refresher is None:
            return 0
        sent = self.refresher.refresh()
        self.stats.last_refresh_bytes = sent
        self.stats.total_refresh_bytes += sent
        self._refreshed_through = self.stats.reductions
        return sent

    def _maybe_refresh(self) -> None:
        n = self.stats.reductions
        if n > self._refreshed_through and n % self.refresh_every == 0:
            self.refresh()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip gradients by the *full model's* norm and return that norm.

        A per-rank norm would differ between holders of the same unit, so they would scale the
        same averaged gradient differently and their copies would drift apart. Each parameter is
        counted once, by its owner (rank 0 for shared ones), and one scalar all-reduce over the
        world gives every rank the same norm and the same clip factor.
        """
        device = local_tensor(next(self.module.parameters())).device
        if self.fsdp:  # shards are disjoint: each element is on exactly one rank
            sq = local_grad_sq_norm(self.trainable.params.values()).to(device)
        else:
            grads = [lp.view(g) for p, lp in self._owned if (g := p.grad) is not None]
            sq = torch.zeros((), dtype=torch.float32, device=device)
            if grads:
                norms = torch._foreach_norm(grads)
                sq = torch.stack([n.float() for n in norms]).square().sum()
        dist.all_reduce(sq)
        total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        all_grads = [local_tensor(p.grad) for p in self.trainable.params.values()
                     if p.grad is not None]
        if all_grads:
            torch._foreach_mul_(all_grads, coef.to(all_grads[0].dtype))
        return total

    def sync_buffers(self) -> None:
        """Average BatchNorm-style running statistics over holders (before eval/checkpoint)."""
        buffers = {k: b for k, b in self.module.named_buffers() if k in self.local}
        sync_buffers(buffers, self.local, self.plan, self.groups, rank=self.rank)

    def full_state_dict(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """The full model's state dict on rank ``dst``, each unit from its owner. Collective."""
        self.sync_buffers()
        return gather_full_state_dict(self.shard_state(), self.pieces, self.full_state_keys,
                                      world=self.world, rank=self.rank, dst=dst)

    # -- shards (checkpoints) --------------------------------------------------------------
    def shard_state(
        self, tensors: Mapping[str, torch.Tensor] | None = None, *, owned_only: bool = True
    ) -> dict[str, torch.Tensor]:
        """This rank's pieces of the full model, keyed in *full-model* coordinates.

        ``tensors`` maps local state keys (``self.module.state_dict()`` keys) to tensors of the
        same local shape (default: the module's own state; pass e.g. ``{name: exp_avg}`` to
        shard optimizer state the same way). A piece key is the state key for a whole entry,
        or ``f"{key}@{dim}:{start}:{stop}"`` for a slice of the full entry along ``dim`` (n-sdp).
        With ``owned_only`` only pieces this rank owns are returned (units whose lowest-ranked
        holder it is; shared entries on rank 0), so the ranks' shards cover the full model
        exactly once. Values are contiguous CPU copies.
        """
        if tensors is None:
            src = (ungroup_state(self.module, local_full_state(self.module)) if self.fsdp
                   else dict(self.module.state_dict()))
        else:
            src = dict(tensors)
        return shard(src, self.local, self.plan, rank=self.rank, owned_only=owned_only)

    @torch.no_grad()
    def load_shard_state(
        self,
        entries: Mapping[str, torch.Tensor],
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Fill this rank's local tensors from full-coordinate pieces (the union of shards
        written by ``shard_state``). ``into`` maps local state keys to the tensors to fill
        (default: the module's own state). Raises ``KeyError`` naming the missing pieces."""
        if self.fsdp:
            raise NotImplementedError("loading shards into an fsdp-composed model is not built "
                                      "yet; checkpoints need fsdp off")
        dst = dict(self.module.state_dict()) if into is None else dict(into)
        missing = [lp.piece.name for k in dst for lp in self.local[k]
                   if lp.piece.name not in entries]
        if missing:
            raise KeyError(f"the shards lack {len(missing)} pieces this rank holds, e.g. "
                           f"{missing[:3]}; the checkpoint is incomplete or from another plan")
        for key, t in dst.items():
            for lp in self.local[key]:
                lp.view(t).copy_(entries[lp.piece.name])

def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _match_plan(
    plan: Plan, module: nn.Module, adapter: UnitAdapter, strategy: str
) -> list[NeuronGroup] | None:
    """Check that the plan was made for this model and strategy; for n-sdp, return the neuron
    groups its units name (in plan order)."""
    name = type(module).__name__
    groups: list[NeuronGroup] | None = None
    if strategy in NEURON_LEVEL:
        groups = plan_groups(module, adapter, [u.name for u in plan.units])
        sizes = [unit_size(module, g) for g in groups]
    else:
        units, _ = describe_units(module, adapter)
        if len(units) != plan.num_units:
            raise PlanError(
                f"the plan has {plan.num_units} units but {name} declares {len(units)}; build "
                "the plan from this model (make_plan(units=describe_units(...)))"
            )
        sizes = [u.size for u in units]
    plan_sizes = [u.size for u in plan.units]
    if plan_sizes != sizes and any(s != 1 for s in plan_sizes):
        raise PlanError(
            "the plan's unit sizes do not match the model's parameter counts; "
            "rebuild the plan from this model"
        )
    return groups


def _scale_kept_outputs(
    module: nn.Module, groups: list[NeuronGroup], held: list[int]
) -> list[Any]:
    """Output scaling (method.md §4): while training, what each narrowed pair contributes is
    multiplied by 1/keep-rate (all slots / held slots), like inverted dropout, so its expected
    size matches the full model that evaluation uses. It is the default for n-sdp because
    without it the full model is miscalibrated: measured on resnet18-fmnist at C = 0.5, the
    assembled model's accuracy was 0.41 without scaling and 0.80 with it (llama-tiny: val loss
    5.05 vs 4.95); see benchmarks/results/nsdp_*.md.

    It scales the *output* of the ``down`` module rather than its input: for a linear ``down``
    (``W·(s·h) = s·(W·h)``, the bias kept unscaled) the result is the same, but the scaled
    input would be one more activation saved for backward, while the scaled output replaces
    the unscaled one (a product with a constant saves nothing). A forward hook keeps model
    code unaware."""
    kept: dict[str, int] = {}
    pairs = {}
    for u in held:
        g = groups[u]
        pairs[g.pair.name] = g.pair
        kept[g.pair.name] = kept.get(g.pair.name, 0) + g.slot_stop - g.slot_start
    hooks = []
    for name, pair in pairs.items():
        scale = pair.slots / kept[name]
        if scale == 1.0:
            continue

        def hook(mod: nn.Module, _: Any, out: torch.Tensor, s: float = scale) -> Any:
            if not mod.training:
                return None
            bias = getattr(mod, "bias", None)
            if not isinstance(bias, torch.Tensor):
                return out * s
            shape = [1] * out.ndim
            conv = isinstance(mod, nn.modules.conv._ConvNd)
            shape[getattr(mod, "channel_dim", 1 if conv else -1)] = -1
            b = bias.view(shape)
            return (out - b) * s + b

        hooks.append(module.get_submodule(pair.down).register_forward_hook(hook))
    return hooks


def _on_backward_end(out: Any, callback: Any) -> None:
    """Run ``callback`` once when the backward pass through ``out`` finishes."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(out)
              if isinstance(t, torch.Tensor) and t.requires_grad]
    if leaves:
        def hook(grad: torch.Tensor) -> None:
            torch.autograd.Variable._execution_engine.queue_callback(callback)

        leaves[0].register_hook(hook)
