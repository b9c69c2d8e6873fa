"""What differs between language modelling and image classification, behind one interface."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from subnetdp.train.config import TrainConfig

if TYPE_CHECKING:
    from subnetdp.train.data_identity import Recorded

Batch = tuple[torch.Tensor, torch.Tensor]


class Task(Protocol):
    items_per_batch: int  # tokens (lm) or samples (image) per rank per step

    def model_overrides(self) -> dict[str, Any]: ...
    def data_identity(self) -> dict[str, Any]: ...
    def mapped_files(self) -> list[str]: ...
    def batches(self, *, rank: int, world: int, start_step: int = 0) -> Iterator[Batch]: ...
    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...
    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]: ...


class LMTask:
    """Next-token prediction on the real text corpus (or the user's, with --data-dir)."""

    def __init__(self, cfg: TrainConfig, recorded: Recorded | None = None) -> None:
        from subnetdp.data.hf import TextSource
        from subnetdp.train.data_identity import prepare_recorded

        assert cfg.batch_size is not None and cfg.seq_len is not None
        self.cfg = cfg
        source = TextSource(cfg.dataset, tuple(cfg.data_files), cfg.text_field)
        # a resumed or evaluated run: its own tokenizer and data (train/data_identity.py)
        self.data = prepare_recorded(recorded,
                                     vocab_size=cfg.vocab_size or 4096, data_dir=cfg.data_dir,
                                     tokenizer=cfg.tokenizer or "bpe", source=source,
                                     accept_new_data=cfg.accept_new_data)
        self.items_per_batch = cfg.batch_size * cfg.seq_len

    def data_identity(self) -> dict[str, Any]:
        """What a checkpoint records of the data ([Note: data identity])."""
        return self.data.identity

    def mapped_files(self) -> list[str]:
        """The token files the workers memory-map ([Note: signals from inside])."""
        return sorted({str(a.filename) for a in (self.data.train, self.data.val)
                       if isinstance(a, np.memmap) and a.filename})

    def model_overrides(self) -> dict[str, Any]:
        # The trained tokenizer may come out smaller than asked on a small corpus.
        assert self.cfg.seq_len is not None
        return {"vocab_size": self.data.vocab_size, "max_seq_len": self.cfg.seq_len,
                **self.cfg.model_args}

    def batches(self, *, rank: int, world: int, start_step: int = 0) -> Iterator[Batch]:
        from subnetdp.data import lm_batches

        assert self.cfg.batch_size is not None and self.cfg.seq_len is not None
        return lm_batches(self.data.train, batch_size=self.cfg.batch_size,
                          seq_len=self.cfg.seq_len, rank=rank, world=world,
                          seed=self.cfg.seed, start_step=start_step)

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        from subnetdp.data import lm_eval_batches

        assert self.cfg.batch_size is not None and self.cfg.seq_len is not None
        was_training = model.training
        model.eval()
        total, n = 0.0, 0
        for x, y in lm_eval_batches(self.data.val, batch_size=self.cfg.batch_size,
                                    seq_len=self.cfg.seq_len,
                                    max_batches=self.cfg.eval_batches):
            x, y = x.to(device), y.to(device)
            total += self.loss(model(x), y).item() * y.numel()
            n += y.numel()
        model.train(was_training)
        val = total / n
        return {"val_loss": val, "val_ppl": math.exp(min(val, 50.0)), "val_tokens": float(n)}


class ImageTask:
    """Image classification: Fashion-MNIST (its Debian package, or --data-dir) or CIFAR-10/100
    (python batches from --data-dir), as the recipe's ``dataset`` default says."""

    def __init__(self, cfg: TrainConfig, defaults: dict[str, Any]) -> None:
        from subnetdp.data import load_cifar, load_fashion_mnist

        assert cfg.batch_size is not None
        self.cfg = cfg
        dataset = defaults.get("dataset", "fmnist")
        if dataset == "fmnist":
            self.train_x, self.train_y = load_fashion_mnist("train", cfg.data_dir)
            self.test_x, self.test_y = load_fashion_mnist("test", cfg.data_dir)
        else:  # cifar10 / cifar100; a missing folder raises DatasetMissingError saying how
            self.train_x, self.train_y = load_cifar(dataset, "train", cfg.data_dir)
            self.test_x, self.test_y = load_cifar(dataset, "test", cfg.data_dir)
        # CIFAR's standard augmentation (random crop with 4-pixel padding, horizontal flip);
        # Fashion-MNIST recipes train without it, as before.
        self.augment = dataset != "fmnist"
        self.items_per_batch = cfg.batch_size

    def model_overrides(self) -> dict[str, Any]:
        return dict(self.cfg.model_args)

    def data_identity(self) -> dict[str, Any]:
        return {}  # image sets are not recorded

    def mapped_files(self) -> list[str]:
        return []  # read into memory

    def batches(self, *, rank: int, world: int, start_step: int = 0) -> Iterator[Batch]:
        from subnetdp.data import image_batches

        assert self.cfg.batch_size is not None
        return image_batches(self.train_x, self.train_y, batch_size=self.cfg.batch_size,
                             rank=rank, world=world, seed=self.cfg.seed, start_step=start_step,
                             augment=self.augment)

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float(), y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        from subnetdp.data import image_eval_batches

        assert self.cfg.batch_size is not None
        was_training = model.training
        model.eval()
        total, correct, n = 0.0, 0, 0
        for x, y in image_eval_batches(self.test_x, self.test_y, batch_size=self.cfg.batch_size,
                                       max_batches=self.cfg.eval_batches):
            x, y = x.to(device), y.to(device)
            out = model(x)
            total += self.loss(out, y).item() * len(y)
            correct += int((out.argmax(-1) == y).sum())
            n += len(y)
        model.train(was_training)
        return {"val_loss": total / n, "val_accuracy": correct / n, "val_samples": float(n)}


def make_task(cfg: TrainConfig, recorded: Recorded | None = None) -> LMTask | ImageTask:
    """The run's task; ``recorded``: what the checkpoint it resumes or evaluates recorded."""
    from subnetdp.models import get_recipe

    recipe = get_recipe(cfg.recipe)
    if recipe.task == "lm":
        return LMTask(cfg, recorded)
    return ImageTask(cfg, recipe.defaults)
