"""CIFAR-10 / CIFAR-100 from the standard "python version" batches in a user folder.

No package ships CIFAR (see docs/data.md), so the user downloads and extracts it once and points
``--data-dir`` at it. The layout is Krizhevsky's:

- CIFAR-10 (``cifar-10-batches-py/``): ``data_batch_1`` … ``data_batch_5`` and ``test_batch``,
  each a pickled dict with ``data`` (uint8 ``[N, 3072]``: 1024 red, then green, then blue
  values, each plane row-major 32×32) and ``labels``.
- CIFAR-100 (``cifar-100-python/``): ``train`` and ``test`` with ``data``, ``fine_labels``
  (the 100 classes used here) and ``coarse_labels``.

The batches are pickles; a pickle can run arbitrary code, so they are read with an unpickler
that only rebuilds numpy arrays and plain containers.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from subnetdp.data.images import DataFormatError
from subnetdp.data.locate import DatasetMissingError

CIFAR_URLS = {
    "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    "cifar100": "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
}
_FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}
_TITLES = {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100"}
_FILES = {
    "cifar10": {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]},
    "cifar100": {"train": ["train"], "test": ["test"]},
}
_LABEL_KEY = {"cifar10": "labels", "cifar100": "fine_labels"}
NUM_CLASSES = {"cifar10": 10, "cifar100": 100}
# Per-channel mean/std of the 50k training images in [0, 1] (the usual published values).
CIFAR_MEAN = {"cifar10": (0.4914, 0.4822, 0.4465), "cifar100": (0.5071, 0.4865, 0.4409)}
CIFAR_STD = {"cifar10": (0.2470, 0.2435, 0.2616), "cifar100": (0.2673, 0.2564, 0.2762)}

# What a CIFAR batch pickle may reference: numpy's array reconstruction (both the numpy 1 and
# numpy 2 module names) and, for batches re-saved by Python 3 with protocol 2, the
# bytes-from-latin-1 helper ``_codecs.encode``; nothing else.
_ALLOWED = {
    ("_codecs", "encode"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
}


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR batch")
        if module.startswith("numpy.core.") and hasattr(np, "_core"):
            module = module.replace("numpy.core.", "numpy._core.", 1)  # numpy 2's new name
        return super().find_class(module, name)


def cifar_missing_message(name: str, data_dir: str | None) -> str:
    where = f"{data_dir} has no {_FOLDERS[name]}/ (or its files)" if data_dir else (
        f"{_TITLES[name]} is not shipped by any package and --data-dir was not given")
    return (
        f"{where}. Download the python version once ({CIFAR_URLS[name]}), extract it "
        f"(`tar xzf {CIFAR_URLS[name].rsplit('/', 1)[1]}`) and pass --data-dir pointing at the "
        f"folder that contains {_FOLDERS[name]}/ (or at {_FOLDERS[name]}/ itself)."
    )


def cifar_dir(name: str, data_dir: str | None) -> Path:
    """The folder holding ``name``'s batch files: ``data_dir`` itself or its standard
    subfolder."""
    _check_name(name)
    if not data_dir:
        raise DatasetMissingError(cifar_missing_message(name, data_dir))
    root = Path(data_dir).expanduser()
    for candidate in (root / _FOLDERS[name], root):
        if all((candidate / f).is_file() for files in _FILES[name].values() for f in files):
            return candidate
    raise DatasetMissingError(cifar_missing_message(name, data_dir))


def _check_name(name: str) -> None:
    if name not in _FOLDERS:
        raise ValueError(f"unknown CIFAR dataset {name!r}; use 'cifar10' or 'cifar100'")


def read_cifar_batch(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 images ``[N, 3, 32, 32]``, int64 labels ``[N]``) of one batch file."""
    try:
        with path.open("rb") as f:
            # encoding=bytes: the official batches are Python 2 pickles of str.
            entry = _ArrayUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise DataFormatError(f"{path} is not a CIFAR python batch ({e}); re-extract the "
                              "archive") from e
    if not isinstance(entry, dict):
        raise DataFormatError(f"{path} holds a {type(entry).__name__}, not a CIFAR batch dict")
    entry = {k.decode() if isinstance(k, bytes) else k: v for k, v in entry.items()}
    if "data" not in entry or label_key not in entry:
        raise DataFormatError(f"{path} lacks 'data' or '{label_key}' (keys: {sorted(entry)}); "
                              "is it a batch of the other CIFAR?")
    data = np.asarray(entry["data"])
    labels = np.asarray(entry[label_key], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DataFormatError(f"{path}: data is {data.dtype} {data.shape}, expected uint8 "
                              "[N, 3072]")
    if len(labels) != len(data):
        raise DataFormatError(f"{path}: {len(data)} images but {len(labels)} labels")
    # Each row is the R plane, then G, then B, each row-major: exactly [3, 32, 32] in C order.
    return data.reshape(-1, 3, 32, 32), labels


def load_cifar(
    name: str, split: str, data_dir: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(images float32 ``[N, 3, 32, 32]`` normalised by the per-channel mean/std, labels int64
    ``[N]``) of CIFAR-10 (``name="cifar10"``) or CIFAR-100 fine labels (``"cifar100"``).

    ``split``: "train" (50,000) or "test" (10,000).
    """
    _check_name(name)
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = cifar_dir(name, data_dir)
    parts = [read_cifar_batch(root / f, _LABEL_KEY[name]) for f in _FILES[name][split]]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    if labels.size and not 0 <= labels.min() <= labels.max() < NUM_CLASSES[name]:
        raise DataFormatError(f"{root}: labels outside 0..{NUM_CLASSES[name] - 1}; is this "
                              f"{_TITLES[name]}?")
    mean = torch.tensor(CIFAR_MEAN[name]).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR_STD[name]).view(1, 3, 1, 1)
    x = torch.from_numpy(images).float().div_(255.0).sub_(mean).div_(std)
    return x, torch.from_numpy(labels)
