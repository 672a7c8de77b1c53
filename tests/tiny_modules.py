"""Small modules that tests in several rooms build: a residual MLP block, a language model with tied ends."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["ResidualMLP", "TiedLM"]


class ResidualMLP(nn.Module):
    """``x + down(act(up(x)))``: a transformer's MLP block alone, its two linear layers a column/row pair."""

    def __init__(self, width: int, hidden: int, act: Callable[[torch.Tensor], torch.Tensor] = torch.relu) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


class TiedLM(nn.Module):
    """An embedding, a linear layer and a head that shares the embedding's weight (as GPT-2's does), so
    the first and the last stage hold the one tensor."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.emb(ids))))
