"""Pieces: the full model's state cut along unit boundaries, and each rank's index map.

Block level (b-sdp) cuts nothing: every state entry is one piece, owned by the unit whose
module contains it, or shared. Neuron level (n-sdp) cuts each tensor of a layer pair along its
hidden dimension into one piece per group. A piece is named in *full-model* coordinates, so
every rank agrees on it; a ``LocalPiece`` says where it sits inside this rank's (narrower)
tensor. The reducer, assembly, buffer sync, checkpoints and export all go through this map.

Two kinds of parameter pieces are state but get no gradient averaging:
- frozen: the user froze the parameter (``requires_grad=False``) before wrapping. Every rank
  sees the same model, so every rank leaves it out of the reducer's global bucket layout;
- tied: a parameter registered under several names (``head.weight = emb.weight``). The first
  name (``named_parameters`` order) is the canonical piece, reduced once; every other name is
  an alias piece (``tied_to``) so that shards and the assembled state still carry that key,
  as the plain model's ``state_dict`` does. A tie must stay inside one unit (or the shared
  part), or forward masking would drop one side of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
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
    frozen: bool = False  # a parameter the user froze: never reduced, never trained
    tied_to: str | None = None  # this key is another name of that key's tensor (a tie)

    @property
    def reduced(self) -> bool:
        """Whether the reducer averages this piece's gradient (module doc)."""
        return self.is_param and not self.frozen and self.tied_to is None

    @property
    def name(self) -> str:
        """The piece's key in shards: the state key, or ``key@dim:start:stop`` for a slice."""
        return self.key if self.dim is None else f"{self.key}@{self.dim}:{self.start}:{self.stop}"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def tied_parameters(model: nn.Module) -> dict[str, str]:
    """Every alias of a tied parameter mapped to its canonical (first-registered) name."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(p), name)
        if canonical != name:
            out[name] = canonical
    return out


def full_pieces(
    model: nn.Module, unit_names: Sequence[str], groups: Sequence[NeuronGroup] | None = None
) -> list[Piece]:
    """Every persistent state entry of the *full* model (parameters and buffers), in
    ``state_dict`` order, cut into pieces. ``groups`` (n-sdp, in plan order) gives the
    neuron-level cut; without it, pieces are whole and belong to block units by name.
    Call it on the user's model before anything changes it: ``requires_grad`` and ties are
    read from it. Raises ``ValueError`` for a tie that forward masking would break."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    sliced: dict[str, tuple[int, list[tuple[int, NeuronGroup]]]] = {}
    for u, g in enumerate(groups or ()):
        for key, dim in g.pair.tensors:
            sliced.setdefault(key, (dim, []))[1].append((u, g))

    def unit_of(key: str) -> int | None:
        return None if groups is not None else unit_index(key, unit_names)

    ties = tied_parameters(model)
    for alias, canonical in ties.items():
        _check_tie(alias, canonical, unit_of, unit_names, sliced)
    out = []
    for key, t in model.state_dict(keep_vars=True).items():
        is_param = key in params
        frozen = is_param and not t.requires_grad
        if key not in sliced:
            n = t.shape[0] if t.ndim else 1
            out.append(Piece(key, unit_of(key), None, 0, n, tuple(t.shape), t.dtype, is_param,
                             frozen, ties.get(key)))
            continue
        dim, members = sliced[key]
        for u, g in sorted(members, key=lambda m: m[1].index):
            a, b = g.span(t.shape[dim])
            shape = (*t.shape[:dim], b - a, *t.shape[dim + 1 :])
            out.append(Piece(key, u, dim, a, b, shape, t.dtype, is_param, frozen))
    return out


def _check_tie(
    alias: str,
    canonical: str,
    unit_of: Callable[[str], int | None],
    unit_names: Sequence[str],
    sliced: Collection[str],
) -> None:
    if alias in sliced or canonical in sliced:
        raise ValueError(
            f"{alias!r} is tied to {canonical!r} and n-sdp would cut it into neuron groups; "
            "untie them or leave that layer pair out (neuron kinds)"
        )
    ua, uc = unit_of(alias), unit_of(canonical)
    if ua != uc:
        a, c = ("shared" if u is None else f"unit {unit_names[u]!r}" for u in (ua, uc))
        raise ValueError(
            f"{alias!r} ({a}) is tied to {canonical!r} ({c}), so forward masking would drop "
            "one side; untie them or keep both in one unit or both shared"
        )


def reduction_order(pieces: Sequence[Piece]) -> list[Piece]:
    """Reduced pieces (``Piece.reduced``) in the reducer's global order: reverse registration
    order (roughly the order backward produces gradients), except that the slices of one
    layer pair are gathered group by group where the pair is first met, so each group's
    slices (same holder set) form one bucket instead of being interleaved with the others'."""
    params = [p for p in pieces if p.reduced]
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
