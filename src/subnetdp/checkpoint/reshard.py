"""Re-masking on resume: serve a checkpoint's pieces to a plan other than the one that wrote it.

A checkpoint stores each entry of the full model (and each optimizer state shaped like a
parameter) once, as whole entries or as slices ``key@dim:start:stop`` (``ckpt_io``). A rank of
*another* plan (another world size, coverage, scheme or neuron grouping) asks for the pieces it
holds under its own plan; ``PieceReader`` answers a piece the checkpoint has verbatim, and cuts
any other one out of the full entry assembled from the saved pieces. Values are copied, never
recomputed, so every loaded value equals the saved one bit for bit.

[Note: resharded resume]
``--resume RUN --reshard`` (and an elastic shrink, ``elastic``) continues a run under a new plan.
Bitwise: every parameter, buffer and optimizer tensor (``exp_avg``, ``exp_avg_sq``, ``step``),
the LR schedule's position and the step count. Not bitwise with the run that would have
continued unchanged: the data each rank draws (batches are a function of ``(seed, rank, world,
step)``, so a new world draws new batches), the global batch (``world x --batch-size``), which
units each rank trains (the new plan's masks), and the RNG streams (every rank is reseeded from
``(seed, step, rank)``, since the old ranks' streams have no meaning for the new ranks). A
resharded resume is itself deterministic: the same command gives the same run, and
``--reshard`` into the very same world and plan is an exact resume, RNG streams included.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from subnetdp.checkpoint.files import ShardReader, check_pieces, model_shapes, split_piece

__all__ = ["HeldCheckpoint", "PieceReader", "model_shapes", "reseed"]


class PieceReader(Mapping[str, torch.Tensor]):
    """Pieces under ``prefix`` of all of a checkpoint's rank files, for any plan's piece names.

    The manifest's ``model_state`` gives each full-model key its full shape, needed to
    assemble an entry that the checkpoint holds only in slices. Every entry's pieces are checked
    against it first, from the files' headers ([Note: piece coverage]): the model's against
    its dtype too, the optimizer's (whose dtype the manifest does not record) for agreeing."""

    def __init__(self, ckpt: Path, manifest: dict[str, Any], prefix: str) -> None:
        saved = ShardReader(ckpt, sorted(manifest["files"]), prefix)
        self._set(saved, manifest, check_pieces(ckpt, manifest, saved,
                                                with_dtype=prefix == "model/"))

    @classmethod
    def in_memory(cls, held: HeldCheckpoint, prefix: str) -> PieceReader:
        """The same service over a checkpoint held in memory (``HeldCheckpoint``)."""
        saved = {k[len(prefix):]: v for k, v in held.tensors.items() if k.startswith(prefix)}
        by_key: dict[str, list[str]] = {}
        for piece in saved:
            by_key.setdefault(split_piece(piece)[0], []).append(piece)
        reader = cls.__new__(cls)
        reader._set(saved, held.manifest, by_key)
        return reader

    def _set(self, saved: Mapping[str, torch.Tensor], manifest: dict[str, Any],
             by_key: dict[str, list[str]]) -> None:
        self._saved = saved
        self._shapes = model_shapes(manifest)
        self._by_key = {key: [(p, split_piece(p)[1]) for p in found]
                        for key, found in by_key.items()}
        self._cache: tuple[str, torch.Tensor] | None = None  # the last full entry assembled

    def __contains__(self, piece: object) -> bool:
        return isinstance(piece, str) and (piece in self._saved or
                                           split_piece(piece)[0] in self._by_key)

    def __getitem__(self, piece: str) -> torch.Tensor:
        if piece in self._saved:
            return self._saved[piece]  # the piece as written (the same plan's resume)
        key, where = split_piece(piece)
        if key not in self._by_key:
            raise KeyError(piece)
        full = self._full(key)
        if where is None:
            return full
        dim, start, stop = where
        return full.narrow(dim, start, stop - start)

    def _full(self, key: str) -> torch.Tensor:
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        found = self._by_key[key]
        full = torch.empty(self._shapes[key], dtype=self._saved[found[0][0]].dtype)
        for piece, where in found:  # they tile it exactly: checked in __init__
            view = full if where is None else full.narrow(where[0], where[1],
                                                          where[2] - where[1])
            view.copy_(self._saved[piece])
        self._cache = (key, full)
        return full

    def __iter__(self) -> Iterator[str]:
        return iter(self._saved)

    def __len__(self) -> int:
        return len(self._saved)


@dataclass(frozen=True)
class HeldCheckpoint:
    """A checkpoint held in memory, never written: the tensors a checkpoint's rank files hold
    (each piece once, by its owner; no RNG streams) and its manifest (``files`` empty). A
    growing run hands its state to a larger world as one ([Note: growing a run] in
    train/grow.py), loaded as a resharded resume loads the same checkpoint from files."""

    tensors: dict[str, torch.Tensor]
    manifest: dict[str, Any]

    @classmethod
    def merged(cls, parts: list[tuple[dict[str, torch.Tensor], dict[str, Any]]]
               ) -> HeldCheckpoint:
        """One checkpoint from every rank's ``Checkpointer.owned_state``; the manifest is the
        first rank's (the optimizer states named by any rank)."""
        tensors = {k: v for part, _ in parts for k, v in part.items()}
        first = parts[0][1]
        names = {kind: sorted({n for _, m in parts for n in m["optimizer"][kind]})
                 for kind in ("like_states", "scalar_states")}
        return cls(tensors, {**first, "optimizer": {**first["optimizer"], **names}})

    def scalars(self, prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}


def reseed(seed: int, step: int, rank: int) -> None:
    """Fresh RNG streams for a rank of a resharded run ([Note: resharded resume])."""
    import random

    import numpy as np

    mixed = (seed * 1_000_003 + step) * 1_009 + rank
    torch.manual_seed(mixed)
    np.random.seed(mixed % (1 << 32))
    random.seed(mixed)
