"""Whether a tensor's saved pieces rebuild it exactly, decided from the files' headers before
anything is allocated.

[Note: piece coverage]
A full entry is assembled into ``torch.empty`` and every position must be written by exactly
one piece: a gap would export uninitialised memory, an overlap would keep whichever piece came
last. A piece is the whole entry or a slice ``key@dim:start:stop`` (all of every other dim), so
two pieces along different dims always overlap, and the pieces of an entry are valid exactly
when there is one whole piece, or the slices share one dim and their intervals tile
``[0, size)``: an interval union per dim, with no mask to allocate. Each piece must also lie
inside the entry (dim and stop within the shape), have the entry's shape in every other dim,
and the entry's dtype (an int8 piece is never cast to fp32). The entry's own element count is
bounded by the bytes of the checkpoint's files, so a crafted 2^50-element shape is refused
before it is allocated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# safetensors' dtype codes (``get_slice(name).get_dtype()``) and the manifest's torch spelling:
# every dtype a checkpoint can hold
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool,
}
MANIFEST_DTYPES: dict[str, torch.dtype] = {str(t): t for t in ST_DTYPES.values()}


@dataclass(frozen=True)
class PieceInfo:
    """One saved piece of an entry, as its file's header describes it (no data read)."""

    name: str  # the piece's name (``key`` or ``key@dim:start:stop``)
    file: str  # the rank file holding it
    where: tuple[int, int, int] | None  # (dim, start, stop); None: the whole entry
    shape: tuple[int, ...]
    dtype: str  # safetensors code, e.g. "F32"


def coverage_problem(key: str, shape: Sequence[int], dtype: torch.dtype | None,
                     pieces: Sequence[PieceInfo], budget_bytes: int) -> str | None:
    """What is wrong with ``pieces`` as the entry ``key`` of ``shape`` (and ``dtype``; None:
    the pieces must only agree), or None when they tile it exactly ([Note: piece coverage]).
    ``budget_bytes``: the bytes of all the checkpoint's files, a bound on any entry."""
    if not pieces:
        return f"no piece of {key!r}"
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        return f"{key!r} has the shape {list(shape)}, not a list of sizes"
    want = dtype
    for p in pieces:
        got = ST_DTYPES.get(p.dtype)
        if got is None:
            return f"piece {p.name!r} of {key!r} in {p.file} has the dtype {p.dtype}"
        if want is None:
            want = got
        elif got != want:
            return (f"piece {p.name!r} of {key!r} in {p.file} is {got}, but the entry is {want}"
                    " (it would be cast)")
    assert want is not None
    itemsize = torch.empty((), dtype=want).element_size()
    if math.prod(shape) * itemsize > budget_bytes:
        return (f"{key!r} claims the shape {list(shape)} ({math.prod(shape) * itemsize} bytes), "
                f"more than the checkpoint's files hold ({budget_bytes} bytes)")
    whole = [p for p in pieces if p.where is None]
    if whole:
        p = whole[0]
        if list(p.shape) != list(shape):
            return (f"piece {p.name!r} of {key!r} in {p.file} has the shape {list(p.shape)}, "
                    f"the entry {list(shape)}")
        if len(pieces) > 1:
            other = next(q for q in pieces if q is not p)
            return f"pieces {p.name!r} and {other.name!r} of {key!r} overlap"
        return None
    return _slices_problem(key, list(shape), pieces)


def _slices_problem(key: str, shape: list[int], pieces: Sequence[PieceInfo]) -> str | None:
    spans: list[tuple[int, int, PieceInfo]] = []
    dim0 = None
    for p in pieces:
        assert p.where is not None
        dim, start, stop = p.where
        if dim >= len(shape) or not start < stop <= shape[dim]:
            return (f"piece {p.name!r} of {key!r} in {p.file} lies outside the entry's shape "
                    f"{shape}")
        expect = [*shape[:dim], stop - start, *shape[dim + 1:]]
        if list(p.shape) != expect:
            return (f"piece {p.name!r} of {key!r} in {p.file} has the shape {list(p.shape)}, "
                    f"its slice needs {expect}")
        if dim0 is not None and dim != dim0:
            return f"pieces {spans[0][2].name!r} and {p.name!r} of {key!r} overlap"
        dim0 = dim
        spans.append((start, stop, p))
    assert dim0 is not None
    spans.sort(key=lambda s: (s[0], s[1]))
    reached, last = 0, None
    for start, stop, p in spans:
        if start < reached:
            assert last is not None
            return f"pieces {last.name!r} and {p.name!r} of {key!r} overlap"
        if start > reached:
            return (f"no piece of {key!r} covers positions {reached}:{start} of dim {dim0} "
                    f"(a gap)")
        reached, last = stop, p
    if reached != shape[dim0]:
        return (f"no piece of {key!r} covers positions {reached}:{shape[dim0]} of dim {dim0} "
                f"(a gap)")
    return None
