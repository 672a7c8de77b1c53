"""Fit the planner's cluster to a model on this host's processes: ``pipecut calibrate --model M --devices N``.

Legend: ``N`` devices (one gloo process each), ``B`` the global batch (rows per step), ``T`` tokens
per row, ``V`` a language model's vocabulary.

A host measured alone (``Cluster.measure``: matrix products, memory, tiny ops, links) ranks
layouts poorly on CPU processes (docs/reference/calibration.md: a Spearman of 0.20 on the
layout benchmark); what made the benchmark's predictions accurate is fitting that cluster to the
model as the runtime trains it, on the job's own processes (``runtime.overheads.calibrate_job``).
:func:`fit_model` runs that fit from a model factory, without a job: it spawns ``N`` processes on
this host, each builds the model (meta tensors made real and initialised), a ``LayoutSearch`` for
``N`` devices on the measured host cluster (whose links and collectives it keeps), and calls
``calibrate_job`` with a loss and a batch made for the model:

- a causal language model (one integer input ``(b, T)``, logits ``(b, T, V)`` out, or an output
  holding them as ``.logits``): next-token cross-entropy on random token ids;
- any other model of one input tensor and one floating output tensor: the mean squared output
  (``mse_loss`` against zeros) on rows of its own example input. The loss is a small part of a
  step; what is fitted is the model's forward and backward.

Every process is bounded by ``timeout`` and killed past it (``runtime.transport.launch.spawn``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from torch import nn

from partitioner import Cluster, LayoutSearch
from partitioner.errors import CalibrationError
from runtime.overheads import calibrate_job
from runtime.state.materialize import materialize
from runtime.transport.launch import LaunchError, spawn

__all__ = ["ModelFit", "fit_model", "next_token_loss", "output_loss", "fit_mismatch", "model_id", "FITTED_TO"]

log = logging.getLogger(__name__)

Build = Callable[[], tuple[nn.Module, tuple[Any, ...]]]
"""A picklable factory (a module-level function, or a ``functools.partial`` of one) returning
``(model, example_inputs)``, as ``partitioner.zoo.load_model`` does: each process calls it."""

FITTED_TO = "fitted_to"
"""The key of a saved cluster's ``details`` that records what it was fitted on (:meth:`ModelFit.details`)."""

LM_LOSS = "next-token cross-entropy"
OUTPUT_LOSS = "mean squared output"


@dataclass(frozen=True)
class ModelFit:
    """A cluster fitted to one model on ``devices`` processes of this host, and what it was fitted on.

    ``cluster`` is the host cluster :func:`fit_model` started from (its links and collectives kept)
    with each device's speed and per-op overhead fitted to the model's step, the runtime's cost
    per pipeline action (``action_overhead``) and the cores the processes share (``cores``).
    """

    cluster: Cluster
    model: str
    """The model as the user named it (a built-in name, ``file.py:factory`` or a folder)."""
    model_id: str
    """The same model, spelled so that two names of it compare equal (an absolute path)."""
    devices: int
    global_batch: int
    loss: str
    """:data:`LM_LOSS` or :data:`OUTPUT_LOSS`: what the fitted step computed."""
    parameters: int
    wall_s: float

    def details(self) -> dict[str, Any]:
        """``{FITTED_TO: {...}}``: JSON-ready, for ``Cluster.save(details=...)``; :func:`fit_mismatch` reads it."""
        dev = self.cluster.devices[0]
        return {FITTED_TO: {
            "model": self.model, "model_id": self.model_id, "devices": self.devices,
            "global_batch": self.global_batch, "loss": self.loss, "parameters": self.parameters,
            "peak_flops": dev.peak_flops, "peak_flops_fp32": dev.peak_flops_fp32,
            "mem_bandwidth": dev.mem_bandwidth, "op_overhead": dev.op_overhead,
            "action_overhead": dev.action_overhead, "cores": self.cluster.cores, "wall_s": self.wall_s,
        }}


def fit_model(
    build: Build,
    host: Cluster,
    *,
    model: str,
    model_id: str | None = None,
    global_batch: int | None = None,
    repeat: int = 7,
    timeout: float = 600.0,
    seed: int = 0,
) -> ModelFit:
    """``host`` fitted to the model ``build`` makes, on ``len(host)`` processes of this host at once.

    The layout benchmark's calibration from the command line: each process builds the model,
    a ``LayoutSearch`` of it for ``len(host)`` devices and ``global_batch`` rows on ``host``, and
    runs ``runtime.overheads.calibrate_job`` with the loss and batch of the module docstring.

    Args:
        build: the model factory, called once here (to count the parameters) and once in every
            process (with the same seed, so every rank holds the same weights).
        host: the measured host cluster to start from (``Cluster.measure(N, ...)``), one device
            per process.
        model: the model's name as given, recorded with the fit.
        model_id: a spelling of the model that compares equal across names (default ``model``).
        global_batch: the job's rows per step ``B`` (default ``N``); batches are drawn from ``B`` rows.
        repeat: timed steps per measurement (the median is kept).
        timeout: seconds for the whole fit, and for any wait between processes inside it.
        seed: the seed of the weights and the data.

    Raises:
        CalibrationError: the model does not fit this host's memory ``N`` times over, a process
            failed (its traceback in the message), or the fit ran past ``timeout``.

    Example:
        >>> from functools import partial
        >>> from partitioner.zoo import load_model
        >>> host = Cluster.measure(2)  # doctest: +SKIP
        >>> fit = fit_model(partial(load_model, "gpt2-tiny"), host, model="gpt2-tiny")  # doctest: +SKIP
        >>> fit.cluster.devices[0].name, fit.cluster.cores, fit.loss  # doctest: +SKIP
        ('cpu (measured) (fitted to the model)', 2, 'next-token cross-entropy')
    """
    devices = len(host)
    batch_rows = devices if global_batch is None else global_batch
    if batch_rows < 1 or repeat < 1:
        raise CalibrationError(f"global_batch and repeat must be at least 1, got {batch_rows} and {repeat}")
    built, _ = build()
    parameters = sum(p.numel() for p in built.parameters())
    _check_memory(model, built, devices)
    del built
    t0 = time.perf_counter()
    job = _Job(build, host, batch_rows, repeat, timeout, seed)
    try:
        got = spawn(_worker, devices, job, timeout=timeout, threads=1)
    except LaunchError as e:
        raise CalibrationError(f"fitting the cluster to {model} on {devices} processes failed: {e}") from e
    cluster, loss = got[0]
    fit = ModelFit(cluster, model, model_id or model, devices, batch_rows, loss, parameters, time.perf_counter() - t0)
    log.info("fitted to %s on %d processes in %.1f s: %s", model, devices, fit.wall_s, fit.details())
    return fit


def fit_mismatch(fitted_to: Mapping[str, Any] | None, *, model_id: str, devices: int,
                 parameters: int | None = None) -> str | None:
    """Why a cluster fitted on ``fitted_to`` (:meth:`ModelFit.details`) is not the one to plan this
    model on ``devices`` devices with, or ``None`` when it is (or when it records no fit).

    Example:
        >>> saved = {"model": "gpt2-tiny", "model_id": "gpt2-tiny", "devices": 4, "parameters": 10}
        >>> fit_mismatch(saved, model_id="gpt2-tiny", devices=4, parameters=10) is None
        True
        >>> fit_mismatch(saved, model_id="mlp", devices=2)
        'it was fitted on model gpt2-tiny, not mlp; on 4 devices, not 2'
    """
    if not fitted_to:
        return None
    was_model, shown = fitted_to.get("model_id", fitted_to.get("model")), fitted_to.get("model")
    was_parameters, was_devices = fitted_to.get("parameters"), fitted_to.get("devices")
    reasons = []
    if was_model != model_id:
        reasons.append(f"on model {shown}, not {model_id}")
    elif parameters is not None and was_parameters not in (None, parameters):
        reasons.append(f"on {shown} of {was_parameters} parameters, not this one of {parameters}")
    if was_devices != devices:
        reasons.append(f"on {was_devices} devices, not {devices}")
    return "it was fitted " + "; ".join(reasons) if reasons else None


def model_id(spec: str) -> str:
    """A model's name (``pipecut plan MODEL``) spelled so that two names of one model compare equal:
    a folder or a ``file.py:factory`` by its absolute path, a built-in name as it is.

    Example:
        >>> model_id("gpt2-tiny"), model_id("./m.py:build") == model_id("m.py:build")
        ('gpt2-tiny', True)
    """
    if os.path.isdir(spec):
        return str(Path(spec).resolve())
    path, sep, name = spec.rpartition(":")
    if sep and path.endswith(".py"):
        return f"{Path(path).resolve()}:{name}"
    return spec


def next_token_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, the mean over the tokens: ``output`` is logits ``(b, T, V)`` or holds them
    as ``.logits`` (a Hugging Face model's output); ``targets`` ``(b, T)`` are the inputs shifted by one,
    moved to the logits' device. ``pipecut train`` trains with it (``pipecut.train.loop.lm_loss``)."""
    logits = output.logits if hasattr(output, "logits") else output
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.to(logits.device).flatten())


def output_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean squared output against ``targets`` (zeros): the generic loss of a model that is not a causal LM."""
    return nn.functional.mse_loss(output, targets)


# -- one process ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    build: Build
    host: Cluster
    global_batch: int
    repeat: int
    timeout: float
    seed: int


def _worker(rank: int, world: int, job: _Job) -> tuple[Cluster, str]:
    """One process: build the model, its loss and batches, a layout search, and fit (collective)."""
    torch.manual_seed(job.seed)
    model, inputs = job.build()
    if any(t.is_meta for t in chain(model.parameters(), model.buffers())):
        materialize(model, {0: model}, "cpu", seed=job.seed)
    loss_fn, batch, loss = _loss_and_batch(model, inputs, job.global_batch, job.seed)
    search = LayoutSearch(model, (batch(1)[0],), cluster=job.host.with_devices(world), global_batch=job.global_batch)
    cluster = calibrate_job(search, loss_fn, batch, repeat=job.repeat, timeout=job.timeout)
    return cluster, loss


Batch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def _loss_and_batch(
    model: nn.Module, inputs: tuple[Any, ...], global_batch: int, seed: int
) -> tuple[Callable[[Any, torch.Tensor], torch.Tensor], Batch, str]:
    """The loss the fit trains with, ``batch(rows) -> (inputs, targets)`` over ``global_batch`` rows, its name."""
    if len(inputs) != 1 or not isinstance(inputs[0], torch.Tensor) or inputs[0].dim() < 1:
        kinds = [type(x).__name__ for x in inputs]
        raise CalibrationError(
            f"pipecut calibrate --model fits models of one input tensor with a batch dimension, and this "
            f"factory's example inputs are {kinds}: fit it in a script with runtime.overheads.calibrate_job("
            "search, loss_fn, batch), which takes your own loss and batches"
        )
    gen = torch.Generator().manual_seed(seed + 1)
    x = _real(inputs[0], gen)
    with torch.no_grad():
        out = model(x[:1])
    logits = out.logits if hasattr(out, "logits") else out
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise CalibrationError(
            f"the model returns {type(out).__name__}: pipecut calibrate --model fits models whose output is one "
            "floating tensor or a causal LM's logits; fit yours with runtime.overheads.calibrate_job(search, "
            "loss_fn, batch) and your own loss"
        )
    if not x.is_floating_point() and x.dim() == 2 and logits.dim() == 3 and logits.shape[:2] == x[:1].shape:
        ids = torch.randint(0, logits.shape[-1], (global_batch, x.shape[1] + 1), generator=gen)  # (B, T + 1)
        data, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        return next_token_loss, _rows_of(data, targets), LM_LOSS
    data = x[torch.arange(global_batch) % x.shape[0]]
    targets = torch.zeros((global_batch, *logits.shape[1:]), dtype=logits.dtype)
    return output_loss, _rows_of(data, targets), OUTPUT_LOSS


def _rows_of(data: torch.Tensor, targets: torch.Tensor) -> Batch:
    """``batch(b)``: the first ``b`` rows, cycling through the pool when ``b`` exceeds it (as the benchmark's)."""
    def batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        pick = torch.arange(rows) % data.shape[0]
        return data[pick], targets[pick]

    return batch


def _real(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``t`` itself, or a real tensor of its shape when it is on meta (zeros for ids, noise for values)."""
    if not t.is_meta:
        return t
    if t.is_floating_point():
        return torch.randn(t.shape, dtype=t.dtype, generator=gen)
    return torch.zeros(t.shape, dtype=t.dtype)


def _check_memory(model: str, built: nn.Module, devices: int) -> None:
    """Refuse a fit whose processes cannot hold the model's weights and gradients at once."""
    weights = sum(p.numel() * p.element_size() for p in built.parameters())
    try:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX: nothing to check against
        return
    need = 3 * weights * devices  # weights, gradients and the stages' copies, in every process
    if need > memory:
        raise CalibrationError(
            f"fitting {model} runs it in {devices} processes at once, about {need / 2**30:.1f} GiB "
            f"({weights / 2**30:.2f} GiB of weights each, with gradients), more than this host's "
            f"{memory / 2**30:.1f} GiB: fit a smaller model of the same family here, or plan with --device"
        )
