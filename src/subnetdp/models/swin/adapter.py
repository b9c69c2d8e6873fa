"""Swin's units for subnetdp: each Swin block of each stage (window attention + MLP, both with
identity skips, so a removed block is the identity). Patch embedding, patch merging, the final
norm and the classifier are shared.

Neuron level: per block, the attention heads (rows of q/k/v and their biases, the head's column
of the relative-position-bias table, columns of ``proj``) and the MLP hidden units (rows of
``fc1`` and its bias, columns of ``fc2``).
"""

from __future__ import annotations

from torch import nn

from subnetdp.models.swin.model import WindowAttention, init_swin_module
from subnetdp.subnet.adapter import NeuronPair, UnitAdapter


def swin_unit_paths(model: nn.Module) -> list[str]:
    """``stages.{s}.blocks.{b}`` in forward order (works on the meta device)."""
    stages = model.get_submodule("stages")
    assert isinstance(stages, nn.ModuleList)  # internal invariant of SwinTransformer
    paths = []
    for s, stage in enumerate(stages):
        blocks = stage.get_submodule("blocks")
        assert isinstance(blocks, nn.ModuleList)
        paths += [f"stages.{s}.blocks.{b}" for b in range(len(blocks))]
    return paths


def swin_neuron_pairs(model: nn.Module) -> list[NeuronPair]:
    pairs = []
    for path in swin_unit_paths(model):
        a, m = f"{path}.attn", f"{path}.mlp"
        attn = model.get_submodule(a)
        assert isinstance(attn, WindowAttention)
        fc1 = model.get_submodule(f"{m}.fc1")
        assert isinstance(fc1, nn.Linear)
        qkv = tuple((f"{a}.{p}.{t}", 0) for p in ("q", "k", "v") for t in ("weight", "bias"))
        pairs.append(NeuronPair(
            name=a, kind="heads", slots=attn.relative_bias.shape[1], down=f"{a}.proj",
            tensors=(*qkv, (f"{a}.relative_bias", 1), (f"{a}.proj.weight", 1)),
        ))
        pairs.append(NeuronPair(
            name=m, kind="ffn", slots=fc1.out_features, down=f"{m}.fc2",
            tensors=((f"{m}.fc1.weight", 0), (f"{m}.fc1.bias", 0), (f"{m}.fc2.weight", 1)),
        ))
    return pairs


SWIN_ADAPTER = UnitAdapter(
    unit_paths=swin_unit_paths,
    removed="passthrough",
    init_module=init_swin_module,
    neuron_pairs=swin_neuron_pairs,
)
