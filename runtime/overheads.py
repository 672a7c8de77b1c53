"""Measure what this runtime costs per pipeline action on this host, for the planner's cost model.

Legend: ``p`` ranks, ``m`` micro-batches, ``T(m)`` a measured step, ``S(m)`` the simulated one.

Each action (a stage's forward, backward, input- or weight-gradient of one micro-batch) costs the
executor some scheduling, stashing, posting of sends and waiting to be woken, whatever the ops
inside it. Beside GPU kernels that is nothing; on CPU processes sharing cores it can decide which
layout is fastest. It is measured here on a pipeline of ``p`` stages, one per rank of the job,
run with 1F1B at two micro-batch counts: each extra micro-batch adds one forward and one
backward action per rank, and what the step grows by beyond what the simulator already predicts
for it (the ops, the messages on the cluster's links) is two actions' overhead. The pipeline is
the model to be planned when one is given (a trial run, as DeepSpeed's autotuner runs trials:
its processes then compete for the cores as the job's will), else one tiny layer per rank. The
result goes into ``DeviceSpec.action_overhead``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partitioner import Cluster, LayoutSearch, partition
from partitioner.errors import CalibrationError
from partitioner.plan.layout import Option
from partitioner.plan.predict import predict
from runtime.options import Execution
from runtime.trainer import PipelineTrainer

__all__ = [
    "fit_action_overhead", "measure_action_overhead", "with_action_overhead", "fit_to_runtime", "calibrate_job",
]


def fit_action_overhead(measured: tuple[float, float], simulated: tuple[float, float], extra_actions: int) -> float:
    """Seconds per action: how much more the measured step grew than the simulated one, per added action.

    Example:
        >>> fit_action_overhead((0.010, 0.050), (0.002, 0.010), extra_actions=16)   # (0.040 - 0.008) / 16
        0.002
    """
    grew = (measured[1] - measured[0]) - (simulated[1] - simulated[0])
    return max(0.0, grew / extra_actions)


def with_action_overhead(cluster: Cluster, seconds: float) -> Cluster:
    """``cluster`` with every device's ``action_overhead`` set to ``seconds``."""
    return replace(cluster, devices=tuple(replace(d, action_overhead=seconds) for d in cluster.devices))


def measure_action_overhead(
    cluster: Cluster,
    *,
    model: nn.Module | None = None,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = nn.functional.mse_loss,
    microbatches: tuple[int, int] = (1, 9),
    repeat: int = 7,
    timeout: float = 120.0,
    search: LayoutSearch | None = None,
) -> float:
    """Seconds per pipeline action on this host, measured over the job's ranks (call on every rank).

    Args:
        cluster: the cluster the planner prices on (its links and speeds give the simulated
            steps the measurement is compared with); one device per rank of the job.
        model: the model to time, cut into one stage per rank (default: a tiny layer per rank);
            it is trained without an optimizer (its gradients are left set).
        batch: ``batch(rows) -> (inputs, targets)`` for ``model`` (the same on every rank).
        loss_fn: ``loss_fn(output, target)`` for ``model``.
        microbatches: the two micro-batch counts timed.
        repeat: timed steps per count (the median is kept), after one untimed.
        timeout: seconds any wait for a peer may take.
        search: the layout search that will plan the job (one device per rank): the pipeline is
            then its model, cut by it into one stage per rank at ``batch``'s one-row micro-batches,
            and the simulated steps are its prices of those runs (the cores idle ranks leave to
            busy ones included), so what is left over is the runtime's alone; ``model`` is not
            needed, ``batch`` is.

    Returns:
        The same value on every rank (the ranks' mean).

    Raises:
        CalibrationError: ``search`` was given without ``batch``.
    """
    p = dist.get_world_size()
    if search is not None:
        if batch is None:
            raise CalibrationError(
                "measure_action_overhead(search=...) needs batch=: a function of rows -> (inputs, targets) "
                "for the search's model, e.g. batch=lambda rows: (x[:rows], y[:rows])"
            )
        return _on_search(search, batch, loss_fn, microbatches, repeat, timeout)
    if model is None or batch is None:
        gen = torch.Generator().manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(p)])
        batch = lambda rows: (torch.randn(rows, 4, generator=gen), torch.randn(rows, 4, generator=gen))  # noqa: E731
    measured, simulated = [], []
    for m in microbatches:
        x, y = batch(m)
        plan = partition(model, (x[:1],), p, cluster=cluster.with_devices(p), microbatches=m)
        trainer = PipelineTrainer(plan, loss_fn, execution=Execution(transport="dist", timeout=timeout),
                                  data_parallel=1)
        measured.append(_median_step(trainer, x, y, repeat))
        simulated.append(predict(plan.stages, plan.cluster, "1f1b", m).step_time)
    return _agreed(measured, simulated, microbatches)


def _on_search(
    search: LayoutSearch, batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], microbatches: tuple[int, int], repeat: int, timeout: float,
) -> float:
    """:func:`measure_action_overhead` on ``search``'s model, plans and prices (one row per micro-batch)."""
    p = dist.get_world_size()
    before = search.cluster
    search.use_cluster(with_action_overhead(before, 0.0))  # price the runs without the overhead measured
    try:
        measured, simulated = [], []
        for m in microbatches:
            opt = Option(1, p, "1f1b", 1, "none", m)
            plan = search.plan(opt)
            trainer = PipelineTrainer(plan, loss_fn, execution=Execution(transport="dist", timeout=timeout,
                                                                         microbatches=m), data_parallel=1)
            x, y = batch(m)
            measured.append(_median_step(trainer, x, y, repeat))
            simulated.append(search.price(opt).pipeline_time)
        search.model.zero_grad(set_to_none=True)
    finally:
        search.use_cluster(before)
    return _agreed(measured, simulated, microbatches)


def _agreed(measured: list[float], simulated: list[float], microbatches: tuple[int, int]) -> float:
    """The overhead per action this rank measured, averaged over the ranks (the same everywhere)."""
    mine = fit_action_overhead((measured[0], measured[1]), (simulated[0], simulated[1]),
                               2 * (microbatches[1] - microbatches[0]))
    total = torch.tensor([mine], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _median_step(trainer: PipelineTrainer, x: torch.Tensor, y: torch.Tensor, repeat: int) -> float:
    """The median seconds of the trainer's ``forward_backward(x, y)`` after one untimed call, every
    rank starting together."""
    times = []
    for k in range(repeat + 1):
        dist.barrier()
        t0 = time.perf_counter()
        trainer.forward_backward(x, y)
        if k:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fit_to_runtime(
    search: LayoutSearch,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    *,
    sizes: tuple[int, int] = (1, 4),
    repeat: int = 7,
) -> Cluster:
    """``search``'s cluster fitted to the model as this runtime trains it: a one-stage trainer's
    ``forward_backward`` of one micro-batch (the loss included), timed here at ``sizes`` rows in
    turns (``LayoutSearch.fit_to_timings``).

    Under torch.distributed, call it on every rank of the job at once: the ranks time the step
    together, sharing the host's cores as the job will, and each size's time is the slowest
    rank's (a synchronous step waits for it: processes that share cores do not get equal shares
    over a few milliseconds), so every rank gets the same cluster.

    Raises:
        CalibrationError: the timings do not grow with the size.
    """
    model = search.model
    one = partition(model, (batch(1)[0],), 1, cluster=search.cluster.with_devices(1), microbatches=1)
    trainer = PipelineTrainer(one, loss_fn, execution=Execution(transport="sequential"), data_parallel=1)
    data = [batch(b) for b in sizes]
    times: list[list[float]] = [[] for _ in sizes]
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    for k in range(repeat + 2):
        for i, (x, y) in enumerate(data):
            t0 = time.perf_counter()
            trainer.forward_backward(x, y)
            if k >= 2:
                times[i].append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    got = torch.tensor([statistics.median(t) for t in times], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(got, op=dist.ReduceOp.MAX)
    return search.fit_to_timings(sizes, (float(got[0]), float(got[1])))


def calibrate_job(
    search: LayoutSearch,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    *,
    cores: int | None = None,
    repeat: int = 7,
    timeout: float = 120.0,
) -> Cluster:
    """The cluster ``search`` should price on, fitted on the job's own ranks; ``search`` then uses it.

    The whole calibration the layout benchmark found accurate, as one call (docs/reference/calibration.md,
    *Checked against measured runs*): every rank times a one-stage trainer step of the model at two sizes at once
    (:func:`fit_to_runtime`: the slowest rank's times give the speed and per-op overhead), the
    cluster records the ``cores`` the ranks share (default: this host's), and the runtime's cost
    per pipeline action is measured on the model cut into one stage per rank
    (:func:`measure_action_overhead`). Collective: call it on every rank of the job at once, with
    the same ``batch`` everywhere; every rank gets the same cluster. In one process (no process
    group) the action overhead is not measured (it needs one process per rank) and stays the
    cluster's.

    Args:
        search: the job's layout search, on a model with real (not meta) parameters; its cluster
            has one device per rank of the job.
        loss_fn: ``loss_fn(output, target)`` as the job trains.
        batch: ``batch(rows) -> (inputs, targets)``, the same on every rank.
        cores: the CPU cores the ranks share (``Cluster.cores``); default ``os.cpu_count()``.
        repeat: timed steps per measurement (the median is kept).
        timeout: seconds any wait for a peer may take.

    Raises:
        CalibrationError: the timings do not grow with the size (time more repeats or on a quieter machine).
    """
    fitted = fit_to_runtime(search, loss_fn, batch, repeat=repeat)
    cluster = replace(fitted, cores=cores if cores is not None else os.cpu_count())
    search.use_cluster(cluster)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        seconds = measure_action_overhead(cluster, search=search, batch=batch, loss_fn=loss_fn, repeat=repeat,
                                          timeout=timeout)
        cluster = with_action_overhead(cluster, seconds)
        search.use_cluster(cluster)
    return cluster
