"""Autocast's input cast, for custom autograd functions that replace a layer's GEMMs."""

from __future__ import annotations

import torch


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` as autocast would cast it for a GEMM, so that what a custom function saves for
    backward is what the plain layer's backward would keep (the narrow copy, not the input)."""
    dev = x.device.type
    return x.to(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else x
