"""subnet.scaling's fold of n-sdp's output scale into a Linear down's GEMMs equals scaling its
output, forward and backward, and leaves evaluation unscaled."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from subnetdp.subnet.scaling import _folded


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("s", [2.0, 1.6])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_folded_scale_equals_scaled_output(bias, s, dtype):
    torch.manual_seed(0)
    ref = nn.Linear(12, 6, bias=bias)
    layer = copy.deepcopy(ref)
    layer.forward = _folded(layer, s)
    x = torch.randn(3, 5, 12, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
        out = ref(x)
        y_ref = (out - ref.bias) * s + ref.bias if bias else out * s
        y = layer(x2)
        dy = torch.randn_like(y_ref)
        (y_ref * dy).sum().backward()
        (y * dy).sum().backward()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype else dict(rtol=1e-6, atol=1e-6)
    assert y.dtype == out.dtype and y.shape == y_ref.shape  # as the unscaled layer's output
    torch.testing.assert_close(y.float(), y_ref.float(), **tol)
    torch.testing.assert_close(x2.grad, x.grad, **tol)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, **tol)
    if bias:
        torch.testing.assert_close(layer.bias.grad, ref.bias.grad, **tol)
    layer.eval()
    torch.testing.assert_close(layer(x), ref(x), rtol=0, atol=0)
