"""A small model with the regions rotary LLMs have: a no_grad block and an autocast block in forward."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Rotary", "RotaryNet"]


class Rotary(nn.Module):
    """A rotary embedding as Llama computes it: angles in a no_grad region, in fp32 (autocast off)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x: (B, T, C)
        with torch.no_grad():
            pos = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)  # a device constant
            freqs = pos[:, None] @ self.inv_freq[None, :]  # (T, C/2): a matmul, so FLOPs to count
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class RotaryNet(nn.Module):
    """Layers that read the rotary angles; one layer also computes inside an autocast region."""

    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.rotary = Rotary(width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary(x)
        for layer in self.layers:
            x = layer(x) * cos + x * sin
        with torch.autocast("cpu", enabled=False):  # a region with grad on: backward FLOPs count
            x = self.head(x.float())
        return x
