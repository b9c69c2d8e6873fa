"""The two ways ``SubnetDataParallel`` averages gradients over holders, behind one interface.

- ``ReducerBackend``: every holder keeps its units whole; subnetdp's bucketed reducer
  all-reduces each bucket over its holder group during backward (``runtime.reducer``).
- ``FSDPBackend``: each held unit is sharded with FSDP2 over its holders, so FSDP's
  reduce-scatter does the averaging (``runtime.fsdp``, docs/method.md §7).

The wrapper builds the subnetwork (drop, narrow, materialise, checkpointing) and then hands the
local module to one backend; everything that differs between the two lives here.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from subnetdp.plan import Plan
from subnetdp.plan.schedule import ADJACENT, OFF, check, reducer_schedule
from subnetdp.runtime.assemble import owns
from subnetdp.runtime.fsdp import (
    ShardRefresher,
    check_fsdp_schedule,
    local_full_state,
    local_grad_sq_norm,
    local_tensor,
    my_chunk,
    shard_block_groups,
    shard_blocks,
)
from subnetdp.runtime.grouped import GroupedLayer, ungroup_state
from subnetdp.runtime.groups import HolderGroups
from subnetdp.runtime.masking import Trainable, backward_trainable, forward_trainable
from subnetdp.runtime.reducer import CommStats, HolderReducer
from subnetdp.runtime.refresh import Refresher
from subnetdp.runtime.ring import GLOO_DEFAULTS, GlooComms
from subnetdp.strategy import Strategy
from subnetdp.subnet.adapter import UnitAdapter
from subnetdp.subnet.pieces import LocalPiece, Piece, reduction_order
from subnetdp.subnet.units import unit_modules


def _cast_in_place(module: nn.Module, dtype: torch.dtype) -> None:
    """``module.to(dtype)`` that keeps every parameter object (``frozen`` and the refresher
    hold them): floating parameters get a cast ``.data``, as ``Module.to`` gives plain tensors;
    floating buffers are replaced by cast copies, as ``Module.to`` replaces them.

    Not ``Module.to`` itself: FakeTensor parameters (the estimator) take its
    ``torch.utils.swap_tensors`` path, which refuses a new tensor that FakeTensorMode's
    converter memo references weakly, as it does every output of an op the process's
    dispatch cache (class-wide) has not seen yet, with these shapes and dtypes: whether
    ``_apply(): Couldn't swap`` was raised depended on what the process had run before. A
    dtype-only ``.data`` change is exact for FakeTensors (their device is not touched)."""
    with torch.no_grad():
        for m in module.modules():
            for p in m.parameters(recurse=False):
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
            for name, b in m.named_buffers(recurse=False):
                if b.is_floating_point():
                    setattr(m, name, b.to(dtype))


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

    def clip_targets(self) -> list[torch.Tensor]:
        """The gradients clipping scales (the optimizer's: under ZeRO, the reduced shards)."""

    def local_state(self) -> dict[str, torch.Tensor]:
        """The local model's state in its plain (unsharded, ungrouped) layout."""

    def plain(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` keyed like the local state (e.g. optimizer state by parameter name) in
        the plain layout. Collective under FSDP (each sharded tensor is gathered)."""

    def fill(self, dst: Mapping[str, torch.Tensor], entries: Mapping[str, torch.Tensor],
             local: Mapping[str, Sequence[LocalPiece]]) -> None:
        """Copy full-coordinate pieces (``entries``, by piece name) into ``dst`` (this rank's
        storage of each tensor, keyed like the module's state or like ``plain_params``),
        ``local`` saying where each piece sits. ``KeyError`` names missing pieces."""

    def part_places(self) -> dict[str, tuple[str, tuple[int, int, int]]]:
        """Grouped parts' parameters (fsdp n-sdp/nb-sdp): name -> (layer key, local slice)."""

    def plain_params(self) -> Mapping[str, torch.Tensor]:
        """See ``RankModel.plain_params``."""


class ReducerBackend:
    """Holders keep whole copies; the reducer averages buckets over holder groups."""

    def __init__(
        self, module: nn.Module, *, plan: Plan, rank: int, groups: HolderGroups,
        pieces: Sequence[Piece], local: Mapping[str, Sequence[LocalPiece]], held: Sequence[int],
        strategy: Strategy, bucket_cap_mb: float, param_dtype: torch.dtype | None,
        zero: int = 0,
    ) -> None:
        self.module, self.param_dtype, self.zero = module, param_dtype, zero
        self.trainable = (
            backward_trainable(module, local, set(held), _mark_ready(weakref.ref(self)))
            if strategy.backward_masked else forward_trainable(module, local)
        )
        self.reducer = HolderReducer(
            self.trainable.params, self.trainable.local, reduction_order(pieces), plan,
            rank=rank, groups=groups, bucket_cap_bytes=int(bucket_cap_mb * 2**20),
            external=self.trainable.filled, zero=zero,
        )
        self.stats = self.reducer.stats
        buckets = [(s.holders, f"bucket {i} ({s.names[0]}, ...)")
                   for i, s in enumerate(self.reducer.specs)]
        check({r: reducer_schedule(plan, r, buckets, refresh=strategy.backward_masked)
               for r in range(plan.world)})  # safe by construction; checked all the same
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
        full = [b.buffer for b in self.reducer.buckets if b.buffer is not None]
        # ZeRO-2's shard gradients are their own tensors (ZeRO-1's are slices of the buffers)
        return full + (self._shard_grads() if self.zero == 2 else [])

    def _shard_grads(self) -> list[torch.Tensor]:
        return [b.shard.grad for b in self.reducer.buckets
                if b.shard is not None and b.shard.grad is not None]

    def clip_targets(self) -> list[torch.Tensor]:
        if self.zero:
            return self._shard_grads()
        return [g for p in self.trainable.params.values() if (g := p.grad) is not None]

    def owned_grad_sq_norm(self, device: torch.device) -> torch.Tensor:
        # ZeRO: every element is in exactly one holder's shard (padding is zero)
        grads = (self._shard_grads() if self.zero else
                 [lp.view(g) for p, lp in self._owned if (g := p.grad) is not None])
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack([n.float() for n in torch._foreach_norm(grads)]).square().sum()

    def local_state(self) -> dict[str, torch.Tensor]:
        return dict(self.module.state_dict())

    def plain(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(tensors)

    def fill(self, dst: Mapping[str, torch.Tensor], entries: Mapping[str, torch.Tensor],
             local: Mapping[str, Sequence[LocalPiece]]) -> None:
        _check_pieces(dst, entries, local)
        for key, t in dst.items():
            for lp in local[key]:
                lp.view(t).copy_(entries[lp.piece.name])

    def part_places(self) -> dict[str, tuple[str, tuple[int, int, int]]]:
        return {}

    def plain_params(self) -> Mapping[str, torch.Tensor]:
        return dict(self.module.named_parameters())


def _mark_ready(backend: weakref.ref[ReducerBackend]) -> Callable[[nn.Parameter], None]:
    """The reducer's ``mark_ready``, reached weakly: parameter hooks call it
    ([Note: hooks hold their owner weakly] in ``runtime.reducer``)."""
    def mark(p: nn.Parameter) -> None:
        if (b := backend()) is not None:
            b.reducer.mark_ready(p)

    return mark


class FSDPBackend:
    """Each held unit sharded over its holders with FSDP2; shared parameters over the world."""

    def __init__(
        self, module: nn.Module, *, plan: Plan, rank: int, groups: HolderGroups,
        adapter: UnitAdapter, pieces: Sequence[Piece], local: Mapping[str, Sequence[LocalPiece]],
        held: Sequence[int], strategy: Strategy, param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None, device: torch.device, prefetch: bool = True,
        gloo: GlooComms = GLOO_DEFAULTS,
    ) -> None:
        self.module = module
        held_set = set(held)
        # The FSDP units: blocks, or under n-sdp/nb-sdp the per-group parts of grouped layers
        # (nb-sdp keeps every group's part, [Note: nb-sdp] in runtime.fsdp).
        if strategy.splits_layers:
            units = [(u, part) for layer in module.modules() if isinstance(layer, GroupedLayer)
                     for u, part in zip(layer.units, layer.parts, strict=True)]
            local_units = {u for u, _ in units}
            module_units = _part_order(module, pieces, local_units)
        else:
            units = [(u, block) for u, (_, block) in enumerate(unit_modules(module, adapter))]
            module_units = list(range(plan.num_units))
        if strategy.backward_masked:  # non-held units stay whole, frozen, and run forward only
            for u, m in units:
                if u not in held_set:
                    m.requires_grad_(False)
        shardable = [(u, m) for u, m in units if u in held_set]
        mode = ADJACENT if prefetch else OFF
        check_fsdp_schedule(plan, module_units,
                            reshard_after_forward=not strategy.fsdp_keeps_gathered,
                            prefetch=mode, refresh=strategy.backward_masked)
        frozen = [p for p in module.parameters() if not p.requires_grad]
        if strategy.backward_masked and param_dtype is not None:
            # non-held copies only ever run forward (in param_dtype): store them narrow
            for u, m in units:
                if u not in held_set:
                    _cast_in_place(m, param_dtype)
        # FSDP would reduce in param_dtype when reduce_dtype is None; we promise fp32
        if reduce_dtype is None and param_dtype is not None:
            reduce_dtype = torch.float32
        stored = local_tensor(next(module.parameters())).dtype
        self._wire = ((param_dtype or stored).itemsize, (reduce_dtype or stored).itemsize)
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        # [Note: one FSDP module per block and holder group]; not under backward masking,
        # whose per-part modules the AC layout shares, so AC changes no bit of its result
        grouped = (block_parts(module, adapter, shardable)
                   if strategy.splits_layers and not strategy.backward_masked else [])
        in_groups = {id(m) for _, parts in grouped for _, m in parts}
        self.sharded, self.traffic = shard_block_groups(
            grouped, plan, groups, device_type=device.type, mp_policy=policy, gloo=gloo)
        sharded, traffic = shard_blocks(
            module, [(u, m) for u, m in shardable if id(m) not in in_groups], plan, groups,
            device_type=device.type, mp_policy=policy, frozen=frozen,
            reshard_after_forward=not strategy.fsdp_keeps_gathered,  # [Note: neuron groups]
            prefetch=mode, gloo=gloo, sharded_before=sum(t.numel for t in self.traffic),
        )
        self.sharded += sharded
        self.traffic += traffic
        self.trainable = Trainable(
            {k: p for k, p in module.named_parameters() if p.requires_grad}, {}
        )
        self.stats = CommStats(collective="fsdp")
        self.refresher: Refresher | ShardRefresher | None = (
            ShardRefresher(units, plan, rank=rank)
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

    def clip_targets(self) -> list[torch.Tensor]:
        return [local_tensor(g) for p in self.trainable.params.values()
                if (g := p.grad) is not None]

    def owned_grad_sq_norm(self, device: torch.device) -> torch.Tensor:
        # shards are disjoint: each element is on exactly one rank
        return local_grad_sq_norm(self.trainable.params.values()).to(device)

    def local_state(self) -> dict[str, torch.Tensor]:
        return ungroup_state(self.module, local_full_state(self.module))

    def plain(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # full_tensor is a collective over each tensor's holder mesh; callers pass tensors in
        # parameter order ([Note: one global order] in runtime.fsdp)
        full = {k: t.full_tensor() if isinstance(t, DTensor) else t for k, t in tensors.items()}
        return ungroup_state(self.module, full)

    def fill(self, dst: Mapping[str, torch.Tensor], entries: Mapping[str, torch.Tensor],
             local: Mapping[str, Sequence[LocalPiece]]) -> None:
        parts = self.part_places()
        src = {key: parts.get(key, (key, None)) for key in dst}  # plain key, slice of it
        _check_pieces({k for k, _ in src.values()}, entries, local)
        shapes = self._plain_shapes()
        plain_key, plain = "", torch.empty(0)
        for key, t in dst.items():
            k, where = src[key]
            if k != plain_key:  # a layer's parts come together: assemble each key once
                plain_key, plain = k, torch.empty(shapes[k], dtype=t.dtype)
                for lp in local[k]:
                    lp.view(plain).copy_(entries[lp.piece.name])
            view = plain if where is None else plain.narrow(where[0], where[1],
                                                            where[2] - where[1])
            if isinstance(t, DTensor):
                t.to_local().copy_(my_chunk(view, t))
            else:
                t.copy_(view)

    def part_places(self) -> dict[str, tuple[str, tuple[int, int, int]]]:
        out = {}
        for path, layer in self.module.named_modules():
            if not isinstance(layer, GroupedLayer):
                continue
            prefix = f"{path}." if path else ""
            for i, (start, n) in enumerate(layer.spans):
                for name, dim in layer.sliced.items():
                    if isinstance(getattr(layer.parts[i], name), nn.Parameter):
                        out[f"{prefix}parts.{i}.{name}"] = (prefix + name, (dim, start, start + n))
        return out

    def plain_params(self) -> Mapping[str, torch.Tensor]:
        return _Templates(self._plain_shapes(), {
            k: (p.dtype, p.device) for k, p in self.module.named_parameters()}, self.part_places())

    def _plain_shapes(self) -> dict[str, torch.Size]:
        """Every local state key's plain shape (a grouped layer's: its parts concatenated)."""
        shapes = {k: t.shape for k, t in self.module.state_dict().items()}
        for path, layer in self.module.named_modules():
            if not isinstance(layer, GroupedLayer):
                continue
            prefix = f"{path}." if path else ""
            width = sum(n for _, n in layer.spans)
            for name, dim in layer.sliced.items():
                keys = [f"{prefix}parts.{i}.{name}" for i in range(len(layer.parts))]
                if keys[0] not in shapes:
                    continue  # a buffer: already under its own name, full width
                shape = list(shapes[keys[0]])
                shape[dim] = width
                for k in keys:
                    del shapes[k]
                shapes[prefix + name] = torch.Size(shape)
        return shapes


def block_parts(module: nn.Module, adapter: UnitAdapter,
                parts: Sequence[tuple[int, nn.Module]],
                ) -> list[tuple[nn.Module, list[tuple[int, nn.Module]]]]:
    """``parts`` (held grouped parts) by the block that contains them, blocks in model
    order; a checkpointed block's are left out ([Note: one FSDP module per block and holder
    group] in ``runtime.fsdp``), as are parts outside every block."""
    where = {id(m): (u, m) for u, m in parts}
    out = []
    for _, block in unit_modules(module, adapter):
        if getattr(block, "_subnetdp_checkpointed", False):
            continue
        mine = [where[id(m)] for m in block.modules() if id(m) in where]
        if mine:
            out.append((block, mine))
    return out


def _part_order(module: nn.Module, pieces: Sequence[Piece], held: set[int]) -> list[int]:
    """The unit of every grouped part of the *full* model in forward order (n-sdp + FSDP):
    layers in module order, groups in piece order. Each rank's parts are these, filtered to
    what it holds; checked here for this rank, so the schedule check sees the real order."""
    units_of: dict[str, list[int]] = {}
    for piece in pieces:
        if piece.unit is not None and piece.dim is not None:
            units_of.setdefault(piece.key, []).append(piece.unit)
    order: list[int] = []
    for path, layer in module.named_modules():
        if isinstance(layer, GroupedLayer):
            full = units_of[f"{path}.weight" if path else "weight"]
            if layer.units != [u for u in full if u in held]:
                raise RuntimeError(f"internal: {path}'s parts {layer.units} are not in the "
                                   f"plan's order {full}")
            order += full
    return order


def _check_pieces(keys: Iterable[str], entries: Mapping[str, torch.Tensor],
                  local: Mapping[str, Sequence[LocalPiece]]) -> None:
    missing = [lp.piece.name for k in keys for lp in local[k] if lp.piece.name not in entries]
    if missing:
        raise KeyError(f"the shards lack {len(missing)} pieces this rank holds, e.g. "
                       f"{missing[:3]}; the checkpoint is incomplete or from another plan")


class _Templates(Mapping[str, torch.Tensor]):
    """Plain-layout parameter templates made on access (FSDP ranks store shards, so there is
    no local tensor of that shape to hand out; nothing is allocated until asked)."""

    def __init__(self, shapes: Mapping[str, torch.Size],
                 params: Mapping[str, tuple[torch.dtype, torch.device]],
                 parts: Mapping[str, tuple[str, tuple[int, int, int]]]) -> None:
        self._shapes = shapes
        self._kind = {parts[k][0] if k in parts else k: v for k, v in params.items()}

    def __getitem__(self, key: str) -> torch.Tensor:
        dtype, device = self._kind[key]
        return torch.empty(self._shapes[key], dtype=dtype, device=device)

    def __iter__(self) -> Iterator[str]:
        return iter(self._kind)

    def __len__(self) -> int:
        return len(self._kind)


def on_backward_end(out: Any, callback: Any) -> None:
    """Run ``callback`` once when the backward pass through ``out`` finishes."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(out)
              if isinstance(t, torch.Tensor) and t.requires_grad]
    if leaves:
        def hook(grad: torch.Tensor) -> None:
            torch.autograd.Variable._execution_engine.queue_callback(callback)

        leaves[0].register_hook(hook)
