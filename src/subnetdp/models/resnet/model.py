"""ResNet-18 for small images (CIFAR 32×32, Fashion-MNIST 28×28), plain PyTorch.

Imports nothing from subnetdp. Differences from the ImageNet ResNet-18: a 3×3 stride-1 stem and
no max-pool, so the last stage sees 4×4 maps for 32×32 and for 28×28 (28 → 14 → 7 → 4) inputs.

Two properties matter to subnetdp:
- ``BasicBlock.forward`` adds ``self.residual(x) + self.shortcut(x)`` with the branch first and
  out of place, so a removed branch may be replaced by a module returning the int ``0``.
- Every parameter and buffer can be rebuilt by ``init_resnet_module`` on the module owning it
  (models are built on meta, materialised with ``to_empty``, then initialised per module).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LastBatchNorm(nn.BatchNorm2d):
    """The last BN of a residual branch; with ``zero_init`` its gamma starts at 0.

    Zero gamma makes every block the identity (or its projection shortcut) at initialisation,
    which helps large-batch SGD (Goyal et al., 2017); DDP and SDP both train at a large global
    batch. Stored on the module so the initialiser depends on nothing but the module.
    """

    zero_init: bool

    def __init__(self, num_features: int, zero_init: bool) -> None:
        self.zero_init = zero_init  # before super().__init__, which calls reset_parameters
        super().__init__(num_features)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.zero_init:
            nn.init.zeros_(self.weight)


class BasicBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int, zero_init_residual: bool) -> None:
        super().__init__()
        # The intermediate channels (conv1 out = BN = conv2 in) are the neuron-level units;
        # nothing hard-codes their number, so a narrowed branch still runs.
        self.residual = nn.Sequential(
            nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_ch, out_ch, 3, stride=1, padding=1, bias=False),
            LastBatchNorm(out_ch, zero_init_residual),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:  # projection shortcut: shared, never a unit
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Branch first, not in place: a removed branch returns 0 and `0 + shortcut(x)` works.
        out = self.residual(x) + self.shortcut(x)
        return F.relu(out)


class ResNet18(nn.Module):
    """Stem, 4 stages of 2 BasicBlocks (``layer1`` … ``layer4``), global average pool, ``fc``.

    Args:
        in_channels: image channels (1 for Fashion-MNIST, 3 for CIFAR).
        num_classes: classifier outputs.
        width: channels of the first stage; the stages use width × (1, 2, 4, 8).
        widen: multiplies ``width`` (WideResNet-18 style, e.g. 2 or 4).
        zero_init_residual: start each branch's last BN gamma at 0 (see ``LastBatchNorm``).
    """

    def __init__(
        self,
        *,
        in_channels: int = 3,
        num_classes: int = 10,
        width: int = 64,
        widen: int = 1,
        zero_init_residual: bool = True,
    ) -> None:
        super().__init__()
        w = width * widen
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, w, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(w),
            nn.ReLU(inplace=True),
        )
        in_ch = w
        for s, out_ch in enumerate((w, 2 * w, 4 * w, 8 * w), start=1):
            stage = nn.Sequential(
                BasicBlock(in_ch, out_ch, 1 if s == 1 else 2, zero_init_residual),
                BasicBlock(out_ch, out_ch, 1, zero_init_residual),
            )
            self.add_module(f"layer{s}", stage)
            in_ch = out_ch
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)
        self.init_weights()

    def init_weights(self) -> None:
        """Initialise every module (skipped on meta: subnetdp initialises after ``to_empty``)."""
        if self.fc.weight.is_meta:
            return
        for name, module in self.named_modules():
            init_resnet_module(name, module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x[B, C, H, W]`` -> logits ``[B, num_classes]``."""
        x = self.stem(x)
        for s in range(1, 5):
            x = self.get_submodule(f"layer{s}")(x)
        return self.fc(torch.flatten(self.pool(x), 1))


def init_resnet_module(name: str, module: nn.Module) -> None:
    """Initialise only what ``module`` owns directly (``recurse=False``); ``name`` is unused.

    Convs: Kaiming normal (fan_out, ReLU), as torchvision. BatchNorm: gamma 1 (0 for a
    ``LastBatchNorm`` with ``zero_init``), beta 0, running stats reset. Linear: PyTorch default.
    """
    del name
    with torch.no_grad():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif callable(reset := getattr(module, "reset_parameters", None)):
            # BatchNorm: weight 1, bias 0, running_mean 0, running_var 1, num_batches_tracked 0.
            reset()
        elif _owns_tensors(module):
            # Fail loudly: silently skipping would leave to_empty's garbage in the model.
            raise TypeError(
                f"init_resnet_module does not know how to initialise {type(module).__name__}; "
                "add a branch for it"
            )


def _owns_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(
        True for _ in module.buffers(recurse=False)
    )
