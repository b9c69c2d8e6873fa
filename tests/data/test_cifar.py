"""The CIFAR loader on batch files written, in the official format, from the 20 + 20 real CIFAR
test images that PyPI foolbox==3.3.4 ships as PNGs (read without importing foolbox)."""

from __future__ import annotations

import importlib.util
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image  # pillow comes with matplotlib (the dev extra)

from subnetdp.data import CIFAR_MEAN, CIFAR_STD, DataFormatError, DatasetMissingError, load_cifar
from subnetdp.train.config import TrainConfig
from subnetdp.train.tasks import ImageTask, make_task


def _foolbox_pngs(prefix: str) -> list[tuple[np.ndarray, int]]:
    spec = importlib.util.find_spec("foolbox")
    assert spec is not None and spec.submodule_search_locations, \
        "foolbox==3.3.4 is missing (make setup installs it with --no-deps)"
    folder = Path(next(iter(spec.submodule_search_locations))) / "data"
    out = []
    for path in sorted(folder.glob(f"{prefix}_*.png")):
        m = re.fullmatch(rf"{prefix}_(\d+)_(\d+)\.png", path.name)
        assert m is not None
        out.append((np.asarray(Image.open(path).convert("RGB")), int(m[2])))
    assert len(out) == 20
    return out


def _row(img: np.ndarray) -> np.ndarray:
    # The official layout: 1024 red values, then green, then blue, each plane row-major.
    return img.transpose(2, 0, 1).reshape(-1)


def _write(path: Path, images: list[tuple[np.ndarray, int]], label_key: bytes) -> None:
    entry = {
        b"batch_label": b"written by test_cifar",
        b"data": np.stack([_row(img) for img, _ in images]).astype(np.uint8),
        label_key: [label for _, label in images],
        b"filenames": [f"img{i}.png".encode() for i in range(len(images))],
    }
    if label_key == b"fine_labels":
        entry[b"coarse_labels"] = [0] * len(images)
    path.write_bytes(pickle.dumps(entry, protocol=2))  # the originals are protocol-2 pickles


@pytest.fixture(scope="module")
def cifar10_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    images = _foolbox_pngs("cifar10")
    root = tmp_path_factory.mktemp("c10")
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    for i in range(5):  # 4 images per training batch, in order
        _write(folder / f"data_batch_{i + 1}", images[4 * i : 4 * i + 4], b"labels")
    _write(folder / "test_batch", images, b"labels")
    return root


@pytest.fixture(scope="module")
def cifar100_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    images = _foolbox_pngs("cifar100")
    folder = tmp_path_factory.mktemp("c100") / "cifar-100-python"
    folder.mkdir()
    _write(folder / "train", images, b"fine_labels")
    _write(folder / "test", images[:10], b"fine_labels")
    return folder  # pointing at the folder itself works too


def _pixels(x: torch.Tensor, name: str) -> np.ndarray:
    mean = torch.tensor(CIFAR_MEAN[name]).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR_STD[name]).view(1, 3, 1, 1)
    return (x * std + mean).mul(255).round().to(torch.uint8).numpy()


def test_cifar10_labels_and_pixel_order(cifar10_dir: Path) -> None:
    images = _foolbox_pngs("cifar10")
    for split in ("train", "test"):
        x, y = load_cifar("cifar10", split, str(cifar10_dir))
        assert x.shape == (20, 3, 32, 32) and x.dtype == torch.float32
        assert y.dtype == torch.int64
        # The first ten CIFAR-10 test labels: cat ship ship airplane frog frog car frog cat car.
        assert y[:10].tolist() == [3, 8, 8, 0, 6, 6, 1, 6, 3, 1]
        assert y.tolist() == [label for _, label in images]
        pix = _pixels(x, "cifar10")
        for i, (img, _) in enumerate(images):
            assert np.array_equal(pix[i], img.transpose(2, 0, 1)), i
    # Independent of the writer: CIFAR-10 test image 0's first red and green row values.
    assert pix[0, 0, 0, :5].tolist() == [158, 159, 165, 166, 160]
    assert pix[0, 1, 0, :5].tolist() == [112, 111, 116, 118, 112]
    # Normalised: the per-channel statistics are those of natural images, not of [0, 255].
    assert x.abs().mean() < 3


def test_cifar100_fine_labels(cifar100_dir: Path) -> None:
    images = _foolbox_pngs("cifar100")
    x, y = load_cifar("cifar100", "train", str(cifar100_dir))
    assert y.tolist() == [label for _, label in images]
    assert np.array_equal(_pixels(x, "cifar100")[7], images[7][0].transpose(2, 0, 1))
    x_test, _ = load_cifar("cifar100", "test", str(cifar100_dir))
    assert len(x_test) == 10


def test_missing_and_corrupt_data(cifar10_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(DatasetMissingError, match=r"cifar-10-python\.tar\.gz.*--data-dir"):
        load_cifar("cifar10", "train", None)
    with pytest.raises(DatasetMissingError, match="cifar-100-python"):
        load_cifar("cifar100", "train", str(cifar10_dir))  # the other CIFAR's folder
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for f in (cifar10_dir / "cifar-10-batches-py").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(DataFormatError, match="data_batch_3"):
        load_cifar("cifar10", "train", str(tmp_path))

    class Evil:
        def __reduce__(self):
            return (print, ("pickles run code",))

    (folder / "test_batch").write_bytes(pickle.dumps({b"data": Evil(), b"labels": []}))
    with pytest.raises(DataFormatError, match="refusing"):
        load_cifar("cifar10", "test", str(tmp_path))


def test_image_task_reads_cifar_with_augmentation(cifar100_dir: Path) -> None:
    cfg = TrainConfig(recipe="swin-t-cifar100", data_dir=str(cifar100_dir), batch_size=4,
                      nproc=2).resolved()
    task = make_task(cfg)
    assert isinstance(task, ImageTask) and task.augment
    x, y = next(task.batches(rank=1, world=2))
    assert x.shape == (4, 3, 32, 32) and y.shape == (4,)
    # crop + flip moved pixels: the batch is not a plain slice of the training images
    assert not any(torch.equal(x[0], t) for t in task.train_x)
    with pytest.raises(DatasetMissingError, match="--data-dir"):
        make_task(TrainConfig(recipe="resnet18-cifar10").resolved())
