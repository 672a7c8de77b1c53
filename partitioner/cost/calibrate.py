"""Calibration: what this host's processes really get -- matmul FLOP/s at the model's sizes, memory
bandwidth, per-op overhead, and the backend's p2p and all-reduce speed -- for ``Cluster.measure``.

The preset ``"cpu"`` is a guess; a calibrated cluster is measured. The compute probes
(``partitioner.cost.probes``) run in every one of ``processes`` spawned processes *at once* (one
thread each, as pipeline ranks run), so cores shared by several ranks show up as the lower speed
each rank gets. Links are measured between those same processes over the backend in use (gloo on
loopback): a ping-pong between ranks 0 and 1 for the pipeline's p2p sends, an all-reduce over the
first ``devices`` ranks for the data-parallel collectives. Every speed is a least-squares fit of
``time = latency + bytes / bandwidth`` over several sizes (``probes.fit_linear``), on the median
time of each size: what a rank typically gets, scheduler delays of a busy machine included.
"""

from __future__ import annotations

import logging
import os
import pickle
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException, start_processes

from partitioner.cost.probes import ComputeSpeed, LinearFit, Probe, allreduce, measure_compute, pingpong
from partitioner.errors import CalibrationError, ClusterError

__all__ = ["Calibration", "measure", "combine"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Calibration:
    """A measurement of this host: what each rank's compute got, and the links between ranks.

    ``p2p`` is ``None`` with one device, ``allreduce`` too. ``Cluster.from_calibration`` turns it
    into the cluster the planner reads (this module stays below ``devices``: it builds no cluster).

    Example:
        >>> from partitioner.cost.devices import Cluster
        >>> speed = ComputeSpeed({"float32": 8e10}, LinearFit(0.0, 2e10), 5e-6)
        >>> cal = Calibration(2, 2, "gloo", speed, LinearFit(1e-4, 2e9), LinearFit(3e-5, 1e9), wall_s=1.0)
        >>> Cluster.from_calibration(cal).collective_bandwidth
        1000000000.0
    """

    devices: int
    processes: int
    backend: str
    compute: ComputeSpeed
    p2p: LinearFit | None
    allreduce: LinearFit | None
    wall_s: float
    details: Mapping[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """Plain JSON-ready numbers (saved beside the cluster by ``Cluster.save(details=...)``)."""
        out: dict[str, Any] = {
            "devices": self.devices, "processes": self.processes, "backend": self.backend,
            "flops": dict(self.compute.flops), "mem_bandwidth": self.compute.memory.bandwidth,
            "elementwise_latency": self.compute.memory.latency, "op_overhead": self.compute.op_overhead,
            "wall_s": self.wall_s, "torch": torch.__version__, "cpus": os.cpu_count(),
        }
        for name, fit in (("p2p", self.p2p), ("allreduce", self.allreduce)):
            if fit is not None:
                out[name] = {"bandwidth": fit.bandwidth, "latency": fit.latency}
        return {**out, **self.details}


def measure(
    devices: int = 1,
    *,
    backend: str = "gloo",
    processes: int | None = None,
    probe: Probe | None = None,
    threads: int = 1,
    timeout: float = 120.0,
) -> Calibration:
    """Measure this host as ``processes`` ranks of ``threads`` threads each see it.

    Spawns ``max(devices, processes)`` processes joined by ``backend`` (file rendezvous in a fresh
    temporary folder). The first ``processes`` time the compute probes at once; then ranks 0 and 1
    ping-pong each message size (one-way time = round trip / 2) and the first ``devices`` ranks
    all-reduce each size. Every process is joined by ``timeout`` and killed past it.

    Args:
        devices: the pipeline's devices (ranks that talk).
        backend: the torch.distributed backend; only ``"gloo"`` (CPU) is measured today.
        processes: ranks computing at the same time (default ``devices``): 4 ranks on 2 cores
            each get about half a core.
        probe: sizes and repeats (default :class:`Probe`; ``Probe.tiny()`` for a quick look).
        threads: ``torch.set_num_threads`` in every process.
        timeout: seconds for the whole measurement.

    Raises:
        ClusterError: ``devices``, ``processes`` or ``threads`` below 1, or another backend.
        CalibrationError: a process failed (its traceback in the message) or ran past ``timeout``.

    Example:
        >>> cal = measure(2, probe=Probe.tiny())  # doctest: +SKIP
        >>> Cluster.from_calibration(cal).collective_bandwidth > 0  # doctest: +SKIP
        True
    """
    processes = devices if processes is None else processes
    if min(devices, processes, threads) < 1:
        raise ClusterError(f"devices, processes and threads must be at least 1, got {devices}, {processes}, {threads}")
    if backend != "gloo":
        raise ClusterError(
            f"calibration measures CPU processes over gloo, got backend {backend!r}; for GPUs, set "
            "Cluster(collective_bandwidth=..., collective_latency=...) from nccl-tests' busbw"
        )
    probe = probe or Probe()
    world = max(devices, processes)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pipecut-calibrate-") as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        args = (world, devices, processes, backend, init, probe, threads, timeout, tmp)
        _run_all(args, world, timeout)
        results = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    compute = combine([c for c, _, _ in results if c is not None])
    _, p2p, allreduce = results[0]
    cal = Calibration(devices, processes, backend, compute, p2p, allreduce, time.perf_counter() - t0)
    log.info("measured %s", cal.summary())  # Cluster.from_calibration(cal) is the cluster
    return cal


def combine(speeds: Sequence[ComputeSpeed]) -> ComputeSpeed:
    """One rank's speed from what several ranks measured at once: the median of each number.

    Example:
        >>> a = ComputeSpeed({"float32": 1e10}, LinearFit(0.0, 1e9), 1e-5)
        >>> b = ComputeSpeed({"float32": 3e10}, LinearFit(2e-6, 3e9), 3e-5)
        >>> combine([a, b]).flops, combine([a, b]).op_overhead
        ({'float32': 20000000000.0}, 2e-05)
    """
    if not speeds:
        raise CalibrationError("no compute measurements to combine; measure with processes >= 1")
    return ComputeSpeed(
        flops={d: statistics.median(s.flops[d] for s in speeds) for d in speeds[0].flops},
        memory=LinearFit(
            latency=statistics.median(s.memory.latency for s in speeds),
            bandwidth=statistics.median(s.memory.bandwidth for s in speeds),
        ),
        op_overhead=statistics.median(s.op_overhead for s in speeds),
    )


def _run_all(args: tuple[Any, ...], world: int, timeout: float) -> None:
    """Start ``world`` workers, join them by ``timeout``, and kill any left (never hang)."""
    ctx = start_processes(_worker, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=0.2):
            if time.monotonic() > deadline:
                done = [i for i, p in enumerate(ctx.processes) if not p.is_alive()]
                raise CalibrationError(
                    f"calibration of {world} processes did not finish within {timeout:.0f} s "
                    f"(finished: {done}); pass a larger timeout, smaller Probe sizes, or check the load"
                )
    except (ProcessRaisedException, ProcessExitedException) as e:
        raise CalibrationError(f"a calibration process failed (rank {e.error_index}): {e}") from e
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()


def _worker(
    rank: int, world: int, devices: int, processes: int, backend: str, init: str, probe: Probe,
    threads: int, timeout: float, outdir: str,
) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    try:
        dist.barrier()
        compute = measure_compute(probe) if rank < processes else None
        dist.barrier()
        p2p = pingpong(rank, probe) if devices >= 2 and rank < 2 else None
        dist.barrier()
        # new_group is collective: every rank calls it, members or not.
        group = dist.new_group(list(range(devices))) if 2 <= devices < world else None
        reduced = allreduce(devices, group, probe) if devices >= 2 and rank < devices else None
        with open(os.path.join(outdir, f"rank{rank}.pkl.tmp"), "wb") as f:
            pickle.dump((compute, p2p, reduced), f)
        os.replace(os.path.join(outdir, f"rank{rank}.pkl.tmp"), os.path.join(outdir, f"rank{rank}.pkl"))
        # The last sync goes through the files, not a gloo barrier: a rank leaving a barrier may
        # still have its own barrier message queued, and closing its sockets then resets the peers'.
        deadline = time.monotonic() + timeout
        while not all(os.path.exists(os.path.join(outdir, f"rank{r}.pkl")) for r in range(world)):
            if time.monotonic() > deadline:
                raise CalibrationError(f"rank {rank}: the other ranks did not finish within {timeout:.0f} s")
            time.sleep(0.01)
    finally:
        dist.destroy_process_group()

