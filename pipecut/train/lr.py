"""The learning rate of a step: linear warm-up, then cosine decay to a floor (pure).

The rate is a function of the step number alone, set on the optimizer before each step rather
than kept as scheduler state, so a resumed run (even one given a larger ``--steps``) takes the
rate the command it runs with gives that step.

Example:
    >>> [round(lr_at(k, lr=1.0, warmup=2, decay_end=6, floor=0.1), 2) for k in range(7)]
    [0.5, 1.0, 1.0, 0.87, 0.55, 0.23, 0.1]
"""

from __future__ import annotations

import math

__all__ = ["lr_at"]


def lr_at(step: int, *, lr: float, warmup: int, decay_end: int, floor: float) -> float:
    """The rate for step ``step`` (0-based: the first optimizer step is 0).

    Args:
        step: the step about to be taken.
        lr: the peak rate.
        warmup: steps of linear warm-up, from ``lr / warmup`` at step 0 to ``lr`` at ``warmup - 1``.
        decay_end: the step the cosine decay reaches ``floor`` (it stays there after).
        floor: the rate at the end of the decay (``min_lr``).
    """
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= decay_end:
        return floor
    span = decay_end - warmup
    progress = (step - warmup) / span if span > 0 else 1.0
    return floor + 0.5 * (lr - floor) * (1.0 + math.cos(math.pi * progress))
