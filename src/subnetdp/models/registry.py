"""Named recipes: a model builder, its subnetdp adapter and training defaults.

``get_recipe("llama-134m").build_model()`` builds on the current default device; build large
models under ``with torch.device("meta"):`` and let subnetdp materialise only what a worker holds.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from subnetdp.models.llama import LLAMA_ADAPTER, LLAMA_FLAVOURS, Llama
from subnetdp.models.resnet import RESNET_ADAPTER, ResNet18
from subnetdp.models.swin import SWIN_ADAPTER, SwinTransformer, swin_config
from subnetdp.subnet.adapter import UnitAdapter


@dataclass(frozen=True)
class Recipe:
    """A named model + adapter + training defaults.

    Attributes:
        name: e.g. ``"llama-tiny"`` or ``"resnet18-cifar10"``.
        task: ``"lm"`` (tokens -> logits ``[B, T, V]``) or ``"image"`` (images -> ``[B, K]``).
        adapter: the model's units for subnetdp.
        build: builds the model; keyword overrides change its config (e.g. ``vocab_size=``).
        defaults: training defaults. lm: batch_size, seq_len, lr, warmup, weight_decay,
            vocab_size, optimizer, grad_clip. image: batch_size, lr, in_channels, num_classes,
            image_size, optimizer, momentum, weight_decay. ``lr`` is meant for ``optimizer``.
    """

    name: str
    task: str
    adapter: UnitAdapter
    build: Callable[..., nn.Module]
    defaults: dict[str, Any] = field(hash=False)

    def build_model(self, **overrides: Any) -> nn.Module:
        """Build on the current default device (wrap in ``torch.device("meta")`` for big ones)."""
        return self.build(**overrides)

    @property
    def optimizer_states(self) -> int:
        """Optimizer tensors per parameter, each as wide as it, of the recipe's own optimizer
        as training builds it (``train.build.make_optimizer``): AdamW 2 (exp_avg,
        exp_avg_sq), SGD with momentum 1 (momentum_buffer), plain SGD 0."""
        if self.defaults.get("optimizer", "adamw") == "sgd":
            return 1 if self.defaults.get("momentum", 0.9) else 0
        return 2


def _llama_builder(flavour: str) -> Callable[..., nn.Module]:
    def build(**overrides: Any) -> nn.Module:
        cfg = LLAMA_FLAVOURS[flavour]
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cfg)}
        if unknown:
            raise ValueError(
                f"unknown LLaMA config override(s) {sorted(unknown)}; valid: "
                f"{[f.name for f in dataclasses.fields(cfg)]}"
            )
        return Llama(dataclasses.replace(cfg, **overrides))

    return build


def _resnet_builder(in_channels: int, num_classes: int, widen: int = 1) -> Callable[..., nn.Module]:
    def build(**overrides: Any) -> nn.Module:
        valid = list(inspect.signature(ResNet18).parameters)
        unknown = set(overrides) - set(valid)
        if unknown:
            raise ValueError(f"unknown ResNet18 override(s) {sorted(unknown)}; valid: {valid}")
        kwargs: dict[str, Any] = {"in_channels": in_channels, "num_classes": num_classes,
                                  "widen": widen}
        return ResNet18(**(kwargs | overrides))

    return build


def _swin_builder(flavour: str, num_classes: int) -> Callable[..., nn.Module]:
    def build(**overrides: Any) -> nn.Module:
        return SwinTransformer(swin_config(flavour, **({"num_classes": num_classes} | overrides)))

    return build


def _lm(flavour: str, **defaults: Any) -> Recipe:
    cfg = LLAMA_FLAVOURS[flavour]
    base = {
        "vocab_size": cfg.vocab_size,
        "weight_decay": 0.1,
        "optimizer": "adamw",
        "grad_clip": 1.0,
    }
    return Recipe(f"llama-{flavour}", "lm", LLAMA_ADAPTER, _llama_builder(flavour), base | defaults)


# Image datasets: (channels, side, classes). fmnist ships in a Debian package; CIFAR is read
# from --data-dir (standard python batches).
_DATASETS = {"fmnist": (1, 28, 10), "cifar10": (3, 32, 10), "cifar100": (3, 32, 100)}


def _image(name: str, dataset: str, widen: int = 1) -> Recipe:
    # The usual CIFAR ResNet-18 recipe (SGD, lr 0.1 at batch 128, momentum 0.9, wd 5e-4).
    in_channels, image_size, num_classes = _DATASETS[dataset]
    defaults = {
        "dataset": dataset,
        "batch_size": 128,
        "lr": 0.1,
        "in_channels": in_channels,
        "num_classes": num_classes,
        "image_size": image_size,
        "optimizer": "sgd",
        "momentum": 0.9,
        "weight_decay": 5e-4,
    }
    build = _resnet_builder(in_channels, num_classes, widen)
    return Recipe(name, "image", RESNET_ADAPTER, build, defaults)


def _swin(name: str, dataset: str) -> Recipe:
    # Swin-T's optimizer (AdamW, weight decay 0.05, warm-up, gradient clipping 5) with the lr
    # usual for Swin on CIFAR, 1e-3 at batch 128 per worker (ImageNet Swin-T: 1e-3 at 1024).
    in_channels, image_size, num_classes = _DATASETS[dataset]
    defaults = {
        "dataset": dataset,
        "batch_size": 128,
        "lr": 1e-3,
        "warmup": 20,
        "grad_clip": 5.0,
        "in_channels": in_channels,
        "num_classes": num_classes,
        "image_size": image_size,
        "optimizer": "adamw",
        "weight_decay": 0.05,
    }
    flavour = "t-28" if image_size == 28 else "t-32"
    return Recipe(name, "image", SWIN_ADAPTER, _swin_builder(flavour, num_classes), defaults)


# lr follows GPT-3's table for the nearest size (125M 6e-4, 350M 3e-4, 1.3B 2e-4); the tiny
# model is small enough for a CPU-friendly 3e-3.
RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        _lm("tiny", batch_size=8, seq_len=128, lr=3e-3, warmup=100),
        _lm("134m", batch_size=1, seq_len=2048, lr=6e-4, warmup=1000),
        _lm("500m", batch_size=1, seq_len=2048, lr=3e-4, warmup=1000),
        _lm("1b", batch_size=1, seq_len=2048, lr=2e-4, warmup=1000),
        _image("resnet18-fmnist", "fmnist"),
        _image("resnet18-cifar10", "cifar10"),
        # WideResNet-18: ResNet-18 with every stage 2× wider (64·2 … 512·2 channels, 4× the
        # parameters: 44.7M for CIFAR); --model-arg widen=4 gives the 4× variant (179M).
        _image("wrn18-fmnist", "fmnist", widen=2),
        _image("wrn18-cifar10", "cifar10", widen=2),
        _swin("swin-t-fmnist", "fmnist"),
        _swin("swin-t-cifar10", "cifar10"),
        _swin("swin-t-cifar100", "cifar100"),
    )
}


def list_recipes() -> list[str]:
    return list(RECIPES)


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {list_recipes()}") from None
