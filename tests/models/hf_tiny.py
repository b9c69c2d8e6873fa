"""A tiny Hugging Face ``LlamaForCausalLM`` built offline from a small config, with its token
batches, loss, SGD and training loop: shared by tests/models/test_hf_llama.py and
tests/integrations/test_hf_models.py. Needs transformers (the ``hf`` extra, ``make setup``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import transformers

VOCAB = 64


def tiny_llama(layers: int, max_positions: int) -> Any:
    """``layers`` decoder layers of 4 heads (2 K/V heads of 8), MLP 48, hidden 32."""
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        use_cache=False,  # a removed layer cannot fill a KV cache; training needs none
    )
    torch.manual_seed(0)  # the same initial weights on every rank (and the wrapper broadcasts)
    return transformers.LlamaForCausalLM(cfg)


def batch(w: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``w``'s inputs and next-token targets at ``step``: 2 sequences of 8."""
    g = torch.Generator().manual_seed(10 * step + w)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def sgd(params: Any, momentum: float = 0.0) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=momentum)


def train(sdp: Any, opt: torch.optim.Optimizer, rank: int, steps: int) -> None:
    """``steps`` steps of ``sdp`` (the wrapped model) on rank ``rank``'s batches."""
    for step in range(steps):
        x, y = batch(rank, step)
        loss(sdp(x), y).backward()
        opt.step()
        opt.zero_grad()
