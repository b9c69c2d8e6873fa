"""n-sdp output scaling: kept hidden units scaled by 1/keep-rate while training."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from subnetdp.subnet.neurons import NeuronGroup


def scale_kept_outputs(
    module: nn.Module, groups: Sequence[NeuronGroup], held: Sequence[int]
) -> list[Any]:
    """Output scaling (docs/method.md §4): while training, what each narrowed pair contributes is
    multiplied by 1/keep-rate (all slots / held slots), like inverted dropout, so its expected
    size matches the full model that evaluation uses. It is the default for n-sdp because
    without it the full model is miscalibrated: measured on resnet18-fmnist at C = 0.5, the
    assembled model's accuracy was 0.41 without scaling and 0.80 with it (llama-tiny: val loss
    5.05 vs 4.95); see benchmarks/results/nsdp_*.md.

    It scales the *output* of the ``down`` module rather than its input: for a linear ``down``
    (``W·(s·h) = s·(W·h)``, the bias kept unscaled) the result is the same, but the scaled
    input would be one more activation saved for backward, while the scaled output replaces
    the unscaled one (a product with a constant saves nothing). A forward hook keeps model
    code unaware. Returns the hook handles."""
    kept: dict[str, int] = {}
    pairs = {}
    for u in held:
        g = groups[u]
        pairs[g.pair.name] = g.pair
        kept[g.pair.name] = kept.get(g.pair.name, 0) + g.slot_stop - g.slot_start
    hooks = []
    for name, pair in pairs.items():
        scale = pair.slots / kept[name]
        if scale == 1.0:
            continue

        def hook(mod: nn.Module, _: Any, out: torch.Tensor, s: float = scale) -> Any:
            if not mod.training:
                return None
            bias = getattr(mod, "bias", None)
            if not isinstance(bias, torch.Tensor):
                return out * s
            shape = [1] * out.ndim
            conv = isinstance(mod, nn.modules.conv._ConvNd)
            shape[getattr(mod, "channel_dim", 1 if conv else -1)] = -1
            b = bias.view(shape)
            return (out - b) * s + b

        hooks.append(module.get_submodule(pair.down).register_forward_hook(hook))
    return hooks
