"""The two ways ``SubnetDataParallel`` averages gradients over holders, behind one interface.

- ``ReducerBackend``: every holder keeps its units whole; subnetdp's bucketed reducer
  all-reduces each bucket over its holder group during backward (``runtime.reducer``).
- ``FSDPBackend``: each held unit is sharded with FSDP2 over its holders, so FSDP's
  reduce-scatter does the averaging (``runtime.fsdp``, docs/method.md §7).

The wrapper builds the subnetwork (drop, narrow, materialise, checkpointing) and then hands the
local module to one backend; everything that differs between the two lives here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from subnetdp.plan import Plan
from subnetdp.runtime.assemble import owns
from subnetdp.runtime.fsdp import (
    ShardRefresher,
    local_full_state,
    local_grad_sq_norm,
    local_tensor,
    shard_blocks,
)
from subnetdp.runtime.grouped import GroupedLayer, ungroup_state
from subnetdp.runtime.groups import HolderGroups
from subnetdp.runtime.masking import Trainable, backward_trainable, forward_trainable
from subnetdp.runtime.reducer import CommStats, HolderReducer
from subnetdp.runtime.refresh import Refresher
from subnetdp.strategy import Strategy
from subnetdp.subnet.adapter import UnitAdapter
from subnetdp.subnet.pieces import LocalPiece, Piece, reduction_order
from subnetdp.subnet.units import unit_modules


class Backend(Protocol):
    trainable: Trainable  # what the optimizer sees, and where its pieces sit
    stats: CommStats
    refresher: Refresher | ShardRefresher | None  # backward masking only

    def forward(self, *args: Any, **kwargs: Any) -> Any: ...

    def set_sync(self, on: bool) -> None:
        """False: the next backwards accumulate locally (``no_sync``)."""

    def grad_buffers(self) -> list[torch.Tensor]: ...

    def owned_grad_sq_norm(self, device: torch.device) -> torch.Tensor:
        """Squared gradient entries this rank counts, so that the sum over the world counts
        every element of the full model's gradient exactly once."""

    def local_state(self) -> dict[str, torch.Tensor]:
        """The local model's state in its plain (unsharded, ungrouped) layout."""


class ReducerBackend:
    """Holders keep whole copies; the reducer averages buckets over holder groups."""

    def __init__(
        self, module: nn.Module, *, plan: Plan, rank: int, groups: HolderGroups,
        pieces: Sequence[Piece], local: Mapping[str, Sequence[LocalPiece]], held: Sequence[int],
        strategy: Strategy, bucket_cap_mb: float, param_dtype: torch.dtype | None,
    ) -> None:
        self.module, self.param_dtype = module, param_dtype
        self.trainable = (
            backward_trainable(module, local, set(held), lambda sp: self.reducer.mark_ready(sp))
            if strategy.backward_masked else forward_trainable(module, local)
        )
        self.reducer = HolderReducer(
            self.trainable.params, self.trainable.local, reduction_order(pieces), plan,
            rank=rank, groups=groups, bucket_cap_bytes=int(bucket_cap_mb * 2**20),
            external=self.trainable.external,
        )
        self.stats = self.reducer.stats
        # The trainable pieces this rank owns: each counted once in the full model's grad norm.
        self._owned = [(p, lp) for key, p in self.trainable.params.items()
                       for lp in self.trainable.local[key] if owns(lp.piece, plan, rank)]
        self.refresher: Refresher | ShardRefresher | None = (
            Refresher(dict(module.named_parameters()), local, plan, rank=rank)
            if strategy.backward_masked else None
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and self.reducer.enabled:
            self.reducer.attach_grad_views()
        if self.param_dtype is None:
            return self.module(*args, **kwargs)
        device = next(self.module.parameters()).device.type
        with torch.autocast(device, dtype=self.param_dtype):
            return self.module(*args, **kwargs)

    def set_sync(self, on: bool) -> None:
        self.reducer.enabled = on

    def grad_buffers(self) -> list[torch.Tensor]:
        return [b.buffer for b in self.reducer.buckets if b.buffer is not None]

    def owned_grad_sq_norm(self, device: torch.device) -> torch.Tensor:
        grads = [lp.view(g) for p, lp in self._owned if (g := p.grad) is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack([n.float() for n in torch._foreach_norm(grads)]).square().sum()

    def local_state(self) -> dict[str, torch.Tensor]:
        return dict(self.module.state_dict())


class FSDPBackend:
    """Each held unit sharded over its holders with FSDP2; shared parameters over the world."""

    def __init__(
        self, module: nn.Module, *, plan: Plan, rank: int, groups: HolderGroups,
        adapter: UnitAdapter, local: Mapping[str, Sequence[LocalPiece]], held: Sequence[int],
        strategy: Strategy, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
        device: torch.device,
    ) -> None:
        self.module = module
        held_set = set(held)
        if strategy.backward_masked:  # freeze what this rank does not hold (whole blocks:
            backward_trainable(module, local, held_set, _no_slices)  # no slice parameters)
        units = list(enumerate(unit_modules(module, adapter)))
        if strategy.neuron_level:  # the per-group parts of grouped layers
            shardable = [(u, part) for layer in module.modules() if isinstance(layer, GroupedLayer)
                         for u, part in zip(layer.units, layer.parts, strict=True)]
        else:
            shardable = [(u, block) for u, (_, block) in units if u in held_set]
        frozen = [p for p in module.parameters() if not p.requires_grad]
        if strategy.backward_masked and param_dtype is not None:
            # non-held copies only ever run forward (in param_dtype): store them narrow
            for u, (_, block) in units:
                if u not in held_set:
                    block.to(param_dtype)
        # FSDP would reduce in param_dtype when reduce_dtype is None; we promise fp32
        if reduce_dtype is None and param_dtype is not None:
            reduce_dtype = torch.float32
        stored = local_tensor(next(module.parameters())).dtype
        self._wire = ((param_dtype or stored).itemsize, (reduce_dtype or stored).itemsize)
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        self.sharded, self.traffic = shard_blocks(
            module, shardable, plan, groups, device_type=device.type, mp_policy=policy,
            frozen=frozen,
            reshard_after_forward=not strategy.neuron_level,  # [Note: neuron groups]
        )
        self.trainable = Trainable(
            {k: p for k, p in module.named_parameters() if p.requires_grad}, {}
        )
        self.stats = CommStats(collective="fsdp")
        self.refresher: Refresher | ShardRefresher | None = (
            ShardRefresher([(u, block) for u, (_, block) in units], plan, rank=rank)
            if strategy.backward_masked else None
        )
        self._sync = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module(*args, **kwargs)
        if torch.is_grad_enabled() and self._sync:
            on_backward_end(out, self._count_reduction)
        return out

    def _count_reduction(self) -> None:
        """End of a synced backward: count the step and its FSDP traffic (payload bytes from
        the unsharded sizes, without FSDP's padding to a multiple of the mesh size, and the
        gathered and reduced dtypes: all-gathers and the reduce-scatter)."""
        self.stats.reductions += 1
        step = 0
        for t in self.traffic:
            b = t.bytes(*self._wire)
            if b:
                self.stats.by_group[t.ranks] = self.stats.by_group.get(t.ranks, 0) + b
                step += b
        self.stats.last_step_bytes = step
        self.stats.total_bytes += step

    def set_sync(self, on: bool) -> None:
        self._sync = on
        self.sharded[-1].set_requires_gradient_sync(on)  # the root; recurses

    def grad_buffers(self) -> list[torch.Tensor]:
        return []  # gradients are FSDP's sharded .grad tensors

    def owned_grad_sq_norm(self, device: torch.device) -> torch.Tensor:
        # shards are disjoint: each element is on exactly one rank
        return local_grad_sq_norm(self.trainable.params.values()).to(device)

    def local_state(self) -> dict[str, torch.Tensor]:
        return ungroup_state(self.module, local_full_state(self.module))


def _no_slices(p: nn.Parameter) -> None:
    raise RuntimeError("internal: a slice parameter under fsdp (nb-sdp does not compose)")


def on_backward_end(out: Any, callback: Any) -> None:
    """Run ``callback`` once when the backward pass through ``out`` finishes."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(out)
              if isinstance(t, torch.Tensor) and t.requires_grad]
    if leaves:
        def hook(grad: torch.Tensor) -> None:
            torch.autograd.Variable._execution_engine.queue_callback(callback)

        leaves[0].register_hook(hook)
