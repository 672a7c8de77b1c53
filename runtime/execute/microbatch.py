"""Cutting a batch into equal micro-batches along the first dimension of every tensor."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from partitioner.errors import PipecutError

__all__ = ["MicrobatchError", "check_microbatch_count", "microbatch_count", "split_microbatches"]


class MicrobatchError(PipecutError, ValueError):
    """A micro-batch count is impossible: not an int >= 1, more than the batch's rows, or not
    dividing them (the batch cannot be cut into that many equal micro-batches)."""


def check_microbatch_count(m: object, where: str = "microbatches") -> None:
    """Refuse a micro-batch count that is not an int >= 1 (a bool is not a count).

    Raises:
        MicrobatchError: naming ``where`` and the value.

    Example:
        >>> check_microbatch_count(4)
        >>> try:
        ...     check_microbatch_count(0, "Execution(microbatches=...)")
        ... except MicrobatchError as err:
        ...     print(err)  # doctest: +NORMALIZE_WHITESPACE
        Execution(microbatches=...) must be an int >= 1 (micro-batches per step), got 0; pass
        None to use the plan's count
    """
    if type(m) is not int or m < 1:
        raise MicrobatchError(
            f"{where} must be an int >= 1 (micro-batches per step), got {m!r}; pass None to use the plan's count"
        )


def microbatch_count(given: object, planned: int) -> int:
    """The micro-batches a trainer runs: ``given`` (``Execution.microbatches``), or ``planned`` for ``None``.

    ``0`` is refused, not read as "the plan's".

    Raises:
        MicrobatchError: ``given`` is neither ``None`` nor an int >= 1.

    Example:
        >>> microbatch_count(None, 4), microbatch_count(8, 4)
        (4, 8)
    """
    if given is None:
        return planned
    check_microbatch_count(given, "Execution(microbatches=...)")
    assert isinstance(given, int)  # internal invariant: just checked
    return given


def split_microbatches(batch: Any, m: int, what: str = "inputs") -> list[Any]:
    """Cut every tensor of ``batch`` (a tensor, or a tuple/list/dict of them) into ``m`` equal chunks.

    Non-tensor leaves are repeated in every micro-batch.

    Raises:
        MicrobatchError: a tensor has fewer rows than ``m``, or its first dimension is not
            divisible by ``m``.

    Example:
        >>> [tuple(c.shape) for c in split_microbatches(torch.zeros(8, 3), 4)]
        [(2, 3), (2, 3), (2, 3), (2, 3)]
    """
    if isinstance(batch, torch.Tensor):
        n = batch.shape[0] if batch.dim() else 0
        if batch.dim() and n < m:
            raise MicrobatchError(
                f"{what}: a batch of {n} rows cannot be cut into {m} micro-batches, each needs at least "
                f"one row; use microbatches <= {n} dividing {n} (Execution(microbatches=...)), or a batch "
                f"of at least {m} rows (a multiple of {m})"
            )
        if batch.dim() == 0 or n % m:
            raise MicrobatchError(
                f"{what}: a batch of {n} cannot be split into {m} equal micro-batches; use a batch "
                f"size divisible by {m}, or a micro-batch count that divides {n}"
            )
        return list(batch.chunk(m))
    if isinstance(batch, (tuple, list)):
        parts = [split_microbatches(x, m, what) for x in batch]
        return [type(batch)(p[i] for p in parts) for i in range(m)]
    if isinstance(batch, Mapping):  # targets by name (or None entries), each cut alike
        cut = {k: split_microbatches(x, m, f"{what}[{k!r}]") for k, x in batch.items()}
        return [{k: chunks[i] for k, chunks in cut.items()} for i in range(m)]
    return [batch] * m
