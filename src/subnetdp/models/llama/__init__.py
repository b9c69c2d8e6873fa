"""LLaMA-style decoder: plain model (``model.py``) and its subnetdp adapter (``adapter.py``)."""

from subnetdp.models.llama.adapter import LLAMA_ADAPTER
from subnetdp.models.llama.model import (
    LLAMA_FLAVOURS,
    Llama,
    LlamaConfig,
    RMSNorm,
    RotaryEmbedding,
    TransformerBlock,
    init_llama_module,
)

__all__ = [
    "LLAMA_ADAPTER",
    "LLAMA_FLAVOURS",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "RotaryEmbedding",
    "TransformerBlock",
    "init_llama_module",
]
