"""Your own model on the command line: a file with a factory that returns (model, example inputs).

Run::

    pipecut plan examples/my_model.py:build --stages 2 --device cpu

``pipecut plan FILE.py:FACTORY`` imports the file, calls ``FACTORY()`` and plans what it returns:
the model and one micro-batch of its inputs (a tuple). Copy this file and change ``build``.
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """A pre-norm residual MLP block: ``x + W2 gelu(W1 norm(x))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C) -> (B, C)
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def build(width: int = 256, depth: int = 6, batch: int = 8) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A stack of ``depth`` residual blocks and one micro-batch of ``batch`` rows."""
    model = nn.Sequential(*(Block(width) for _ in range(depth)), nn.Linear(width, 10))
    return model, (torch.randn(batch, width),)
