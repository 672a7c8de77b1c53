"""Gradient accumulation over several ``forward_backward`` calls between optimizer steps.

What a call does to the gradients after its backward passes (sums over a tied weight's copies,
the average over data-parallel replicas, fp16 unscaling) must apply to that call's gradients
only: earlier calls' were summed, averaged and unscaled already. So a call sets the gradients
it finds aside first (:func:`set_aside`), works on its own, and adds the earlier ones back
(:func:`add_back`).

Example:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(2)); w.grad = torch.full((2,), 3.0)
    >>> aside = set_aside([w]); w.grad is None
    True
    >>> w.grad = torch.ones(2); add_back(aside); w.grad.tolist()
    [4.0, 4.0]
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["set_aside", "add_back"]


def set_aside(params: Iterable[torch.nn.Parameter]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Take the gradients already accumulated off ``params`` (their ``.grad`` becomes ``None``)."""
    aside = []
    for prm in params:
        if prm.grad is not None:
            aside.append((prm, prm.grad))
            prm.grad = None
    return aside


def add_back(aside: Iterable[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    """Add what :func:`set_aside` took to the gradients there now (or put it back where none is)."""
    for prm, grad in aside:
        prm.grad = grad if prm.grad is None else grad.add_(prm.grad)
