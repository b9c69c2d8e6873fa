"""runtime.held_grad: a partly held layer's held-slice gradients equal autograd's full
gradient sliced, and its input gradient and output are unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from subnetdp.runtime import held_grad

# (dim, [(start, length)]) of the held weight slices
CUTS = [(0, [(0, 3)]), (0, [(1, 2), (5, 3)]), (1, [(2, 4)]), (1, [(0, 1), (3, 2)]),
        (0, [(0, 2), (2, 3), (6, 2)]), (1, [(4, 2), (1, 3)])]  # adjacent ones share a GEMM


def _layers() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    """Layers and input shapes."""
    torch.manual_seed(0)
    return {"linear": (nn.Linear(8, 8), (2, 3, 8)),
            "linear-nobias": (nn.Linear(8, 8, bias=False), (5, 8)),
            "conv": (nn.Conv2d(8, 8, 3, padding=1, stride=2), (2, 8, 6, 6)),
            "conv-nobias": (nn.Conv1d(8, 8, 3, padding=2, dilation=2, bias=False), (2, 8, 7))}


def _cut(layer: nn.Module, dim: int, spans: list[tuple[int, int]]
         ) -> tuple[list[held_grad.Slice], list[held_grad.Slice]]:
    w = [held_grad.Slice(dim, s, n, nn.Parameter(layer.weight.detach().narrow(dim, s, n)))
         for s, n in spans]
    b = []
    if layer.bias is not None and dim == 0:  # an out-split layer's bias is split alike
        b = [held_grad.Slice(0, s, n, nn.Parameter(layer.bias.detach().narrow(0, s, n)))
             for s, n in spans]
        layer.bias.requires_grad_(False)
    layer.weight.requires_grad_(False)
    return w, b


@pytest.mark.parametrize("dim,spans", CUTS)
@pytest.mark.parametrize("which", ["linear", "linear-nobias", "conv", "conv-nobias"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_slice_grads_equal_full_grad_sliced(dim, spans, which, dtype):
    ref, shape = _layers()[which]
    layer = copy.deepcopy(ref)
    w, b = _cut(layer, dim, spans)
    held_grad.install(layer, w, b)
    x = torch.randn(shape, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        y_ref, y = ref(x), layer(x2)
        dy = torch.randn_like(y_ref)
        (y_ref * dy).sum().backward()
        (y * dy).sum().backward()
    tol = dict(rtol=0, atol=0) if dtype is None else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y, y_ref, **tol)
    assert y.dtype == y_ref.dtype
    torch.testing.assert_close(x2.grad, x.grad, **(tol if dtype else dict(rtol=1e-6, atol=1e-6)))
    assert layer.weight.grad is None  # the full gradient is never formed
    for s in w:
        assert s.param.grad.dtype == s.param.dtype
        torch.testing.assert_close(s.param.grad, ref.weight.grad.narrow(dim, s.start, s.length),
                                   rtol=1e-2 if dtype else 1e-6, atol=1e-2 if dtype else 1e-6)
    for s in b:
        torch.testing.assert_close(s.param.grad, ref.bias.grad.narrow(0, s.start, s.length),
                                   rtol=1e-2 if dtype else 1e-6, atol=1e-2 if dtype else 1e-6)
    if layer.bias is not None and dim == 1:  # an in-split layer's bias is shared: full grad
        torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=1e-6, atol=1e-6)


def test_unsupported_layers_are_refused():
    assert not held_grad.supports(nn.Conv2d(4, 4, 3, groups=2))
    assert not held_grad.supports(nn.Conv2d(4, 4, 3, padding="same"))
    assert not held_grad.supports(nn.ConvTranspose2d(4, 4, 3))
    assert not held_grad.supports(nn.BatchNorm2d(4))
    assert held_grad.supports(nn.Conv3d(4, 4, 1)) and held_grad.supports(nn.Linear(2, 2))
