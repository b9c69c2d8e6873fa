"""LLaMA's units for subnetdp: each transformer block (attention + FFN, residual inside)."""

from __future__ import annotations

from torch import nn

from subnetdp.models.llama.model import init_llama_module
from subnetdp.subnet.adapter import UnitAdapter


def llama_unit_paths(model: nn.Module) -> list[str]:
    """``layers.0 … layers.{L-1}`` in forward order (works on the meta device)."""
    layers = model.get_submodule("layers")
    assert isinstance(layers, nn.ModuleList)  # internal invariant of Llama, not user input
    return [f"layers.{i}" for i in range(len(layers))]


# A block is ``x -> x + attn(...) -> h + ffn(...)`` with an identity skip, so a removed block is
# the identity on the residual stream ("passthrough"). Embeddings, final norm, LM head and the
# rope table are shared.
LLAMA_ADAPTER = UnitAdapter(
    unit_paths=llama_unit_paths,
    removed="passthrough",
    init_module=init_llama_module,
)
