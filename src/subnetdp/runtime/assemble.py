"""Putting the full model back together from the workers' pieces, and keeping buffers in sync."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from subnetdp.plan import Plan
from subnetdp.runtime.groups import HolderGroups
from subnetdp.subnet.units import unit_index


def owned_state(
    module: nn.Module, plan: Plan, unit_names: Sequence[str], *, rank: int
) -> dict[str, torch.Tensor]:
    """The state entries this rank is responsible for: units it owns (it is their lowest-ranked
    holder) and, on rank 0, the shared entries. Together, over all ranks, they cover the full
    model exactly once."""
    out = {}
    for key, value in module.state_dict().items():
        u = unit_index(key, unit_names)
        mine = rank == 0 if u is None else plan.owner(u) == rank
        if mine:
            out[key] = value.detach().to("cpu", copy=True)
    return out


def gather_full_state_dict(
    module: nn.Module,
    plan: Plan,
    unit_names: Sequence[str],
    full_keys: Sequence[str],
    *,
    rank: int,
    dst: int = 0,
) -> dict[str, torch.Tensor] | None:
    """The full model's state dict on ``dst`` (None elsewhere), each unit taken from its owner.

    Collective over the world. Keys come back in the full model's own order so that the result
    loads into the plain model class.
    """
    mine = owned_state(module, plan, unit_names, rank=rank)
    parts: list[dict[str, torch.Tensor]] | None = (
        [{} for _ in range(plan.world)] if rank == dst else None
    )
    dist.gather_object(mine, parts, dst=dst)
    if parts is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    missing = [k for k in full_keys if k not in merged]
    if missing:
        raise RuntimeError(f"assembled state is missing {missing[:5]} (plan/model mismatch?)")
    return {k: merged[k] for k in full_keys}


def sync_buffers(
    module: nn.Module,
    plan: Plan,
    unit_names: Sequence[str],
    groups: HolderGroups,
    *,
    rank: int,
) -> None:
    """Average floating-point persistent buffers (e.g. BatchNorm running statistics) over
    their holders; shared ones over the world. Call before evaluation and checkpointing.
    Collectives follow unit order (shared last) on every rank, like the reducer."""
    persistent = set(module.state_dict().keys())
    by_unit: dict[int | None, list[torch.Tensor]] = {}
    for key, buf in module.named_buffers():
        if key not in persistent or not buf.is_floating_point():
            continue
        by_unit.setdefault(unit_index(key, unit_names), []).append(buf)
    order: list[int | None] = [*range(plan.num_units), None]
    for u in order:
        holders = tuple(range(plan.world)) if u is None else tuple(plan.holders(u))
        if rank not in holders or len(holders) < 2 or u not in by_unit:
            continue
        bufs = by_unit[u]
        flat = torch.cat([b.reshape(-1) for b in bufs])
        dist.all_reduce(flat, group=groups.group(holders))
        flat.div_(len(holders))
        offset = 0
        with torch.no_grad():
            for b in bufs:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()
