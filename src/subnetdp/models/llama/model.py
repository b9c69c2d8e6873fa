"""A LLaMA-style decoder-only transformer in plain PyTorch (imports nothing from subnetdp).

Pre-norm blocks with RMSNorm, rotary position embeddings, grouped-query attention through
``F.scaled_dot_product_attention`` and a SwiGLU feed-forward; no biases; untied LM head.

Three properties matter to subnetdp and are kept on purpose:
- Blocks are called positionally, ``h = layer(h, rope_cache)``, and each block owns its residual
  connection, so a removed block can be replaced by a module returning its first argument.
- Every parameter *and buffer* can be (re)built by ``init_llama_module`` on the module that
  directly owns it: models are built on the meta device, materialised with ``to_empty`` (which
  leaves memory uninitialised) and then initialised module by module.
- Head counts and FFN width are read from tensor shapes in ``forward``, so a layer that was
  physically narrowed (fewer heads, fewer hidden units) still runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    ffn_hidden: int
    max_seq_len: int
    n_kv_heads: int | None = None  # grouped-query attention; None means n_heads (plain MHA)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or self.head_dim % 2:
            raise ValueError(
                f"dim={self.dim} must split into n_heads={self.n_heads} heads of even size "
                "(rotary embeddings rotate pairs); pick dim divisible by 2*n_heads"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.kv_heads}"
            )


# Parameter counts (untied embeddings, vocab as listed; see tests/models/test_models.py):
#   tiny  2,656,384  (40% of it in the two 4096 x 128 embeddings)
#   134m  134,105,856
#   500m  557,774,080  (475.9M outside the embeddings; 24 layers so 8 workers get 3 blocks each)
#   1b    1,339,082,752
LLAMA_FLAVOURS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(
        dim=128, n_layers=8, n_heads=4, vocab_size=4096, ffn_hidden=352, max_seq_len=256
    ),
    "134m": LlamaConfig(
        dim=768, n_layers=12, n_heads=12, vocab_size=32000, ffn_hidden=2048, max_seq_len=2048
    ),
    "500m": LlamaConfig(
        dim=1280, n_layers=24, n_heads=20, vocab_size=32000, ffn_hidden=3456, max_seq_len=2048
    ),
    "1b": LlamaConfig(
        dim=2048, n_layers=24, n_heads=16, vocab_size=32000, ffn_hidden=5461, max_seq_len=2048
    ),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: the mean of squares loses too much precision in bf16.
        return F.rms_norm(x.float(), (x.size(-1),), eps=self.eps).type_as(x) * self.weight


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table; ``forward(seq_len)`` returns ``[2, seq_len, head_dim // 2]``."""

    cos_sin: torch.Tensor

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        # Non-persistent: derived data, kept out of checkpoints; reset_parameters rebuilds it.
        self.register_buffer(
            "cos_sin", torch.empty(2, max_seq_len, head_dim // 2), persistent=False
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Computed in fp32 on the buffer's device (a no-op on meta), then copied in place so the
        # buffer object (which wrappers may reference) stays the same.
        dev = self.cos_sin.device
        inv_freq = self.theta ** -(
            torch.arange(0, self.head_dim, 2, device=dev, dtype=torch.float32) / self.head_dim
        )
        pos = torch.arange(self.cos_sin.size(1), device=dev, dtype=torch.float32)
        angles = torch.outer(pos, inv_freq)
        with torch.no_grad():
            self.cos_sin.copy_(torch.stack((angles.cos(), angles.sin())))

    def forward(self, seq_len: int) -> torch.Tensor:
        return self.cos_sin[:, :seq_len]


def apply_rope(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """Rotate ``x[B, H, T, hd]``; the two halves of the head dim form the rotated pairs."""
    cos, sin = rope_cache.float().unbind(0)  # [T, hd/2], broadcast over B and H
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class OutProj(nn.Linear):
    """Bias-free projection writing into the residual stream (attention ``wo``, FFN ``w2``).

    Its init std shrinks with depth (GPT-2): ``2 * n_layers`` such outputs are summed into the
    stream. Stored on the module so the initialiser depends on nothing but the module.
    """

    init_std: float

    def __init__(self, in_features: int, out_features: int, n_layers: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.init_std = 0.02 / math.sqrt(2 * n_layers)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = OutProj(cfg.n_heads * cfg.head_dim, cfg.dim, cfg.n_layers)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: read from the weights, so a head-sliced layer runs unchanged.
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, rope_cache), apply_rope(k, rope_cache)
        if (n_rep := q.size(1) // k.size(1)) > 1:  # GQA: each K/V head serves n_rep Q heads
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = OutProj(cfg.ffn_hidden, cfg.dim, cfg.n_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), rope_cache)
        return h + self.ffn(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.init_weights()

    def init_weights(self) -> None:
        """Initialise every module (skipped on meta: subnetdp initialises after ``to_empty``)."""
        if self.output.weight.is_meta:
            return
        for name, module in self.named_modules():
            init_llama_module(name, module)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens[B, T]`` (int64) -> logits ``[B, T, vocab_size]``."""
        seq_len = tokens.size(1)
        if seq_len > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_seq_len={self.config.max_seq_len}; "
                "shorten the sequences or build the model with a larger max_seq_len"
            )
        h = self.tok_embeddings(tokens)
        rope_cache = self.rope(seq_len)
        for layer in self.layers:
            h = layer(h, rope_cache)  # positional, h first: removed blocks return h itself
        return self.output(self.norm(h))


def init_llama_module(name: str, module: nn.Module) -> None:
    """Initialise only what ``module`` owns directly (``recurse=False``).

    Depends on ``(name, module)`` alone, so any worker can rebuild any module identically after
    seeding the RNG from the name. ``name`` is unused: depth scaling lives on ``OutProj``.
    Embeddings use std 1.0 (Meta LLaMA / torchtitan, for an untied embedding): the residual
    stream starts at unit scale, so the first RMSNorms are well conditioned.
    """
    del name
    with torch.no_grad():
        if isinstance(module, nn.Linear):
            std = module.init_std if isinstance(module, OutProj) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=1.0)
        elif callable(reset := getattr(module, "reset_parameters", None)):
            # RMSNorm (weight 1), RotaryEmbedding (recomputes its cos/sin table), and any other
            # module that knows how to reset itself.
            reset()
        elif _owns_tensors(module):
            # Fail loudly: silently skipping would leave to_empty's garbage in the model.
            raise TypeError(
                f"init_llama_module does not know how to initialise {type(module).__name__}; "
                "add a branch for it"
            )


def _owns_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(
        True for _ in module.buffers(recurse=False)
    )
