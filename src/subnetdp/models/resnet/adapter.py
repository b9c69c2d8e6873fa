"""ResNet-18's units for subnetdp: the residual branch of each BasicBlock.

A block with a projection shortcut cannot be removed whole (its skip is not the identity), so
the unit is the branch ``layer{s}.{b}.residual`` and a removed branch contributes ``0``
("zero"); projection shortcuts, stem and classifier are shared.
"""

from __future__ import annotations

from torch import nn

from subnetdp.models.resnet.model import init_resnet_module
from subnetdp.subnet.adapter import UnitAdapter


def resnet_unit_paths(model: nn.Module) -> list[str]:
    """``layer1.0.residual`` … ``layer4.1.residual`` in forward order (works on meta)."""
    paths = []
    for s in range(1, 5):
        stage = model.get_submodule(f"layer{s}")
        paths += [f"layer{s}.{b}.residual" for b in range(len(list(stage.children())))]
    return paths


RESNET_ADAPTER = UnitAdapter(
    unit_paths=resnet_unit_paths,
    removed="zero",
    init_module=init_resnet_module,
)
