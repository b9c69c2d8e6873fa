"""Swin Transformer for small images (Swin-T widths; CIFAR 32×32 and grey 28×28 flavours)."""

from subnetdp.models.swin.adapter import SWIN_ADAPTER, swin_neuron_pairs, swin_unit_paths
from subnetdp.models.swin.model import (
    SWIN_FLAVOURS,
    SwinConfig,
    SwinTransformer,
    init_swin_module,
    swin_config,
)

__all__ = [
    "SWIN_ADAPTER",
    "SWIN_FLAVOURS",
    "SwinConfig",
    "SwinTransformer",
    "init_swin_module",
    "swin_config",
    "swin_neuron_pairs",
    "swin_unit_paths",
]
