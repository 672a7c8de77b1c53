"""Finite training: a step whose loss or gradient norm is NaN or infinite stops the run, and no
checkpoint or export is written from weights that are not finite.

A diverged run's later checkpoints are worthless, and with rotation (``--keep``) they would push
out the last good one; so the loop checks each step's metrics line (:func:`problem`) and the
weights before each save (:func:`weights_finite`), and stops with :class:`NonFiniteLossError`
naming the newest finite checkpoint to resume from.

Example:
    >>> problem({"step": 3, "loss": float("nan"), "grad_norm": 0.5}, skipped=False)
    'loss is nan'
    >>> problem({"step": 3, "loss": 2.0, "grad_norm": float("inf")}, skipped=True) is None  # fp16 skip
    True
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from partitioner.errors import PipecutError
from runtime.state.weight_sources import local_part

__all__ = ["NonFiniteLossError", "problem", "weights_finite", "resume_hint"]


class NonFiniteLossError(PipecutError, RuntimeError):
    """A step's loss or gradient norm, or the weights after it, are NaN or infinite: the run
    stopped there and wrote no checkpoint of it (``--allow-nonfinite-loss`` runs on)."""


def problem(line: Mapping[str, Any], *, skipped: bool) -> str | None:
    """What is not finite in a step's metrics line (``'loss is nan'``), or ``None``.

    Args:
        line: the step's metrics (``loss``, ``grad_norm``; a missing norm is not checked).
        skipped: the optimizer step was skipped for an inf or NaN gradient (fp16's loss scaler
            does that, and lowers its scale): the norm is expected to be non-finite then.
    """
    loss = float(line["loss"])
    if not math.isfinite(loss):
        return f"loss is {loss}"
    norm = line.get("grad_norm")
    if norm is not None and not skipped and not math.isfinite(float(norm)):
        return f"gradient norm is {float(norm)} (loss {loss})"
    return None


def weights_finite(parameters: list[torch.Tensor], *, device: torch.device | str = "cpu") -> bool:
    """Whether every parameter is finite; collective under torch.distributed (every rank gets the
    same answer, so every rank skips or stops at the same save). A shard (a ``DTensor``) is checked
    as its local part: the all-reduce below covers the other parts, with no collective per tensor."""
    ok = all(bool(torch.isfinite(local_part(p.detach())[0]).all()) for p in parameters)
    if dist.is_initialized():
        flag = torch.tensor([1 if ok else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        ok = bool(flag.item())
    return ok


def resume_hint(newest: Path | None) -> str:
    """How to go on after a divergence, from the newest (finite) checkpoint or from scratch."""
    fix = "a lower --lr (or a longer --warmup, a smaller --max-norm)"
    if newest is None:
        return f"no checkpoint yet: rerun with {fix}"
    return (f"the newest finite checkpoint is {newest}: rerun the same command with {fix} to resume from it, "
            "or --allow-nonfinite-loss to train on regardless")
