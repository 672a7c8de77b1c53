"""A one-matrix language model for the calibration tests: ids (b, T) -> logits (b, T, V)."""

from __future__ import annotations

import torch
from torch import nn

# A row is ~70 MFLOP forward: 4 rows take clearly longer than 1 (what the fit needs), even on busy cores.
VOCAB, WIDTH, SEQ = 4096, 128, 64


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (b, T) -> (b, T, V)
        return self.head(torch.relu(self.embed(ids)))


def build() -> tuple[nn.Module, tuple[torch.Tensor]]:
    return TinyLM(), (torch.zeros(2, SEQ, dtype=torch.long),)
