"""SDP composed with FSDP2 (ZeRO-3 inside each holder group), docs/method.md §7.

Each held unit is sharded with ``fully_shard`` over a device mesh made from its holder group,
so its parameters, gradients and optimizer state are split among exactly the workers that train
it, and FSDP's reduce-scatter averages over that mesh, i.e. divides by the holder count. The
shared parameters are sharded over the whole world by a last ``fully_shard`` on the root.
Units held by one worker get a one-rank mesh: nothing to exchange, but FSDP still applies the
mixed-precision policy to them.

[Note: one global order]
A collective over a holder group blocks until all its members reach it, so the ranks'
collectives must admit one global order. Every rank walks its blocks in the model's order
(forward) and in reverse (backward), the root's shared parameters first. Prefetch follows the
rule proved safe by ``plan.schedule`` ([Note: FSDP2's issue order] there): held block j
prefetches j-1 in backward and j+1 in forward only when this rank holds that block too
(FSDP2's default backward prefetch, the previous block *this rank* holds, jumps over gaps and
deadlocks; an empty list means that default, so "no prefetch" is the block itself). Before
any collective, every rank derives all ranks' schedules from the plan and refuses a schedule
with a cycle (``check_fsdp_schedule``). The same argument covers ``full_tensor`` calls made in
parameter order (assembly) and the refresh below, which is point to point in one batch.

[Note: neuron groups]
Under n-sdp the FSDP units are the per-group parts of a layer (``runtime.grouped``), not
blocks (gathered per block and holder group: the next note). Their backward all-gathers
would be issued when autograd reaches each part, and with activation checkpointing some from
inside a block's recomputation, in an order that depends on
which groups a rank holds: two ranks could meet two shared groups in opposite orders (we saw
the deadlock). So parts are not resharded after forward: they stay gathered until their
reduce-scatter, and backward issues reduce-scatters only. Parameters are then sharded between
steps and gathered during one (ZeRO-2-like within a step); gradients and optimizer state,
three quarters of the per-parameter bytes under AdamW, stay sharded.

[Note: one FSDP module per block and holder group]
A neuron group's parts sit in several layers (llama: the q, k, v and o parts of a head group;
the w1, w3 and w2 parts of an MLP group), and a block holds several groups. One FSDP module per
part meant about a hundred all-gathers and as many reduce-scatters per step on llama-tiny, each
a rendezvous of its holders: on gloo n-sdp+fsdp ran 3.6x b-sdp+fsdp's step with fewer bytes.
So the parts of one block whose groups have the same holders are one FSDP module
(``fully_shard([entry, *parts])``): one all-gather and one reduce-scatter per block and
holder group. ``GroupEntry``, a module without parameters that heads the list, is called by a
forward pre-hook of the block, in the sorted order of the holder groups (the same on every
rank: one global order), so FSDP gathers there and hooks its post-backward onto the entry's
input. The entries pass a scalar of their own along (FSDP would cast a real input to the compute
dtype; the residual stream keeps its own) and ``_AfterBlock`` hands the last entry's output a
zero gradient once the block input's gradient is complete: the reduce-scatter comes after every
part's backward, never after the first part's. Under activation checkpointing a recomputed part
would register a post-backward of its own mid-block, so checkpointed blocks keep one FSDP module
per part. FSDP hooks every module of a grouped ``fully_shard`` (each part's call re-entered the
group's pre- and post-forward); only the entry's are needed, so the group's hooks sit on the
entry alone (``torch_compat.hook_fsdp_on_first``): the parts run as plain modules on the gathered
parameters, and a grouped Linear layer as one matmul over its parts' weights
(``GroupedLayer.gather_first``). On llama-tiny (C = 0.5, 4 ranks; rank 0's CPU time per step
over a fake process group) that took n-sdp+fsdp from 1.63x b-sdp+fsdp's compute to 1.34x.

[Note: nb-sdp]
Under nb-sdp every worker keeps the full width (backward masking), so every grouped layer has a
part for every neuron group: the held groups' parts are sharded over their holders like
n-sdp's, the others stay whole and frozen (ignored by FSDP) and are refreshed like bb-sdp's
blocks below. One FSDP mesh per group of the same layer is then just one per part.

Backward masking (bb-sdp, nb-sdp): non-held blocks (parts) stay whole and frozen on every
worker (ignored by FSDP). Refresh is point to point from every holder's *shard*: holder i of a
unit sends its FSDP shard (dim-0 chunk i) to each non-holder, which writes it into the same
chunk of its frozen copy. Traffic equals the owner-sends-all refresh of the plain runtime,
spread over holders.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from subnetdp.plan import Plan
from subnetdp.plan.schedule import ADJACENT, OFF, check, fsdp_schedule
from subnetdp.runtime.grouped import GroupedLayer
from subnetdp.runtime.groups import HolderGroups
from subnetdp.runtime.refresh import exchange
from subnetdp.runtime.ring import GLOO_DEFAULTS, GlooComms
from subnetdp.torch_compat import default_group, hook_fsdp_on_first


def holder_mesh(groups: HolderGroups, ranks: tuple[int, ...], device_type: str) -> DeviceMesh:
    pg = groups.group(ranks)
    return world_mesh(device_type) if pg is None else _mesh(pg, device_type)


def world_mesh(device_type: str) -> DeviceMesh:
    return _mesh(default_group(), device_type)


def _mesh(pg: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    # A mesh's rank table must be a real tensor, also when built inside FakeTensorMode
    # (estimate.memory); outside fake mode this context does nothing.
    with unset_fake_temporarily():
        return DeviceMesh.from_group(pg, device_type)


@dataclass(frozen=True)
class GroupTraffic:
    """What one FSDP module moves per training step over its mesh (payload bytes: the
    unsharded tensors each collective produces or consumes)."""

    ranks: tuple[int, ...]
    numel: int  # parameter elements, unsharded
    gathers: int  # all-gathers per step: 2 when resharded after forward (re-gathered for
    # backward), 1 for the root, which FSDP keeps unsharded until backward

    def bytes(self, param_bytes: int, reduce_bytes: int) -> int:
        if len(self.ranks) < 2:
            return 0
        return self.numel * (self.gathers * param_bytes + reduce_bytes)


def shard_blocks(
    module: nn.Module,
    blocks: Sequence[tuple[int, nn.Module]],
    plan: Plan,
    groups: HolderGroups,
    *,
    device_type: str,
    mp_policy: MixedPrecisionPolicy,
    frozen: Iterable[nn.Parameter] = (),
    reshard_after_forward: bool = True,
    prefetch: str = ADJACENT,
    gloo: GlooComms = GLOO_DEFAULTS,
    sharded_before: int = 0,
) -> tuple[list[FSDPModule], list[GroupTraffic]]:
    """``fully_shard`` each ``(unit, block)`` over its holders' mesh, in unit order, then the
    root over the world (everything left: the shared parameters). ``frozen`` parameters (non-held
    units under backward masking) stay whole and local. ``reshard_after_forward=False`` keeps
    each block gathered from its forward to its backward ([Note: neuron groups]); ``prefetch``
    (``plan.schedule.ADJACENT`` or ``OFF``) applies to resharded blocks;
    ``gloo``: how gloo meshes communicate (``runtime.ring``); ``sharded_before``: parameter
    elements already in FSDP modules of their own (``shard_block_groups``). Returns the FSDP
    modules, root last, and their per-step traffic."""
    sharded: list[FSDPModule] = []
    traffic: list[GroupTraffic] = []
    ignored = set(frozen)
    in_blocks = 0
    for u, block in sorted(blocks, key=lambda b: b[0]):  # [Note: one global order]
        numel = sum(p.numel() for p in block.parameters())
        in_blocks += numel
        traffic.append(GroupTraffic(plan.holders(u), numel,
                                    gathers=2 if reshard_after_forward else 1))
        mesh = holder_mesh(groups, plan.holders(u), device_type)
        sharded.append(_shard(block, mesh, gloo, mp_policy=mp_policy,
                              reshard_after_forward=reshard_after_forward))
    _set_prefetch(sharded, [u for u, _ in sorted(blocks, key=lambda b: b[0])],
                  adjacent=prefetch == ADJACENT and reshard_after_forward)
    everyone = tuple(range(plan.world))
    rest = sum(p.numel() for p in module.parameters()) - in_blocks - sharded_before - sum(
        p.numel() for p in ignored)
    traffic.append(GroupTraffic(everyone, rest, gathers=1))
    world = holder_mesh(groups, everyone, device_type)
    sharded.append(_shard(module, world, gloo, mp_policy=mp_policy,
                          ignored_params=ignored or None))
    return sharded, traffic


class GroupEntry(nn.Module):
    """The head of one FSDP module of a block's parts ([Note: one FSDP module per block and
    holder group]): no parameters; called first, it is where FSDP gathers the parts."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a tensor of its own (a scalar): FSDP hooks the entry's output for backward
        return x.clone()


class _AfterBlock(torch.autograd.Function):
    """``x`` unchanged; backward gives ``trigger`` a zero gradient once ``x``'s is complete."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, trigger: torch.Tensor) -> torch.Tensor:
        ctx.like = trigger.detach()
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.zeros_like(ctx.like)


def shard_block_groups(
    blocks: Sequence[tuple[nn.Module, Sequence[tuple[int, nn.Module]]]],
    plan: Plan,
    groups: HolderGroups,
    *,
    device_type: str,
    mp_policy: MixedPrecisionPolicy,
    gloo: GlooComms = GLOO_DEFAULTS,
) -> tuple[list[FSDPModule], list[GroupTraffic]]:
    """``fully_shard`` the held parts ``(unit, part)`` of each block, one FSDP module per block
    and holder group, kept gathered from forward to their reduce-scatter ([Note: one FSDP
    module per block and holder group], [Note: neuron groups]). Blocks in model order."""
    sharded: list[FSDPModule] = []
    traffic: list[GroupTraffic] = []
    for block, parts in blocks:
        by_holders: dict[tuple[int, ...], list[nn.Module]] = {}
        for u, part in parts:
            by_holders.setdefault(plan.holders(u), []).append(part)
        entries = []
        for holders, members in sorted(by_holders.items()):
            # not a child of the block, which may be a container that runs every child
            # (resnet's residual ``Sequential``); the block's hook holds it, the parts carry
            # the FSDP state
            entry = GroupEntry()
            mesh = holder_mesh(groups, holders, device_type)
            mods = fully_shard([entry, *members], mesh=mesh, mp_policy=mp_policy,
                               reshard_after_forward=False)
            gloo.apply(mods[0], mesh)
            mods[0].set_modules_to_backward_prefetch([mods[0]])  # [Note: neuron groups]
            hook_fsdp_on_first(mods[0], entry)
            sharded.append(mods[0])
            entries.append(entry)
            traffic.append(GroupTraffic(holders, sum(p.numel() for m in members
                                                     for p in m.parameters()), gathers=1))
        if entries:
            block.register_forward_pre_hook(_entry_hook(entries), with_kwargs=True)
            _gather_first(block, {id(part) for _, part in parts})
    return sharded, traffic


def _gather_first(block: nn.Module, gathered: set[int]) -> None:
    """Tell the block's grouped layers that its entries gather their parts (module doc)."""
    for layer in block.modules():
        if isinstance(layer, GroupedLayer):
            if not all(id(part) in gathered for part in layer.parts):
                raise RuntimeError(f"internal: a grouped layer of {type(block).__name__} has "
                                   "parts that the block's FSDP entries do not gather")
            layer.gather_first()


def _entry_hook(entries: list[GroupEntry]) -> Any:
    def hook(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not args or not isinstance(args[0], torch.Tensor):
            raise TypeError(f"n-sdp with fsdp gathers a block's neuron groups before it runs "
                            f"and needs its input tensor first; {type(block).__name__} was "
                            "called without one")
        x = args[0]
        training = torch.is_grad_enabled() and x.requires_grad
        trigger = x.new_zeros((), requires_grad=training)  # the entries' own input
        for entry in entries:
            trigger = entry(trigger)
        if not training:  # gathers only (evaluation)
            return None
        return (_AfterBlock.apply(x, trigger), *args[1:]), kwargs

    return hook


def _shard(module: nn.Module, mesh: DeviceMesh, gloo: GlooComms, **kw: Any) -> FSDPModule:
    """``fully_shard`` over ``mesh``, set up by ``gloo`` where the mesh is gloo's (the
    baselines and SDP + FSDP alike)."""
    out = fully_shard(module, mesh=mesh, **kw)
    gloo.apply(out, mesh)
    return out


def _set_prefetch(mods: Sequence[FSDPModule], units: Sequence[int], *, adjacent: bool) -> None:
    """Explicit prefetch lists ([Note: one global order]): ``mods[i]`` is unit ``units[i]``."""
    for i, mod in enumerate(mods):
        prev = i > 0 and units[i - 1] == units[i] - 1
        nxt = i + 1 < len(mods) and units[i + 1] == units[i] + 1
        mod.set_modules_to_backward_prefetch([mods[i - 1] if adjacent and prev else mod])
        mod.set_modules_to_forward_prefetch([mods[i + 1]] if adjacent and nxt else [])


def check_fsdp_schedule(
    plan: Plan, module_units: Sequence[int], *, reshard_after_forward: bool, prefetch: str,
    refresh: bool,
) -> None:
    """Refuse (``plan.schedule.ScheduleError``) a composition whose collectives could deadlock.
    ``module_units``: the unit of every FSDP module of the *full* model in forward order; each
    rank runs the ones it holds, in that order."""
    check({r: fsdp_schedule(plan, r, order=[u for u in module_units if plan.holds(r, u)],
                            prefetch=prefetch if reshard_after_forward else OFF,
                            reshard_after_forward=reshard_after_forward, refresh=refresh)
           for r in range(plan.world)})


def shard_over_mesh(
    module: nn.Module, blocks: Iterable[nn.Module], mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy, *, gloo: GlooComms = GLOO_DEFAULTS,
) -> list[GroupTraffic]:
    """Plain FSDP2 (the baselines): ``fully_shard`` every block over ``mesh``, then the root,
    which takes what is left (embeddings, norms, output layer); ``gloo`` as in
    ``shard_blocks``. Returns per-step traffic."""
    ranks = tuple(dist.get_process_group_ranks(mesh.get_group()))
    traffic = []
    for block in blocks:
        traffic.append(GroupTraffic(ranks, sum(p.numel() for p in block.parameters()), 2))
        _shard(block, mesh, gloo, mp_policy=mp_policy)
    rest = sum(p.numel() for p in module.parameters()) - sum(t.numel for t in traffic)
    traffic.append(GroupTraffic(ranks, rest, gathers=1))
    _shard(module, mesh, gloo, mp_policy=mp_policy)
    return traffic


def local_full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state with every sharded parameter gathered whole (collective over each
    parameter's mesh, in parameter order: [Note: one global order])."""
    out: dict[str, torch.Tensor] = {}
    for key, t in module.state_dict().items():
        out[key] = t.full_tensor() if isinstance(t, DTensor) else t
    return out


def local_grad_sq_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """Sum of squared gradient entries that this rank stores. Shards of one parameter are
    disjoint, so summing this over the world counts every gradient element exactly once."""
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack([n.float() for n in torch._foreach_norm(grads)]).square().sum()


def chunk_views(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """FSDP2's dim-0 split of ``t`` over ``n`` ranks (``torch.chunk``; trailing ranks may get
    empty shards)."""
    parts = list(torch.chunk(t, n, dim=0)) if t.ndim else [t.view(1)]
    empty = t.new_empty((0, *t.shape[1:])) if t.ndim else t.new_empty(0)
    return parts + [empty] * (n - len(parts))


class ShardRefresher:
    """Backward masking under FSDP: holders send their shards of each unit to non-holders.

    ``units``: ``(unit, block)`` for every unit of the full local model, in unit order; held
    blocks' parameters are FSDP ``DTensor`` shards, non-held ones plain frozen tensors.
    """

    def __init__(
        self, units: Sequence[tuple[int, nn.Module]], plan: Plan, *, rank: int,
        wire_dtype: torch.dtype = torch.float32,
    ) -> None:
        # Holders send their master shards (wire_dtype); a frozen copy may be stored narrower.
        self.rank, self.wire_dtype = rank, wire_dtype
        self.sends: dict[int, list[nn.Parameter]] = {}
        self.recvs: dict[int, list[torch.Tensor]] = {}
        everyone = range(plan.world)
        for u, block in units:
            holders = plan.holders(u)
            others = [r for r in everyone if r not in holders]
            for p in block.parameters():
                if rank in holders:  # the shard itself is read at refresh time (FSDP may
                    for dst in others:  # re-point a DTensor's local tensor at lazy init)
                        self.sends.setdefault(dst, []).append(p)
                else:
                    for src, view in zip(holders, chunk_views(p.detach(), len(holders)),
                                         strict=True):
                        self.recvs.setdefault(src, []).append(view)

    @property
    def bytes_sent(self) -> int:
        return sum(local_tensor(p).numel() * self.wire_dtype.itemsize
                   for ps in self.sends.values() for p in ps)

    def refresh(self) -> int:
        """One batch of point-to-point transfers; returns the bytes this rank sent."""
        shards = {dst: [local_tensor(p) for p in ps] for dst, ps in self.sends.items()}
        exchange(shards, self.recvs, self.wire_dtype)
        return self.bytes_sent


def my_chunk(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's FSDP2 dim-0 chunk of ``full``, sharded as ``like`` is (its mesh coordinate)."""
    mesh = like.device_mesh
    return chunk_views(full, mesh.size())[mesh.get_local_rank()]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard, anything else itself."""
    return t.to_local() if isinstance(t, DTensor) else t
