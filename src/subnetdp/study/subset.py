"""A fixed random subset of the Fashion-MNIST training images, as a ``--data-dir`` folder.

The over-fitting regime of the convergence study trains on a few thousand images and tests on
all 10,000: the folder holds the subset's IDX files and the package's test files, so the
ordinary loader (data/images.py) reads it like the full data set.
"""

from __future__ import annotations

import gzip
import os
import shutil
import struct
from pathlib import Path

import numpy as np

SUBSET_SEED = 0  # the same images for every cell and seed: only the training runs differ


def _write_idx(path: Path, array: np.ndarray, magic: int) -> None:
    header = struct.pack(f">I{array.ndim}I", magic, *array.shape)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(gzip.compress(header + np.ascontiguousarray(array).tobytes(), mtime=0))
    os.replace(tmp, path)


def fmnist_subset(runs: Path, n: int) -> Path:
    """``runs/data/fmnist-train<n>``: ``n`` training images drawn once (seed 0) without
    replacement, every test image. Built on first use; reused after."""
    from subnetdp.data import locate
    from subnetdp.data.images import _IDX_IMAGES, _IDX_LABELS, read_idx
    from subnetdp.data.locate import FMNIST_FILES

    out = runs / "data" / f"fmnist-train{n}"
    img_name, lab_name = FMNIST_FILES["train"]
    if all((out / f"{name}.gz").exists() for pair in FMNIST_FILES.values() for name in pair):
        return out  # complete (each file is renamed into place whole)
    src = locate.fashion_mnist_dir()
    images = read_idx(src / f"{img_name}.gz", magic=_IDX_IMAGES)
    labels = read_idx(src / f"{lab_name}.gz", magic=_IDX_LABELS)
    if not 1 <= n <= len(images):
        raise ValueError(f"train_images must be in [1, {len(images)}], got {n}")
    idx = np.sort(np.random.default_rng(SUBSET_SEED).permutation(len(images))[:n])
    out.mkdir(parents=True, exist_ok=True)
    for name in FMNIST_FILES["test"]:
        shutil.copyfile(src / f"{name}.gz", out / f"{name}.gz")
    _write_idx(out / f"{img_name}.gz", images[idx], _IDX_IMAGES)
    _write_idx(out / f"{lab_name}.gz", labels[idx], _IDX_LABELS)
    return out
