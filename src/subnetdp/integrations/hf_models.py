"""Hugging Face LLaMA-style decoders (``LlamaForCausalLM`` and the models that share its
module names: Mistral, Qwen2, ...) for every SDP strategy: ``auto_adapter``'s block units
(``model.layers``) plus the layer pairs n-sdp narrows.

Per decoder layer, in forward order: the attention heads (one slot = one K/V head with its
query heads: rows of ``q_proj``/``k_proj``/``v_proj``, columns of ``o_proj``; HF's attention
reads the head count from the tensors' shapes) and the MLP's hidden units (rows of
``gate_proj``/``up_proj``, columns of ``down_proj``), as ``models/llama/adapter.py`` declares
them for subnetdp's own LLaMA.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from subnetdp.subnet.adapter import NeuronPair, UnitAdapter
from subnetdp.subnet.auto import auto_adapter

__all__ = ["hf_decoder_adapter"]

LAYERS = "model.layers"


def _pairs(model: nn.Module) -> list[NeuronPair]:
    cfg = getattr(model, "config", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or getattr(
        cfg, "num_attention_heads", None)
    ffn = getattr(cfg, "intermediate_size", None)
    if kv_heads is None or ffn is None:
        raise ValueError(f"{type(model).__name__} has no LLaMA-style config "
                         "(num_key_value_heads, intermediate_size): write its neuron pairs "
                         "(subnetdp.subnet.adapter.NeuronPair) or train it with b-sdp")
    state = model.state_dict(keep_vars=True)  # (meta tensors too) which biases exist
    layers = model.get_submodule(LAYERS)
    pairs = []
    for i in range(len(layers)):  # type: ignore[arg-type]
        a, f = f"{LAYERS}.{i}.self_attn", f"{LAYERS}.{i}.mlp"
        attn = [(f"{a}.{p}.weight", 0) for p in ("q_proj", "k_proj", "v_proj")]
        attn += [(f"{a}.{p}.bias", 0) for p in ("q_proj", "k_proj", "v_proj")
                 if f"{a}.{p}.bias" in state]
        pairs.append(NeuronPair(name=a, kind="heads", slots=int(kv_heads), down=f"{a}.o_proj",
                                tensors=(*attn, (f"{a}.o_proj.weight", 1))))
        mlp = [(f"{f}.gate_proj.weight", 0), (f"{f}.up_proj.weight", 0)]
        mlp += [(f"{f}.{p}.bias", 0) for p in ("gate_proj", "up_proj")
                if f"{f}.{p}.bias" in state]
        pairs.append(NeuronPair(name=f, kind="ffn", slots=int(ffn), down=f"{f}.down_proj",
                                tensors=(*mlp, (f"{f}.down_proj.weight", 1))))
    return pairs


def hf_decoder_adapter(model: nn.Module) -> UnitAdapter:
    """The units of a LLaMA-style HF decoder: its layers (b-sdp, bb-sdp) and their heads and
    MLP hidden units (n-sdp, nb-sdp)."""
    return replace(auto_adapter(model, LAYERS), neuron_pairs=_pairs)
