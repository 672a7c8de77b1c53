"""What one training step measured, as a flat dict for any logger, and a rank-0 progress bar.

``PipelineTrainer.step`` leaves ``trainer.last_metrics``: the step number, the global batch's
loss, the learning rate, the gradient norm (when clipped), the step's wall time, samples and
tokens per second over all replicas, and the measured bubble: the fraction of the pipeline's
run (the schedule's actions, from the first to the last) this process's ranks spent not
running an action (waiting for a message, or with nothing to do), ``1 - busy / run_time``,
the quantity the plan's simulator predicts. Busy time is host time:
on a GPU, work is launched asynchronously, so there the bubble reads low unless stages
synchronise.

:class:`TrainingProgress` shows those as a ``rich`` progress bar, on global rank 0 only.

Example:
    >>> import io
    >>> from rich.console import Console
    >>> console = Console(file=io.StringIO(), width=120)
    >>> with TrainingProgress(total=2, console=console) as bar:
    ...     bar.update({"step": 1, "loss": 2.5, "tokens_per_s": 1.2e4, "step_time_s": 0.1, "bubble": 0.2})
    >>> "loss 2.5000" in console.file.getvalue()
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["step_metrics", "batch_counts", "TrainingProgress", "format_metrics"]


def batch_counts(inputs: Sequence[Any], replicas: int = 1) -> tuple[int, int | None]:
    """``(samples, tokens)`` of a batch over ``replicas`` equal shares of it.

    Samples are the first input's rows; tokens are counted when the first input holds integer
    ids of at least 2 dimensions (a language model's ``(B, T)`` batch): its element count.

    Example:
        >>> batch_counts([torch.zeros(4, 16, dtype=torch.long)], replicas=2)
        (8, 128)
    """
    first = inputs[0] if inputs else None
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return 0, None
    tokens = first.numel() * replicas if not first.dtype.is_floating_point and first.dim() >= 2 else None
    return first.shape[0] * replicas, tokens


def step_metrics(
    *,
    step: int,
    loss: torch.Tensor,
    seconds: float,
    busy: Sequence[float],
    inputs: Sequence[Any],
    replicas: int = 1,
    optimizer: torch.optim.Optimizer | None = None,
    grad_norm: torch.Tensor | None = None,
    pipeline_seconds: float | None = None,
) -> dict[str, float | int | None]:
    """One step's metrics.

    Args:
        step: optimizer steps taken, this one included.
        loss: the global batch's mean loss.
        seconds: the step's wall time.
        busy: per rank of this process, seconds its actions ran.
        inputs: this replica's batch (the model's positional inputs).
        replicas: data-parallel replicas (each had a batch like ``inputs``).
        optimizer: read for the learning rate (its first group's).
        grad_norm: the total norm when gradients were clipped.
        pipeline_seconds: the wall time of the pipeline's run alone (the bubble's denominator;
            default ``seconds``): the optimizer, clipping and gradient exchange are not pipeline.

    Example:
        >>> m = step_metrics(step=3, loss=torch.tensor(1.5), seconds=0.5, busy=[0.4, 0.3],
        ...                  inputs=[torch.zeros(8, 4)])
        >>> m["samples_per_s"], round(m["bubble"], 2), m["tokens_per_s"]
        (16.0, 0.3, None)
    """
    samples, tokens = batch_counts(inputs, replicas)
    per_s = 1.0 / seconds if seconds > 0 else 0.0
    span = pipeline_seconds if pipeline_seconds is not None else seconds
    idle = [1.0 - b / span for b in busy] if span > 0 and busy else []
    return {
        "step": step,
        "loss": float(loss),
        "lr": float(optimizer.param_groups[0]["lr"]) if optimizer is not None and optimizer.param_groups else None,
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "step_time_s": seconds,
        "samples_per_s": samples * per_s,
        "tokens_per_s": tokens * per_s if tokens is not None else None,
        "bubble": max(0.0, sum(idle) / len(idle)) if idle else None,
    }


class TrainingProgress:
    """A rich progress bar of training steps with the loss, tokens/s, step time and bubble.

    Shown on global rank 0 only (every rank may create and update it; the others do nothing).

    Args:
        total: steps to run (``None``: open-ended).
        console: the ``rich.console.Console`` to draw on (default: stderr's).
        enabled: show it (default: on rank 0, or when torch.distributed is not initialised).
    """

    def __init__(self, total: int | None = None, *, console: Any = None, enabled: bool | None = None) -> None:
        if enabled is None:
            enabled = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        self.enabled = enabled
        self._progress: Any = None
        self._task: Any = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"), console=console,
        )
        self._task = self._progress.add_task("steps", total=total, info="")

    def __enter__(self) -> TrainingProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()

    def update(self, metrics: Mapping[str, Any]) -> None:
        """Advance to ``metrics['step']`` and show its values (from ``trainer.last_metrics``)."""
        if self._progress is None:
            return
        self._progress.update(self._task, completed=metrics.get("step", 0), info=describe(metrics))
        self._progress.refresh()


def format_metrics(
    metrics: Mapping[str, Any], formats: Sequence[tuple[str, Callable[[Any], str]]]
) -> list[str]:
    """Each metric named in ``formats`` that ``metrics`` holds (not ``None``), formatted, in ``formats``' order.

    Example:
        >>> format_metrics({"loss": 2.5, "lr": None}, [("loss", "loss {:.4f}".format), ("lr", "lr {:.2e}".format)])
        ['loss 2.5000']
    """
    return [fmt(metrics[key]) for key, fmt in formats if metrics.get(key) is not None]


_SHOWN: tuple[tuple[str, Callable[[Any], str]], ...] = (
    ("loss", "loss {:.4f}".format),
    ("tokens_per_s", lambda v: f"{v / 1e3:.1f}k tok/s"),
    ("samples_per_s", "{:.1f} samples/s".format),
    ("step_time_s", lambda v: f"{1e3 * v:.1f} ms/step"),
    ("bubble", lambda v: f"bubble {100 * v:.0f}%"),
    ("grad_norm", "|g| {:.3g}".format),
)


def describe(metrics: Mapping[str, Any]) -> str:
    """One line of a step's metrics, e.g. ``loss 2.3010  12.0k tok/s  85.1 ms/step  bubble 21%``."""
    if metrics.get("tokens_per_s") is not None:  # samples/s only where tokens are not counted
        metrics = {**metrics, "samples_per_s": None}
    return "  ".join(format_metrics(metrics, _SHOWN))
