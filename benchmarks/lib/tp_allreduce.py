"""``layout.py --tp``: the tensor-parallel all-reduce the planner prices, timed on the job's own tp groups.

Legend: ``tp`` ranks in a tensor-parallel group, ``b`` rows per micro-batch, ``T`` the sequence
length, ``C`` the hidden size.

A tp layout runs, per block and micro-batch, two all-reduces of one ``(b, T, C)`` activation forward
and two of its gradient backward (Megatron's count). The planner prices each as one all-reduce on
the cluster's collective (``partitioner.cost.exchange.collective(cluster, tp, 1)`` and
``allreduce_time``: ``2 (tp - 1) / tp * S / bandwidth + 2 (tp - 1) * latency``), whose bandwidth and
per-step latency a calibration fits to a 4-rank all-reduce of 1 KiB to 16 MiB. :func:`measure`
times that all-reduce where the layouts run it: on a tp group while the job's other tp groups run
theirs (every rank calls it at once), at each micro-batch size's ``S = 4 b T C`` bytes;
:func:`priced` is the planner's figure for the same bytes, so the two can be set side by side.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from partitioner import Cluster
from partitioner.cost.exchange import allreduce_time, collective

__all__ = ["activation_bytes", "measure", "priced"]


def activation_bytes(microbatch_sizes: Sequence[int], seq: int, hidden: int) -> list[int]:
    """``4 b T C``: one fp32 ``(b, T, C)`` activation per micro-batch size, the tp all-reduce's message.

    Example:
        >>> activation_bytes([1, 2], 64, 128)
        [32768, 65536]
    """
    return [4 * b * seq * hidden for b in microbatch_sizes]


def measure(group: Any, sizes: Sequence[int], *, repeat: int = 30) -> dict[int, float]:
    """Median seconds of one fp32 all-reduce of each of ``sizes`` bytes over ``group`` (collective:
    every rank of the job calls it, so the job's tp groups all-reduce at once, as in a step).

    A barrier over the world before each, so the groups start together; the first two of each size
    are not timed (gloo's buffers, the caches).
    """
    out = {}
    for size in sizes:
        buf = torch.ones(size // 4)
        runs = []
        for i in range(repeat + 2):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=group)
            if i >= 2:
                runs.append(time.perf_counter() - t0)
        out[size] = statistics.median(runs)
    return out


def priced(cluster: Cluster, tp: int, sizes: Sequence[int]) -> dict[int, float]:
    """The planner's seconds for one all-reduce of each of ``sizes`` bytes over a tp group of ``cluster``.

    Example:
        >>> c = Cluster.uniform(4, "cpu")
        >>> p = priced(c, 2, [65536])
        >>> p[65536] == allreduce_time(65536, 2, collective(c, 2, 1), bucket_bytes=65536)
        True
    """
    ring = collective(cluster, tp, 1)  # a tp group: consecutive devices inside one node
    return {s: allreduce_time(float(s), tp, ring, bucket_bytes=float(s)) for s in sizes}
