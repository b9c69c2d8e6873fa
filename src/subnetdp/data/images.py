"""Fashion-MNIST (and MNIST: same file names and format) from gzip or raw IDX files."""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from subnetdp.data import locate
from subnetdp.data.locate import FMNIST_FILES, DatasetMissingError

FMNIST_MEAN, FMNIST_STD = 0.2860, 0.3530  # of the 60k training pixels in [0, 1]
FMNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
_IDX_IMAGES, _IDX_LABELS = 0x00000803, 0x00000801  # uint8 data, 3 dims / 1 dim


class DataFormatError(ValueError):
    """A data file exists but is not what it claims to be (truncated, corrupt, wrong format)."""


def _bad(path: Path, why: str) -> DataFormatError:
    return DataFormatError(
        f"{path} is not a valid IDX file ({why}); re-download it or reinstall the package "
        f"(`apt-get install --reinstall -y {locate.FMNIST_DEB}`)"
    )


def read_idx(path: Path, *, magic: int) -> np.ndarray:
    """uint8 array of an IDX file (gzip-compressed if it ends in .gz), header checked."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError
        raise _bad(path, f"cannot decompress: {e}") from e
    if len(raw) < 4:
        raise _bad(path, "shorter than its header")
    (found,) = struct.unpack(">I", raw[:4])
    if found != magic:
        raise _bad(path, f"magic number {found:#010x}, expected {magic:#010x}")
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise _bad(path, "shorter than its header")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    if len(raw) - header != int(np.prod(dims)):
        raise _bad(path, f"{len(raw) - header} data bytes for shape {dims}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _find(root: Path, name: str) -> Path:
    for candidate in (root / f"{name}.gz", root / name):
        if candidate.exists():
            return candidate
    raise DatasetMissingError(
        f"{root} has no {name}[.gz]. Point --data-dir at a folder with the four Fashion-MNIST "
        f"IDX files, or omit it to use the Debian package (`{locate.FMNIST_APT}`)."
    )


def load_fashion_mnist(
    split: str, data_dir: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(images float32 [N, 1, 28, 28] normalised by mean/std, labels int64 [N]).

    ``split``: "train" (60,000) or "test" (10,000).
    """
    if split not in FMNIST_FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = Path(data_dir).expanduser() if data_dir else locate.fashion_mnist_dir()
    img_name, lab_name = FMNIST_FILES[split]
    img_path, lab_path = _find(root, img_name), _find(root, lab_name)
    images = read_idx(img_path, magic=_IDX_IMAGES)
    labels = read_idx(lab_path, magic=_IDX_LABELS)
    if len(images) != len(labels):
        raise _bad(img_path, f"{len(images)} images but {len(labels)} labels in {lab_path.name}")
    if labels.size and labels.max() >= len(FMNIST_CLASSES):
        raise _bad(lab_path, f"label {labels.max()} out of range 0..9")
    x = torch.from_numpy(images.astype(np.float32)).unsqueeze(1)
    x = x.div_(255.0).sub_(FMNIST_MEAN).div_(FMNIST_STD)
    return x, torch.from_numpy(labels.astype(np.int64))
