"""Putting the full model back together from the workers' pieces, and keeping buffers in sync.

Everything here goes through the index map of ``subnet.pieces``: a piece is named in full-model
coordinates (a whole entry, or a slice of one for n-sdp) and ``LocalPiece.view`` finds it in
this rank's possibly narrower tensor.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from subnetdp.plan import Plan
from subnetdp.runtime.groups import HolderGroups
from subnetdp.subnet.pieces import LocalPiece, Piece


def holders_of(plan: Plan, unit: int | None) -> tuple[int, ...]:
    """A unit's holders; everyone for shared pieces (``unit is None``)."""
    return tuple(range(plan.world)) if unit is None else tuple(plan.holders(unit))


def owns(piece: Piece, plan: Plan, rank: int) -> bool:
    """Whether ``rank`` is the piece's owner: its unit's lowest-ranked holder; rank 0 for
    shared pieces. Over all ranks, owners cover the full model exactly once."""
    return rank == 0 if piece.unit is None else plan.owner(piece.unit) == rank


def holds(piece: Piece, plan: Plan, rank: int) -> bool:
    """Whether ``rank`` trains the piece: a holder of its unit; everyone for shared pieces."""
    return piece.unit is None or rank in plan.holders(piece.unit)


def shard(
    tensors: Mapping[str, torch.Tensor],
    local: Mapping[str, Sequence[LocalPiece]],
    plan: Plan,
    *,
    rank: int,
    owned_only: bool,
) -> dict[str, torch.Tensor]:
    """Pieces of local tensors (keyed like ``local``) under their full-model names, as
    contiguous CPU copies; with ``owned_only``, only the pieces this rank owns, else those
    it holds (a copy of a unit it does not hold, refreshed under backward masking, lags)."""
    out = {}
    for key, t in tensors.items():
        for lp in local[key]:
            if not (owns(lp.piece, plan, rank) if owned_only else holds(lp.piece, plan, rank)):
                continue
            out[lp.piece.name] = lp.view(t.detach()).to("cpu", copy=True).contiguous()
    return out


def assemble(
    parts: Sequence[Mapping[str, torch.Tensor]], pieces: Sequence[Piece], full_keys: Sequence[str]
) -> dict[str, torch.Tensor]:
    """The full state dict from the union of pieces (``parts``: one shard per rank), in the
    full model's key order so that it loads into the plain model class."""
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    missing = [p.name for p in pieces if p.name not in merged]
    if missing:
        raise RuntimeError(f"assembled state is missing {missing[:5]} (plan/model mismatch?)")
    by_key: dict[str, list[Piece]] = {}
    for p in pieces:
        by_key.setdefault(p.key, []).append(p)
    for p in pieces:  # a piece of another shape could broadcast into its place silently
        if tuple(merged[p.name].shape) != tuple(p.shape):
            raise RuntimeError(f"piece {p.name} arrived as {tuple(merged[p.name].shape)}, not "
                               f"{tuple(p.shape)} (plan/model mismatch?)")
    out = {}
    for key in full_keys:
        ps = by_key[key]
        if ps[0].dim is None:
            out[key] = merged[ps[0].name]
            continue
        dim = ps[0].dim
        # the slices must tile [0, size) along one dim, so torch.empty below is fully written
        spans = sorted((p.start, p.stop) for p in ps)
        if any(p.dim != dim for p in ps) or spans[0][0] != 0 or any(
                a[1] != b[0] for a, b in itertools.pairwise(spans)):
            raise RuntimeError(f"the slices of {key} {spans} do not tile dim {dim} "
                               "(plan/model mismatch?)")
        shape = list(ps[0].shape)
        shape[dim] = spans[-1][1]
        full = torch.empty(shape, dtype=ps[0].dtype)
        for p in ps:
            full.narrow(dim, p.start, p.stop - p.start).copy_(merged[p.name])
        out[key] = full
    return out


def gather_full_state_dict(
    owned: dict[str, torch.Tensor],
    pieces: Sequence[Piece],
    full_keys: Sequence[str],
    *,
    world: int,
    rank: int,
    dst: int = 0,
) -> dict[str, torch.Tensor] | None:
    """The full model's state dict on ``dst`` (None elsewhere) from each rank's owned pieces.
    Collective over the world.

    Only the pieces' names, shapes and dtypes go through ``gather_object``; the weights go
    as tensors, one flat buffer per dtype and rank, sent to ``dst`` (on the GPU under NCCL):
    no pickling, no per-tensor messages."""
    meta = [(name, tuple(t.shape), t.dtype) for name, t in owned.items()]
    metas: list[Any] | None = [None] * world if rank == dst else None
    dist.gather_object(meta, metas, dst=dst)
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    if rank != dst:
        for _, names in _flat_groups(meta):
            flat = torch.cat([owned[n].reshape(-1) for n, _ in names]).to(device)
            if flat.numel():
                dist.send(flat, dst)
        return None
    assert metas is not None
    parts: list[dict[str, torch.Tensor]] = [dict(owned)]
    for src in range(world):
        if src == dst:
            continue
        part: dict[str, torch.Tensor] = {}
        for dtype, names in _flat_groups(metas[src]):
            flat = torch.empty(sum(math.prod(shape) for _, shape in names), dtype=dtype,
                               device=device)
            if flat.numel():
                dist.recv(flat, src)
            flat = flat.cpu()
            offset = 0
            for name, shape in names:
                n = math.prod(shape)
                part[name] = flat[offset : offset + n].view(shape)
                offset += n
        parts.append(part)
    return assemble(parts, pieces, full_keys)


def _flat_groups(
    meta: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
) -> list[tuple[torch.dtype, list[tuple[str, tuple[int, ...]]]]]:
    """A rank's pieces grouped by dtype (one buffer each), in an order both sides compute the
    same way (a group without elements is not sent)."""
    groups: dict[torch.dtype, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape, dtype in meta:
        groups.setdefault(dtype, []).append((name, shape))
    return sorted(groups.items(), key=lambda kv: str(kv[0]))


def _per_unit(
    tensors: Mapping[str, torch.Tensor], local: Mapping[str, Sequence[LocalPiece]]
) -> dict[int | None, list[torch.Tensor]]:
    """Local views of every piece, grouped by unit (None: shared), in piece order; a tie's
    alias is left out (it is its canonical piece's storage)."""
    out: dict[int | None, list[torch.Tensor]] = {}
    for key, t in tensors.items():
        for lp in local[key]:
            if lp.piece.tied_to is None:
                out.setdefault(lp.piece.unit, []).append(lp.view(t))
    return out


def sync_buffers(
    buffers: Mapping[str, torch.Tensor],
    local: Mapping[str, Sequence[LocalPiece]],
    plan: Plan,
    groups: HolderGroups,
    *,
    rank: int,
) -> None:
    """Average floating-point persistent buffers (e.g. BatchNorm running statistics) over
    their holders; shared ones over the world. Call before evaluation and checkpointing.
    Collectives follow unit order (shared last) on every rank, like the reducer."""
    floats = {k: b for k, b in buffers.items() if b.is_floating_point()}
    by_unit = _per_unit(floats, local)
    for u in [*range(plan.num_units), None]:
        holders = holders_of(plan, u)
        if rank not in holders or len(holders) < 2 or u not in by_unit:
            continue
        views = by_unit[u]
        flat = torch.cat([v.reshape(-1) for v in views])
        dist.all_reduce(flat, group=groups.group(holders))
        flat.div_(len(holders))
        offset = 0
        with torch.no_grad():
            for v in views:
                v.copy_(flat[offset : offset + v.numel()].view_as(v))
                offset += v.numel()


def broadcast_from_owners(
    tensors: Mapping[str, torch.Tensor],
    local: Mapping[str, Sequence[LocalPiece]],
    plan: Plan,
    groups: HolderGroups,
    *,
    rank: int,
) -> None:
    """Make holder copies identical for a model materialised independently on each rank:
    every piece goes from its owner to its other holders, in unit order (shared first)."""
    by_unit = _per_unit(tensors, local)
    with torch.no_grad():
        for u in [None, *range(plan.num_units)]:
            holders = holders_of(plan, u)
            if rank not in holders or len(holders) < 2:
                continue
            src = 0 if u is None else plan.owner(u)
            for v in by_unit.get(u, []):
                buf = v.contiguous()
                dist.broadcast(buf, src=src, group=groups.group(holders))
                if buf.data_ptr() != v.data_ptr():
                    v.copy_(buf)
