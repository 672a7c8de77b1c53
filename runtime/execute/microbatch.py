"""Cutting a batch into equal micro-batches along the first dimension of every tensor."""

from __future__ import annotations

from typing import Any

import torch

from partitioner.errors import PipecutError

__all__ = ["MicrobatchError", "split_microbatches"]


class MicrobatchError(PipecutError, ValueError):
    """A batch cannot be cut into the asked number of equal micro-batches."""


def split_microbatches(batch: Any, m: int, what: str = "inputs") -> list[Any]:
    """Cut every tensor of ``batch`` (a tensor, or a tuple/list of them) into ``m`` equal chunks.

    Non-tensor leaves are repeated in every micro-batch.

    Raises:
        MicrobatchError: a tensor's first dimension is not divisible by ``m``.

    Example:
        >>> [tuple(c.shape) for c in split_microbatches(torch.zeros(8, 3), 4)]
        [(2, 3), (2, 3), (2, 3), (2, 3)]
    """
    if isinstance(batch, torch.Tensor):
        n = batch.shape[0] if batch.dim() else 0
        if batch.dim() == 0 or n % m:
            raise MicrobatchError(
                f"{what}: a batch of {n} cannot be split into {m} equal micro-batches; use a batch "
                f"size divisible by {m}, or a micro-batch count that divides {n}"
            )
        return list(batch.chunk(m))
    if isinstance(batch, (tuple, list)):
        parts = [split_microbatches(x, m, what) for x in batch]
        return [type(batch)(p[i] for p in parts) for i in range(m)]
    return [batch] * m
