"""nb-sdp: a partly held Linear/Conv computes the weight gradient of its held slices only.

Under backward masking a layer whose neuron groups are partly held still runs whole (forward,
and the input gradient that earlier layers need), but only the held groups' weight gradients
are used. Autograd's own backward would compute the full weight gradient and leave the slicing
to us: a full layer's weight-gradient FLOPs, a third of the layer's step, at any coverage. So
such a layer's forward is replaced (on the instance: state-dict keys and hooks are unchanged)
by one autograd function that:

- runs the layer's own forward with its full, frozen weight (one GEMM/conv, as before);
- in backward, computes the input gradient with the full weight, and the weight gradient of
  each held slice from the matching output rows (``dim 0``) or input columns (``dim 1``);
- routes those gradients to the slice parameters the optimizer trains (views of the weight).

Only what can be sliced exactly this way is replaced: ``nn.Linear``, and non-transposed,
ungrouped convolutions with numeric zero padding; anything else keeps the generic path of
``runtime.masking`` (full gradient, then sliced). Under autocast the forward casts as usual and
the backward runs in the output's dtype; the engine casts each gradient to its parameter's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.conv import _ConvNd

from subnetdp.subnet.autocast import autocast_input
from subnetdp.subnet.pieces import LocalPiece


@dataclass(frozen=True)
class Slice:
    """A held slice of the layer's weight or bias: ``length`` rows/columns from ``start``
    along ``dim``; ``param`` is the trainable view of it."""

    dim: int
    start: int
    length: int
    param: nn.Parameter

    @classmethod
    def of(cls, lp: LocalPiece, param: nn.Parameter) -> Slice:
        assert lp.piece.dim is not None
        return cls(lp.piece.dim, lp.local_start, lp.piece.stop - lp.piece.start, param)


def supports(layer: nn.Module) -> bool:
    if isinstance(layer, nn.Linear):
        return True
    return (isinstance(layer, _ConvNd) and not layer.transposed
            and layer.groups == 1 and layer.padding_mode == "zeros"
            and not isinstance(layer.padding, str))


def install(layer: nn.Module, weight: Sequence[Slice], bias: Sequence[Slice]) -> None:
    """Replace ``layer.forward`` (module doc). ``weight``/``bias``: the held slices; the full
    weight must be frozen. A bias with no slices gets its full gradient if it is trainable."""
    assert isinstance(layer, nn.Linear | _ConvNd) and supports(layer)
    op = _Op(layer, tuple(weight), tuple(bias))
    full_bias = layer.bias if isinstance(layer.bias, nn.Parameter) and layer.bias.requires_grad \
        else None

    def forward(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _HeldSlices.apply(op, x, full_bias, *op.params)
        return out

    layer.forward = forward  # type: ignore[method-assign]


@dataclass
class _Op:
    layer: nn.Linear | _ConvNd
    weight: tuple[Slice, ...]
    bias: tuple[Slice, ...]

    def __post_init__(self) -> None:
        # adjacent held weight slices share one GEMM: (dim, start, length) per run
        self.runs: list[tuple[int, int, int]] = []
        for s in sorted(self.weight, key=lambda s: (s.dim, s.start)):
            last = self.runs[-1] if self.runs else None
            if last is not None and last[0] == s.dim and last[1] + last[2] == s.start:
                self.runs[-1] = (s.dim, last[1], last[2] + s.length)
            else:
                self.runs.append((s.dim, s.start, s.length))
        self.run_of = [next(i for i, (d, a, n) in enumerate(self.runs)
                            if d == s.dim and a <= s.start < a + n) for s in self.weight]
        self.params = [s.param for s in (*self.weight, *self.bias)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        if isinstance(layer, nn.Linear):
            return F.linear(x, layer.weight, layer.bias)
        return layer._conv_forward(x, layer.weight, layer.bias)

    def grads(self, dy: torch.Tensor, x: torch.Tensor, need_input: bool,
              full_bias: bool) -> tuple[Any, ...]:
        """Input gradient, full bias gradient, then one per held slice (weight, bias)."""
        layer, dt = self.layer, dy.dtype
        x = x.to(dt)
        if isinstance(layer, nn.Linear):
            gx = dy.matmul(layer.weight.to(dt)) if need_input else None
            dy, x = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
            runs = [dy.narrow(1, start, n).t().mm(x) if dim == 0 else
                    dy.t().mm(x.narrow(1, start, n)) for dim, start, n in self.runs]
            reduce = [0]
        else:
            w = layer.weight.to(dt)
            gx = self._conv_backward(dy, x, w, 0) if need_input else None
            runs = [self._conv_backward(dy.narrow(1, start, n), x, w.narrow(0, start, n), 1)
                    if dim == 0 else
                    self._conv_backward(dy, x.narrow(1, start, n), w.narrow(1, start, n), 1)
                    for dim, start, n in self.runs]
            reduce = [0, *range(2, dy.ndim)]
        gw = [runs[i].narrow(s.dim, s.start - self.runs[i][1], s.length)
              for s, i in zip(self.weight, self.run_of, strict=True)]
        # channels are dim 1 of dy in both cases (Linear's after the reshape)
        gb_full = dy.sum(reduce) if full_bias else None
        gb = [dy.narrow(1, s.start, s.length).sum(reduce) for s in self.bias]
        return (gx, gb_full, *gw, *gb)

    def _conv_backward(self, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                       which: int) -> torch.Tensor:
        layer = self.layer
        assert isinstance(layer, _ConvNd) and isinstance(layer.padding, tuple)
        nd = dy.ndim - 2
        mask = [which == 0, which == 1, False]
        out = torch.ops.aten.convolution_backward(
            dy, x, w, None, list(layer.stride), list(layer.padding), list(layer.dilation),
            False, [0] * nd, 1, mask)
        return out[which]


class _HeldSlices(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: _Op, x: torch.Tensor, full_bias: torch.Tensor | None,
                *params: torch.Tensor) -> torch.Tensor:
        # ``full_bias`` and ``params`` only route gradients: the values are the layer's own
        ctx.op = op
        x = autocast_input(x)
        ctx.save_for_backward(x)
        return op.forward(x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        grads = ctx.op.grads(dy, x, ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        return (None, *grads)
