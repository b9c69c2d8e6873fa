"""Per-worker batches. The data layer knows nothing of processes: only integers ``rank``/``world``.

Every training batch is a pure function of ``(seed, rank, step)``: the random state is derived
from that key, never carried between steps. Resuming at ``start_step`` therefore reproduces the
exact batches of an uninterrupted run without saving any sampler state in the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets)

# Domain tags so the streams for LM windows, image epochs and augmentation never coincide.
_LM, _EPOCH, _AUG = 1, 2, 3


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([k % 2**64 for k in key]))


def _check_rank(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank={rank}, world={world}")


def shard_bounds(n: int, rank: int, world: int) -> tuple[int, int]:
    """[lo, hi) of rank's contiguous, disjoint share of n items (sizes differ by at most 1)."""
    _check_rank(rank, world)
    return rank * n // world, (rank + 1) * n // world


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
    w = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int64)
    # Separate contiguous copies: callers flatten y with .view(-1) for the loss.
    return torch.from_numpy(w[:, :-1].copy()), torch.from_numpy(w[:, 1:].copy())


def lm_batch(tokens: np.ndarray, *, batch_size: int, seq_len: int, rank: int, world: int,
             seed: int, step: int) -> Batch:
    """Batch ``step`` of ``rank``: random windows from the rank's own contiguous shard.

    x, y are int64 [batch_size, seq_len] with y[:, t] = x[:, t + 1] (next-token targets). Shards
    are disjoint, so no two ranks ever train on the same token.
    """
    lo, hi = shard_bounds(len(tokens), rank, world)
    n_starts = hi - lo - seq_len  # a window needs seq_len + 1 tokens inside [lo, hi)
    if n_starts < 1:
        raise ValueError(
            f"rank {rank}'s shard has {hi - lo} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
            f"use a shorter seq_len, fewer workers or more data"
        )
    starts = lo + _rng(_LM, seed, rank, step).integers(0, n_starts, size=batch_size)
    return _windows(tokens, starts, seq_len)


def lm_batches(tokens: np.ndarray, *, batch_size: int, seq_len: int, rank: int, world: int,
               seed: int, start_step: int = 0) -> Iterator[Batch]:
    """Endless ``lm_batch`` stream from ``start_step`` on."""
    step = start_step
    while True:
        yield lm_batch(tokens, batch_size=batch_size, seq_len=seq_len, rank=rank, world=world,
                       seed=seed, step=step)
        step += 1


def lm_eval_batches(tokens: np.ndarray, *, batch_size: int, seq_len: int,
                    max_batches: int | None = None) -> Iterator[Batch]:
    """Non-overlapping windows from the start of ``tokens``, same on every call and every rank.

    The last batch may have fewer rows; weight losses by rows when averaging.
    """
    n_windows = (len(tokens) - 1) // seq_len
    if n_windows < 1:
        raise ValueError(f"{len(tokens)} validation tokens cannot fill one window of {seq_len}")
    starts = np.arange(n_windows, dtype=np.int64) * seq_len
    for b, i in enumerate(range(0, n_windows, batch_size)):
        if max_batches is not None and b >= max_batches:
            return
        yield _windows(tokens, starts[i : i + batch_size], seq_len)


def steps_per_epoch(n: int, *, batch_size: int, world: int) -> int:
    """Full batches each rank gets per epoch (the remainder of each shard is dropped)."""
    steps = (n // world) // batch_size
    if steps < 1:
        raise ValueError(f"{n} images over {world} ranks cannot fill one batch of {batch_size}")
    return steps


def _epoch_shard(n: int, *, rank: int, world: int, seed: int, epoch: int) -> np.ndarray:
    # Every rank draws the same permutation of the epoch and keeps its own slice: disjoint
    # within an epoch, reshuffled (and re-dealt across ranks) every epoch.
    per = n // world
    perm = _rng(_EPOCH, seed, epoch).permutation(n)
    _check_rank(rank, world)
    return perm[rank * per : (rank + 1) * per]


def image_batch_indices(n: int, *, batch_size: int, rank: int, world: int, seed: int,
                        step: int) -> np.ndarray:
    """Sample indices of image batch ``step`` for ``rank`` (pure function of its arguments)."""
    epoch, i = divmod(step, steps_per_epoch(n, batch_size=batch_size, world=world))
    shard = _epoch_shard(n, rank=rank, world=world, seed=seed, epoch=epoch)
    return shard[i * batch_size : (i + 1) * batch_size]


def random_crop_flip(x: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """Per-sample random crop (zero padding of H // 8 pixels) and horizontal flip, [B,C,H,W].

    Zero padding in normalised space pads with the dataset mean, the usual CIFAR recipe.
    """
    b, _, h, w = x.shape
    p = max(1, h // 8)
    padded = F.pad(x, (p, p, p, p)).permute(0, 2, 3, 1)  # [B, H+2p, W+2p, C] for gathering
    rows = torch.from_numpy(rng.integers(0, 2 * p + 1, b))[:, None] + torch.arange(h)
    cols = torch.from_numpy(rng.integers(0, 2 * p + 1, b))[:, None] + torch.arange(w)
    flip = torch.from_numpy(rng.random(b) < 0.5)[:, None]
    cols = torch.where(flip, cols.flip(1), cols)
    out = padded[torch.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]
    return out.permute(0, 3, 1, 2).contiguous()


def image_batches(images: torch.Tensor, labels: torch.Tensor, *, batch_size: int, rank: int,
                  world: int, seed: int, start_step: int = 0,
                  augment: bool = False) -> Iterator[Batch]:
    """Endless (x, y) stream for ``rank``: its shard of a per-epoch permutation, from start_step."""
    n = len(images)
    spe = steps_per_epoch(n, batch_size=batch_size, world=world)
    cached: tuple[int, np.ndarray] | None = None  # one permutation per epoch, not per step
    step = start_step
    while True:
        epoch, i = divmod(step, spe)
        if cached is None or cached[0] != epoch:
            cached = (epoch, _epoch_shard(n, rank=rank, world=world, seed=seed, epoch=epoch))
        idx = torch.from_numpy(cached[1][i * batch_size : (i + 1) * batch_size])
        x = images[idx]
        if augment:
            x = random_crop_flip(x, _rng(_AUG, seed, rank, step))
        yield x, labels[idx]
        step += 1


def image_eval_batches(images: torch.Tensor, labels: torch.Tensor, *, batch_size: int,
                       rank: int = 0, world: int = 1,
                       max_batches: int | None = None) -> Iterator[Batch]:
    """In-order batches over rank's contiguous share; the shares of all ranks cover every image
    exactly once. The last batch may be smaller."""
    lo, hi = shard_bounds(len(images), rank, world)
    for b, i in enumerate(range(lo, hi, batch_size)):
        if max_batches is not None and b >= max_batches:
            return
        j = min(i + batch_size, hi)
        yield images[i:j], labels[i:j]
