"""n-sdp output scaling: kept hidden units scaled by 1/keep-rate while training."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from subnetdp.subnet.autocast import autocast_input
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

    The scale is applied to the ``down`` module's output rather than its input: for a linear
    ``down`` (``W·(s·h) = s·(W·h)``, the bias kept unscaled) the result is the same, but the
    scaled input would be one more activation saved for backward. A plain ``nn.Linear`` down
    folds it into its GEMMs (``_ScaledLinear``: BLAS's alpha, so no extra pass over the output
    or its gradient); any other down module gets a forward hook. Both keep model code unaware.
    Returns the hook handles."""
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
        down = module.get_submodule(pair.down)
        if isinstance(down, nn.Linear) and type(down).forward is nn.Linear.forward:
            down.forward = _folded(down, scale)  # type: ignore[method-assign,assignment]
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

        hooks.append(down.register_forward_hook(hook))
    return hooks


def _folded(layer: nn.Linear, scale: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if not layer.training:
            return F.linear(x, layer.weight, layer.bias)
        out: torch.Tensor = _ScaledLinear.apply(x, layer.weight, layer.bias, scale)
        return out

    return forward


class _ScaledLinear(torch.autograd.Function):
    """``s·(x Wᵀ) + b`` with ``s`` as the GEMMs' alpha, forward and backward. Under autocast
    the forward casts as ``F.linear`` would and the backward runs in the output's dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                s: float) -> torch.Tensor:
        x = autocast_input(x)
        ctx.save_for_backward(x, w)
        ctx.s, ctx.bias = s, b is not None
        x2 = x.reshape(-1, x.shape[-1])
        base = b if b is not None else x2.new_zeros(())
        y = torch.addmm(base, x2, w.t(), beta=1 if b is not None else 0, alpha=s)
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        dt, s = dy.dtype, ctx.s
        dy2 = dy.reshape(-1, dy.shape[-1])
        zero = dy2.new_zeros(())
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = torch.addmm(zero, dy2, w.to(dt), beta=0, alpha=s).view(x.shape)
        if ctx.needs_input_grad[1]:
            gw = torch.addmm(zero, dy2.t(), x.reshape(-1, x.shape[-1]).to(dt), beta=0, alpha=s)
        if ctx.bias and ctx.needs_input_grad[2]:
            gb = dy2.sum(0)
        return gx, gw, gb, None
