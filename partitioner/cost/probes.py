"""Timing probes run inside one process: matmul FLOP/s, memory bandwidth and per-op overhead of
this process's threads, p2p and all-reduce speed over an initialised process group, and the
least-squares fits that turn timings into speeds. Plain torch: no graph, no cluster.

``partitioner.cost.calibrate`` runs these in several processes at once and builds a ``Cluster``.

Legend: ``n`` ranks in an all-reduce; a GEMM is ``batch`` x (``rows`` x ``inner``) @
(``inner`` x ``cols``).
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partitioner.errors import CalibrationError, ClusterError

__all__ = [
    "fit_speed_and_overhead",
    "fit_or_overhead_only",
    "rows_like",
    "time_forward_backward",
    "GemmShape",
    "LinearFit",
    "Probe",
    "ComputeSpeed",
    "DEFAULT_GEMMS",
    "fit_linear",
    "fit_allreduce",
    "measure_compute",
    "pingpong",
    "allreduce",
]

log = logging.getLogger(__name__)

@dataclass(frozen=True, order=True)
class GemmShape:
    """One matrix product: ``batch`` x (``rows`` x ``inner``) @ (``inner`` x ``cols``).

    Example:
        >>> GemmShape(256, 128, 384).flops
        25165824
        >>> GemmShape(4096, 1024, 1024).capped(1e9)
        GemmShape(rows=2000, inner=500, cols=500, batch=1)
    """

    rows: int
    inner: int
    cols: int
    batch: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.rows * self.inner * self.cols

    def capped(self, max_flops: float) -> GemmShape:
        """The same product made smaller so it costs at most ``max_flops``: fewer batches first,
        then rows, inner and columns all shrunk by the same factor (a product of 175B-model sizes
        would take minutes on a laptop, and its speed is that of a smaller product of the same
        proportions; shrinking one side alone would leave a matrix-vector product, which is
        bandwidth-bound). Sides stop at 1, so a shape with a side of 1 may stay above the cap."""
        shape = self
        if shape.flops > max_flops and shape.batch > 1:
            shape = replace(shape, batch=max(1, int(max_flops // (2 * shape.rows * shape.inner * shape.cols))))
        if shape.flops > max_flops:
            f = (max_flops / shape.flops) ** (1 / 3)
            shape = replace(shape, rows=max(1, int(shape.rows * f)), inner=max(1, int(shape.inner * f)),
                            cols=max(1, int(shape.cols * f)))
        return shape


# A small GPT-2's products (256 tokens, width 256): the attention input and output projections,
# the MLP's two, and a batched attention product of 8 heads.
DEFAULT_GEMMS: Mapping[GemmShape, float] = {
    GemmShape(256, 256, 768): 1, GemmShape(256, 256, 256): 1, GemmShape(256, 256, 1024): 1,
    GemmShape(256, 1024, 256): 1, GemmShape(64, 32, 64, batch=32): 1,
}


@dataclass(frozen=True)
class LinearFit:
    """``seconds = latency + bytes / bandwidth``, fitted to measurements.

    Example:
        >>> LinearFit(latency=1e-5, bandwidth=1e9).seconds(1e6)
        0.00101
    """

    latency: float
    bandwidth: float

    def seconds(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


def fit_linear(sizes: Sequence[float], seconds: Sequence[float]) -> LinearFit:
    """Least-squares fit of ``seconds = latency + sizes / bandwidth``.

    A slightly negative intercept (noise on tiny latencies) is read as zero latency.

    Args:
        sizes: bytes moved (or any work measure) per measurement.
        seconds: the time each took.

    Raises:
        CalibrationError: fewer than two distinct sizes, lengths that differ, a value that is not
            finite, or times that do not grow with size (no positive bandwidth fits them).

    Example:
        >>> f = fit_linear([1e3, 1e6, 4e6], [2e-5 + 1e3 / 2e9, 2e-5 + 1e6 / 2e9, 2e-5 + 4e6 / 2e9])
        >>> round(f.latency * 1e6, 3), round(f.bandwidth / 1e9, 3)
        (20.0, 2.0)
    """
    if len(sizes) != len(seconds):
        raise CalibrationError(f"got {len(sizes)} sizes but {len(seconds)} timings; give one timing per size")
    if not all(math.isfinite(x) for x in (*sizes, *seconds)):
        raise CalibrationError(f"sizes and timings must be finite, got sizes={list(sizes)}, seconds={list(seconds)}")
    if len(set(sizes)) < 2:
        raise CalibrationError(f"need timings at two or more distinct sizes to fit a line, got sizes {list(sizes)}")
    slope, intercept = statistics.linear_regression(sizes, seconds)
    if slope <= 0:
        raise CalibrationError(
            f"timings do not grow with size (slope {slope:.3g} s/byte over sizes {list(sizes)}, "
            f"seconds {[f'{s:.3g}' for s in seconds]}); measure larger sizes, or on a quieter machine"
        )
    return LinearFit(latency=max(0.0, intercept), bandwidth=1.0 / slope)


def fit_allreduce(n: int, sizes: Sequence[float], seconds: Sequence[float]) -> LinearFit:
    """Bus bandwidth and per-step latency of an all-reduce over ``n`` ranks (nccl-tests' convention).

    A ring all-reduce of ``S`` bytes moves ``2 (n - 1) / n * S`` bytes through each rank in
    ``2 (n - 1)`` steps, so ``seconds = 2 (n - 1) * latency + 2 (n - 1) / n * S / bandwidth``;
    ``bandwidth`` is then comparable across ``n`` and is what ``Cluster.collective_bandwidth`` holds.

    Example:
        >>> sizes = [1e4, 1e6, 4e6]
        >>> f = fit_allreduce(4, sizes, [6 * 1e-5 + 1.5 * s / 1e9 for s in sizes])
        >>> round(f.latency * 1e6, 3), round(f.bandwidth / 1e9, 3)
        (10.0, 1.0)
    """
    if n < 2:
        raise CalibrationError(f"an all-reduce needs at least 2 ranks to measure, got {n}")
    fit = fit_linear([2 * (n - 1) / n * s for s in sizes], seconds)
    return LinearFit(latency=fit.latency / (2 * (n - 1)), bandwidth=fit.bandwidth)


@dataclass(frozen=True)
class Probe:
    """What to measure and how long: the sizes of every probe (one option object for them all).

    Args:
        gemms: GEMM shapes and their weights (how often the model runs each); the FLOP/s kept is
            the weighted total FLOPs over the weighted total time (see ``partitioner.cost.gemms.model_gemms``).
        max_gemm_flops: each product is shrunk to at most this many FLOPs (``GemmShape.capped``).
        max_gemms: time only the heaviest products (by weighted FLOPs), at most this many.
        dtypes: ``"float32"`` (``peak_flops_fp32``) and/or ``"bfloat16"`` (``peak_flops``); a
            dtype left out takes the other's speed.
        elementwise: element counts of the float32 additions that measure memory bandwidth.
        messages: byte sizes of the p2p and all-reduce messages.
        min_time: seconds of timed calls per compute point (at least ``repeat`` calls), in five
            windows of several scheduler slices each, so processes sharing a core see their share
            (see :func:`time_call`).
        repeat: timed calls per point at least; round trips and all-reduces: exactly this many
            (their median is kept).

    Example:
        >>> Probe.tiny().repeat
        3
    """

    gemms: tuple[tuple[GemmShape, float], ...] = tuple(DEFAULT_GEMMS.items())
    max_gemm_flops: float = 4e8
    max_gemms: int = 8
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    elementwise: tuple[int, ...] = (2**12, 2**15, 2**18, 2**20)
    messages: tuple[int, ...] = (2**10, 2**18, 2**22, 2**24)
    min_time: float = 0.2
    repeat: int = 9

    def __post_init__(self) -> None:
        if not self.gemms or not self.dtypes or len(self.elementwise) < 2 or len(self.messages) < 2:
            raise ClusterError(
                "a Probe needs GEMM shapes, a dtype and two or more elementwise and message sizes, got "
                f"{len(self.gemms)} GEMMs, dtypes {self.dtypes}, elementwise {self.elementwise}, "
                f"messages {self.messages}"
            )
        bad = [d for d in self.dtypes if d not in ("float32", "bfloat16")]
        if bad or self.repeat < 1:
            raise ClusterError(f"dtypes must be 'float32'/'bfloat16' and repeat >= 1, got {self.dtypes}, {self.repeat}")

    @staticmethod
    def tiny() -> Probe:
        """Small sizes and few repeats: a rough measurement in well under a second (tests)."""
        return Probe(
            gemms=((GemmShape(64, 64, 64), 1.0),), elementwise=(2**10, 2**18), messages=(2**10, 2**24),
            min_time=0.0, repeat=3,
        )

    def with_gemms(self, gemms: Mapping[GemmShape, float]) -> Probe:
        """This probe measuring ``gemms`` (e.g. ``partitioner.cost.gemms.model_gemms`` of the model to plan)."""
        if not gemms:
            raise ClusterError(
                "no GEMM shapes given; pass model_gemms(traced) of a model with matmuls, or DEFAULT_GEMMS"
            )
        return replace(self, gemms=tuple(gemms.items()))


@dataclass(frozen=True)
class ComputeSpeed:
    """What one process measured: FLOP/s per dtype, memory bandwidth (with each op's fixed cost as
    its latency), and the per-op overhead of autograd-recorded tiny ops (forward and backward)."""

    flops: Mapping[str, float]
    memory: LinearFit
    op_overhead: float


# -- compute probes (in one process) ----------------------------------------------------------


def time_call(fn: Callable[[], Any], *, min_time: float, repeat: int, windows: int = 5) -> float:
    """Seconds of one ``fn()`` call: one untimed call, then ``windows`` windows of at least
    ``repeat / windows`` calls and ``min_time / windows`` seconds each; the median window's mean.

    A window's mean, not the median call: with more busy processes than cores most single calls
    still run uninterrupted, and only a window of several scheduler slices shows each process's
    share of a core. The median window, not the whole run's mean: a burst of other work on a
    shared machine spoils one window, not the measurement."""
    fn()
    means = []
    for _ in range(windows):
        calls = 0
        t0 = time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - t0
            if calls * windows >= repeat and elapsed * windows >= min_time:
                break
        means.append(elapsed / calls)
    return statistics.median(means)


def gemm_flops(probe: Probe, dtype: str) -> float:
    """FLOP/s of ``probe.gemms`` in ``dtype`` on this process's CPU threads: weighted FLOPs of the
    heaviest ``max_gemms`` products over their weighted measured time."""
    dt = getattr(torch, dtype)
    heaviest = sorted(probe.gemms, key=lambda sw: -sw[0].flops * sw[1])[: probe.max_gemms]
    work = seconds = 0.0
    for shape, weight in heaviest:
        s = shape.capped(probe.max_gemm_flops)
        a = torch.randn(s.batch, s.rows, s.inner, dtype=dt)
        b = torch.randn(s.batch, s.inner, s.cols, dtype=dt)
        out = torch.empty(s.batch, s.rows, s.cols, dtype=dt)
        if s.batch == 1:
            run = functools.partial(torch.mm, a[0], b[0], out=out[0])
        else:
            run = functools.partial(torch.bmm, a, b, out=out)
        t = time_call(run, min_time=probe.min_time, repeat=probe.repeat)
        work += weight * shape.flops
        seconds += weight * shape.flops / (s.flops / t)
    return work / seconds


def memory_fit(probe: Probe) -> LinearFit:
    """Memory bandwidth and fixed cost per op, from float32 ``a + b`` (allocating its result, as a
    model's elementwise ops do) at ``probe.elementwise`` sizes; bytes are 3 x 4 per element."""
    sizes, times = [], []
    for n in probe.elementwise:
        add = functools.partial(torch.add, torch.randn(n), torch.randn(n))
        times.append(time_call(add, min_time=probe.min_time, repeat=probe.repeat))
        sizes.append(12.0 * n)
    return fit_linear(sizes, times)


def op_overhead(probe: Probe, chain: int = 64) -> float:
    """Fixed seconds per op of a model's graph: a chain of one-element multiplications recorded by
    autograd, run forward and backward, per op and pass (the roofline adds ``op_overhead`` once to
    each node's forward and once to its backward)."""

    @torch.enable_grad()  # a caller under no_grad still measures what training pays
    def run() -> None:
        x = torch.ones(1, requires_grad=True)
        y = x
        for _ in range(chain):
            y = y * 1.0001
        y.backward()

    return time_call(run, min_time=probe.min_time, repeat=probe.repeat) / (2 * chain)


def measure_compute(probe: Probe | None = None) -> ComputeSpeed:
    """Measure this process as it is (its threads, whatever else runs): GEMM FLOP/s per dtype,
    memory bandwidth and op overhead.

    Example:
        >>> speed = measure_compute(Probe.tiny())
        >>> speed.flops["float32"] > 0 and speed.memory.bandwidth > 0
        True
    """
    probe = probe or Probe()
    with torch.no_grad():
        flops = {d: gemm_flops(probe, d) for d in probe.dtypes}
        memory = memory_fit(probe)
    return ComputeSpeed(flops=flops, memory=memory, op_overhead=op_overhead(probe))


# -- links (inside an initialised process group) ----------------------------------------------


def pingpong(rank: int, probe: Probe) -> LinearFit:
    """One-way p2p time between ranks 0 and 1 (half the median round trip), fitted over sizes."""
    times = []
    for size in probe.messages:
        buf = torch.zeros(size, dtype=torch.uint8)
        trips = []
        for i in range(probe.repeat + 2):  # two untimed round trips first
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i >= 2:
                trips.append(time.perf_counter() - t0)
        times.append(statistics.median(trips) / 2)
    return fit_linear([float(s) for s in probe.messages], times)


def allreduce(n: int, group: Any, probe: Probe) -> LinearFit:
    """Bus bandwidth and per-step latency of a float32 all-reduce over ``n`` ranks."""
    times = []
    for size in probe.messages:
        buf = torch.zeros(max(1, size // 4))
        runs = []
        for i in range(probe.repeat + 2):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=group)
            if i >= 2:
                runs.append(time.perf_counter() - t0)
        times.append(statistics.median(runs))
    return fit_allreduce(n, [4.0 * max(1, s // 4) for s in probe.messages], times)


# -- the model's own step: fit the roofline's speed and per-op overhead to it ------------------------
# Legend: ``T(b)`` the measured seconds of one forward and backward of the whole (traced) model at
# ``b`` rows, ``R(b)`` the roofline's seconds for it without per-op overhead, ``K`` the ops it runs.
# A synthetic probe of tiny ops does not meet the overhead the way the model does (Python, the
# dispatcher, the autograd engine, processes sharing cores): solve
# ``T(b1) = R(b1) / s + K overhead`` and ``T(b2) = R(b2) / s + K overhead`` for the speed factor ``s``
# and the overhead (``partitioner.search.LayoutSearch.fit_to_model``).


def fit_speed_and_overhead(
    roofline: tuple[float, float], measured: tuple[float, float], ops: int
) -> tuple[float, float]:
    """``(s, overhead)`` with ``measured[i] = roofline[i] / s + ops * overhead`` at two sizes.

    Raises:
        CalibrationError: the larger size was not measured slower (noise swamped the timing), or
            the roofline does not grow with the size.

    Example:
        >>> s, overhead = fit_speed_and_overhead((1.0, 4.0), (0.6, 2.1), ops=100)   # s = 3 / 1.5; 0.1 / 100
        >>> s, round(overhead, 9)
        (2.0, 0.001)
    """
    (r1, r2), (t1, t2) = roofline, measured
    if not (r2 > r1 and t2 > t1 and ops > 0):
        raise CalibrationError(
            f"cannot fit speed and overhead: the roofline gives {r1:.4g} s then {r2:.4g} s and the model was "
            f"measured at {t1:.4g} s then {t2:.4g} s ({ops} ops); the larger micro-batch must take longer: time "
            "more repeats, larger sizes, or on a quieter machine"
        )
    s = (r2 - r1) / (t2 - t1)
    return s, max(0.0, (t1 - r1 / s) / ops)


def fit_or_overhead_only(
    roofline: tuple[float, float], measured: tuple[float, float], ops: int
) -> tuple[float, float, bool]:
    """:func:`fit_speed_and_overhead`'s ``(s, overhead, True)``, or, where the larger size was not
    measured slower (a step all overhead, timed on busy shared cores), ``(1.0, overhead, False)``:
    the devices' speed kept and the per-op overhead fitted to the mean time over the roofline.

    Raises:
        CalibrationError: there are no ops, or a time is not positive.

    Example:
        >>> fit_or_overhead_only((1.0, 4.0), (0.6, 2.1), ops=100)[2]
        True
        >>> s, overhead, fitted = fit_or_overhead_only((0.001, 0.002), (0.0143, 0.0129), ops=200)
        >>> s, round(overhead, 7), fitted
        (1.0, 6.05e-05, False)
    """
    (r1, r2), (t1, t2) = roofline, measured
    if r2 > r1 and t2 > t1 and ops > 0:
        return (*fit_speed_and_overhead(roofline, measured, ops), True)
    if ops <= 0 or min(t1, t2) <= 0:
        raise CalibrationError(f"cannot fit the per-op overhead: {ops} ops measured at {t1:.4g} s and {t2:.4g} s")
    return 1.0, max(0.0, ((t1 - r1) + (t2 - r2)) / (2 * ops)), False


def rows_like(x: Any, rows: int) -> Any:
    """``x`` (a tensor with a batch dimension, or anything else, kept) with ``rows`` rows, its rows repeated."""
    if isinstance(x, torch.Tensor) and x.dim() and x.device.type != "meta":
        return x[torch.arange(rows) % x.shape[0]]
    return x


def time_forward_backward(
    model: Callable[..., Any], batches: Sequence[tuple[Sequence[Any], Mapping[str, Any]]], *, repeat: int = 7,
    warmup: int = 3, clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Per batch (inputs, keyword inputs), the median seconds of ``model``'s forward (a module, or
    the stages a plan builds) and a backward from the sum of its float outputs. The batches take
    turns, round by round, so a burst of other work on the machine slows them alike.

    Raises:
        CalibrationError: the inputs are on ``meta`` (nothing to run), or the outputs need no gradient.
    """
    for inputs, kwargs in batches:
        if any(isinstance(x, torch.Tensor) and x.device.type == "meta" for x in (*inputs, *kwargs.values())):
            raise CalibrationError("the example inputs are on meta: fitting to the model needs real inputs and weights")
    times: list[list[float]] = [[] for _ in batches]
    for k in range(warmup + repeat):
        for i, (inputs, kwargs) in enumerate(batches):
            t0 = clock()
            out = model(*inputs, **kwargs)
            leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
                      and t.is_floating_point() and t.requires_grad]
            if not leaves:
                raise CalibrationError("the model's outputs need no gradient: nothing to time a backward of")
            sum(t.float().sum() for t in leaves).backward()  # type: ignore[union-attr]
            if k >= warmup:
                times[i].append(clock() - t0)
    if isinstance(model, nn.Module):
        model.zero_grad(set_to_none=True)
    return [statistics.median(t) for t in times]
