"""Pieces: the full model's state cut along unit boundaries, and each rank's index map.

Block level (b-sdp) cuts nothing: every state entry is one piece, owned by the unit whose
module contains it, or shared. Neuron level (n-sdp) cuts each tensor of a layer pair along its
hidden dimension into one piece per group. A piece is named in *full-model* coordinates, so
every rank agrees on it; a ``LocalPiece`` says where it sits inside this rank's (narrower)
tensor. The reducer, assembly, buffer sync, checkpoints and export all go through this map.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from subnetdp.subnet.neurons import NeuronGroup
from subnetdp.subnet.units import unit_index


@dataclass(frozen=True)
class Piece:
    """A whole state entry (``dim is None``) or its slice ``[start, stop)`` along ``dim``."""

    key: str
    unit: int | None  # index into the plan's units; None: shared
    dim: int | None
    start: int
    stop: int
    shape: tuple[int, ...]  # the piece's own shape
    dtype: torch.dtype
    is_param: bool

    @property
    def name(self) -> str:
        """The piece's key in shards: the state key, or ``key@dim:start:stop`` for a slice."""
        return self.key if self.dim is None else f"{self.key}@{self.dim}:{self.start}:{self.stop}"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _whole(key: str, t: torch.Tensor, unit: int | None, is_param: bool) -> Piece:
    n = t.shape[0] if t.ndim else 1
    return Piece(key, unit, None, 0, n, tuple(t.shape), t.dtype, is_param)


def full_pieces(
    model: nn.Module, unit_names: Sequence[str], groups: Sequence[NeuronGroup] | None = None
) -> list[Piece]:
    """Every persistent state entry of the *full* model (parameters and buffers), in
    ``state_dict`` order, cut into pieces. ``groups`` (n-sdp, in plan order) gives the
    neuron-level cut; without it, pieces are whole and belong to block units by name."""
    params = {n for n, _ in model.named_parameters()}
    sliced: dict[str, tuple[int, list[tuple[int, NeuronGroup]]]] = {}
    for u, g in enumerate(groups or ()):
        for key, dim in g.pair.tensors:
            sliced.setdefault(key, (dim, []))[1].append((u, g))
    out = []
    for key, t in model.state_dict(keep_vars=True).items():
        if key not in sliced:
            unit = None if groups is not None else unit_index(key, unit_names)
            out.append(_whole(key, t, unit, key in params))
            continue
        dim, members = sliced[key]
        for u, g in sorted(members, key=lambda m: m[1].index):
            a, b = g.span(t.shape[dim])
            shape = (*t.shape[:dim], b - a, *t.shape[dim + 1 :])
            out.append(Piece(key, u, dim, a, b, shape, t.dtype, key in params))
    return out


def reduction_order(pieces: Sequence[Piece]) -> list[Piece]:
    """Parameter pieces in the reducer's global order: reverse registration order (roughly
    the order backward produces gradients), except that the slices of one layer pair are
    gathered group by group where the pair is first met, so each group's slices (same holder
    set) form one bucket instead of being interleaved with the other groups'."""
    params = [p for p in pieces if p.is_param]
    units_of: dict[str, tuple[int, ...]] = {}
    for p in params:
        if p.dim is not None and p.unit is not None:
            units_of[p.key] = (*units_of.get(p.key, ()), p.unit)
    by_unit: dict[int, list[Piece]] = {}
    for p in reversed(params):
        if p.dim is not None and p.unit is not None:
            by_unit.setdefault(p.unit, []).append(p)
    out, done = [], set()
    for p in reversed(params):
        if p.dim is None or p.unit is None:
            out.append(p)
            continue
        family = units_of[p.key]
        if family in done:
            continue
        done.add(family)
        # Other tensors of the pair have the same family (same groups), so this takes them all.
        for u in family:
            out.extend(by_unit[u])
    return out


@dataclass(frozen=True)
class LocalPiece:
    """Where a piece lives in this rank's tensor: at ``local_start`` along ``piece.dim``, or
    the whole local tensor when ``whole`` (a tensor that *is* the piece, e.g. the trainable
    slice parameter of backward masking)."""

    piece: Piece
    local_start: int
    whole: bool = False

    @property
    def is_whole(self) -> bool:
        return self.whole or self.piece.dim is None

    def view(self, t: torch.Tensor) -> torch.Tensor:
        p = self.piece
        if self.is_whole:
            return t
        assert p.dim is not None
        return t.narrow(p.dim, self.local_start, p.stop - p.start)


def local_pieces(pieces: Sequence[Piece], held: Collection[int]) -> dict[str, list[LocalPiece]]:
    """This rank's index map: for each local state key, its held pieces in order. A sliced
    entry keeps its key even when no group of it is held (a zero-width local tensor)."""
    keep = set(held)
    out: dict[str, list[LocalPiece]] = {}
    offset: dict[str, int] = {}
    for p in pieces:
        if p.dim is not None:
            out.setdefault(p.key, [])
        if p.unit is not None and p.unit not in keep:
            continue
        at = offset.get(p.key, 0)
        out.setdefault(p.key, []).append(LocalPiece(p, at))
        if p.dim is not None:
            offset[p.key] = at + p.stop - p.start
    return out


def local_slices(
    pieces: Sequence[Piece], held: Collection[int]
) -> dict[str, tuple[int, torch.Tensor]]:
    """For every sliced entry, ``(dim, full indices of this rank's entries along dim)``: how
    to cut the full tensor down to the local one (``index_select``)."""
    keep = set(held)
    dims: dict[str, int] = {}
    idx: dict[str, list[torch.Tensor]] = {}
    for p in pieces:
        if p.dim is None:
            continue
        dims[p.key] = p.dim
        chunks = idx.setdefault(p.key, [])
        if p.unit is None or p.unit in keep:
            chunks.append(torch.arange(p.start, p.stop))
    return {
        k: (dims[k], torch.cat(v) if v else torch.zeros(0, dtype=torch.long))
        for k, v in idx.items()
    }
