"""A small residual model for runtime tests: embedding -> residual MLP blocks -> head."""

from __future__ import annotations

import torch
from torch import nn

from subnetdp.subnet.adapter import UnitAdapter


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Toy(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, n_blocks: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


TOY_ADAPTER = UnitAdapter(
    unit_paths=lambda m: [f"blocks.{i}" for i in range(len(m.blocks))], removed="passthrough"
)


def toy_batch(rank: int, step: int, vocab: int = 32, batch: int = 4, seq: int = 6):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def toy_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
