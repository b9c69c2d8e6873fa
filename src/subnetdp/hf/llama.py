"""Our LLaMA (models/llama) in Hugging Face ``LlamaForCausalLM`` terms: key names and config.

The two models compute the same function, so weights move by renaming alone:
- RoPE: both rotate the two *halves* of each head (HF's ``rotate_half``) with
  ``theta ** (-2i / head_dim)``, so q/k projections need no row permutation (unlike Meta's
  interleaved checkpoints).
- GQA: ``repeat_interleave`` over KV heads is HF's ``repeat_kv`` (KV head j serves query heads
  j * n_rep ... (j + 1) * n_rep - 1).
- RMSNorm in fp32 then times the weight; SwiGLU ``w2(silu(w1 x) * w3 x)`` is
  ``down(act(gate x) * up x)``; no biases; untied head.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from subnetdp.models.llama.model import LlamaConfig

_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj",
          "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj",
          "ffn.w1": "mlp.gate_proj", "ffn.w3": "mlp.up_proj", "ffn.w2": "mlp.down_proj"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.weight")


def hf_key(key: str) -> str:
    """The ``LlamaForCausalLM`` name of one of our state-dict keys."""
    if key in _TOP:
        return _TOP[key]
    m = _LAYER.fullmatch(key)
    if m is None or m.group(2) not in _BLOCK:
        raise ValueError(f"no Hugging Face name for LLaMA parameter {key!r}")
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.weight"


def to_hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Renamed copies, contiguous and unshared (safetensors refuses views of one storage)."""
    return {hf_key(k): v.detach().contiguous().clone() for k, v in state.items()}


def hf_config(cfg: LlamaConfig, *, eot_id: int, dtype: torch.dtype, extra: dict[str, Any]
              ) -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` with ``cfg``'s shapes. ``max_position_embeddings``
    is the trained context (tools such as lm-eval truncate inputs to it); ``extra`` goes in as
    is (subnetdp's provenance keys)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        # the corpus' document separator is the only special token (see data/tokenizer.py)
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        # the weights' own dtype: transformers loads in it by default, so a bf16 run's folder
        # loads as bf16, not upcast (both transformers 4.x and 5.x read this key)
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
        **extra,
    }


def hf_model(cfg: LlamaConfig, state: dict[str, torch.Tensor], *, eot_id: int) -> Any:
    """An in-memory ``LlamaForCausalLM`` (float32, on the state's device, in eval mode) holding
    ``state`` (our key names): what ``export --format hf`` writes, without the folder."""
    import transformers

    config = transformers.LlamaConfig(**hf_config(cfg, eot_id=eot_id, dtype=torch.float32,
                                                  extra={}))
    device = next(iter(state.values())).device
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).float()
    model.load_state_dict(to_hf_state(state), strict=True)
    return model.eval()
