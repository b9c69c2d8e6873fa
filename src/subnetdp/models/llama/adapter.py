"""LLaMA's units for subnetdp: each transformer block (attention + FFN, residual inside)."""

from __future__ import annotations

from torch import nn

from subnetdp.models.llama.model import Llama, init_llama_module
from subnetdp.subnet.adapter import NeuronPair, UnitAdapter


def llama_unit_paths(model: nn.Module) -> list[str]:
    """``layers.0 … layers.{L-1}`` in forward order (works on the meta device)."""
    layers = model.get_submodule("layers")
    assert isinstance(layers, nn.ModuleList)  # internal invariant of Llama, not user input
    return [f"layers.{i}" for i in range(len(layers))]


def llama_neuron_pairs(model: nn.Module) -> list[NeuronPair]:
    """Per block, in forward order: the attention heads (one slot = one K/V head with its
    ``n_rep`` query heads: rows of wq/wk/wv, columns of wo) and the SwiGLU hidden units (rows
    of w1/w3, columns of w2)."""
    assert isinstance(model, Llama)
    cfg = model.config
    pairs = []
    for i in range(cfg.n_layers):
        a, f = f"layers.{i}.attn", f"layers.{i}.ffn"
        pairs.append(NeuronPair(
            name=a, kind="heads", slots=cfg.kv_heads, down=f"{a}.wo",
            tensors=((f"{a}.wq.weight", 0), (f"{a}.wk.weight", 0), (f"{a}.wv.weight", 0),
                     (f"{a}.wo.weight", 1)),
        ))
        pairs.append(NeuronPair(
            name=f, kind="ffn", slots=cfg.ffn_hidden, down=f"{f}.w2",
            tensors=((f"{f}.w1.weight", 0), (f"{f}.w3.weight", 0), (f"{f}.w2.weight", 1)),
        ))
    return pairs


# A block is ``x -> x + attn(...) -> h + ffn(...)`` with an identity skip, so a removed block is
# the identity on the residual stream ("passthrough"). Embeddings, final norm, LM head and the
# rope table are shared.
LLAMA_ADAPTER = UnitAdapter(
    unit_paths=llama_unit_paths,
    removed="passthrough",
    init_module=init_llama_module,
    neuron_pairs=llama_neuron_pairs,
)
