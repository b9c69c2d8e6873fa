"""ResNet-18's units for subnetdp: the residual branch of each BasicBlock.

A block with a projection shortcut cannot be removed whole (its skip is not the identity), so
the unit is the branch ``layer{s}.{b}.residual`` and a removed branch contributes ``0``
("zero"); projection shortcuts, stem and classifier are shared.
"""

from __future__ import annotations

from torch import nn

from subnetdp.models.resnet.model import init_resnet_module
from subnetdp.subnet.adapter import NeuronPair, UnitAdapter


def resnet_unit_paths(model: nn.Module) -> list[str]:
    """``layer1.0.residual`` … ``layer4.1.residual`` in forward order (works on meta)."""
    paths = []
    for s in range(1, 5):
        stage = model.get_submodule(f"layer{s}")
        paths += [f"layer{s}.{b}.residual" for b in range(len(list(stage.children())))]
    return paths


def resnet_neuron_pairs(model: nn.Module) -> list[NeuronPair]:
    """Per branch ``conv1 -> bn1 -> relu -> conv2``: the intermediate channels (conv1's output
    channels, bn1's affine parameters and running statistics, conv2's input channels)."""
    pairs = []
    for path in resnet_unit_paths(model):
        conv1 = model.get_submodule(f"{path}.0")
        assert isinstance(conv1, nn.Conv2d)
        pairs.append(NeuronPair(
            name=path, kind="channels", slots=conv1.out_channels, down=f"{path}.3",
            tensors=((f"{path}.0.weight", 0), (f"{path}.1.weight", 0), (f"{path}.1.bias", 0),
                     (f"{path}.1.running_mean", 0), (f"{path}.1.running_var", 0),
                     (f"{path}.3.weight", 1)),
        ))
    return pairs


RESNET_ADAPTER = UnitAdapter(
    unit_paths=resnet_unit_paths,
    removed="zero",
    init_module=init_resnet_module,
    neuron_pairs=resnet_neuron_pairs,
)
