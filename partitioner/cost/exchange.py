"""What the data-parallel axis costs: where a ``dp x pp`` job's ranks sit, its collectives, the optimizer step.

Legend: ``N`` devices, ``dp`` replicas of the pipeline, ``pp`` ranks per pipeline, ``d`` a
replica, ``r`` a rank within a pipeline, ``n`` a collective's group size, ``B`` bytes.

Placement follows the runtime's ``("dp", "pp")`` mesh (``runtime.parallel.data_parallel``): global
rank ``d * pp + r``, so a pipeline's neighbours are consecutive ranks, and the ranks holding the
same stages (a "dp" group) are ``pp`` apart. Devices fill nodes of ``node_size`` in rank order.

The collectives are priced as rings, the way NCCL runs them at size and as nccl-tests reports
them (bus bandwidth): an all-reduce of ``B`` bytes over ``n`` ranks moves ``2 (n - 1) / n * B``
per rank in ``2 (n - 1)`` steps; a reduce (to one owner) and a broadcast each move
``(n - 1) / n * B`` in ``n - 1`` steps (ZeRO-1's reduce plus broadcast is one all-reduce's
traffic), and so do a reduce-scatter and an all-gather (the halves of an all-reduce, as FSDP
runs them). Buckets of ``bucket_bytes`` each pay the steps' latency. The bandwidth is the
cluster's measured ``collective_bandwidth`` when it has one, else the slowest link the ring
uses: the device's link inside a node, ``inter_node_bandwidth`` once the group spans nodes.

The optimizer step streams each parameter's training state through device memory once:
``OPTIMIZER_BYTES_PER_PARAM`` bytes (AdamW in fp32: read weight, gradient and two moments,
write weight and moments; the clipping norm reads the gradient again and scales it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from partitioner.cost.devices import Cluster

__all__ = [
    "OPTIMIZER_BYTES_PER_PARAM",
    "GRAD_BYTES_PER_PARAM",
    "WEIGHT_GRAD_BYTES_PER_PARAM",
    "GATHERED_BYTES_PER_PARAM",
    "DEFAULT_BUCKET_BYTES",
    "Collective",
    "collective",
    "pipeline_links",
    "allreduce_time",
    "reduce_time",
    "optimizer_time",
    "exchange_end",
]

OPTIMIZER_BYTES_PER_PARAM = 40.0  # AdamW (28) + clipping (read, scale: 12), fp32
GRAD_BYTES_PER_PARAM = 4.0  # gradients are reduced in fp32 (master weights are fp32 under autocast)
WEIGHT_GRAD_BYTES_PER_PARAM = 8.0  # of the training state, what every replica keeps whole: weight and gradient
# What FSDP all-gathers and holds gathered per parameter: the fp32 weights as they are stored (under
# autocast too; MixedPrecision(gather_low_precision=True) would halve it, and is not priced).
GATHERED_BYTES_PER_PARAM = 4.0

# DDP's default bucket: big enough to amortise a collective's latency, small enough to start early.
DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Collective:
    """How fast one "dp" group talks: ring bus bandwidth (bytes/s per rank) and latency per ring step.

    Example:
        >>> Collective(1e9, 1e-5).bandwidth
        1000000000.0
    """

    bandwidth: float
    latency: float


def _node(rank: int, node_size: int) -> int:
    return rank // node_size if node_size > 0 else 0


def collective(cluster: Cluster, dp: int, pp: int, r: int = 0) -> Collective:
    """The ring that rank ``r``'s "dp" group (global ranks ``r, pp + r, ...``) runs on.

    Example:
        >>> c = Cluster.uniform(64, "A100-80GB")
        >>> collective(c, 8, 8).bandwidth == c.devices[0].inter_node_bandwidth   # 8 apart: 8 nodes
        True
        >>> collective(c, 8, 1).bandwidth == c.devices[0].link_bandwidth         # one node
        True
    """
    dev = cluster.devices[0]
    if cluster.collective_bandwidth is not None:
        lat = cluster.collective_latency if cluster.collective_latency is not None else dev.link_latency
        return Collective(cluster.collective_bandwidth, lat)
    spans = _node(r, dev.node_size) != _node((dp - 1) * pp + r, dev.node_size)
    if spans:
        return Collective(dev.inter_node_bandwidth, dev.inter_node_latency)
    return Collective(dev.link_bandwidth, dev.link_latency)


def pipeline_links(cluster: Cluster, pp: int) -> Cluster:
    """The first pipeline's ``pp`` devices and links: a link between ranks on two nodes runs at
    ``inter_node_bandwidth`` (every replica's pipeline is placed alike, so the first stands for all).

    Example:
        >>> c = pipeline_links(Cluster.uniform(16, "H100-80GB"), 16)
        >>> c.link_bandwidth[6] == c.devices[0].link_bandwidth, c.link_bandwidth[7] == 50e9
        (True, True)
    """
    chain = cluster.with_devices(pp)
    dev = cluster.devices[0]
    if dev.node_size <= 0:
        return chain
    bws, lats = list(chain.link_bandwidth), list(chain.link_latency)
    for r in range(pp - 1):
        if _node(r, dev.node_size) != _node(r + 1, dev.node_size):
            bws[r] = min(bws[r], dev.inter_node_bandwidth)
            lats[r] = max(lats[r], dev.inter_node_latency)
    return replace(chain, link_bandwidth=tuple(bws), link_latency=tuple(lats))


def _buckets(nbytes: float, bucket_bytes: float) -> int:
    return max(1, math.ceil(nbytes / bucket_bytes)) if nbytes > 0 else 0


def allreduce_time(nbytes: float, n: int, ring: Collective, bucket_bytes: float = DEFAULT_BUCKET_BYTES) -> float:
    """Seconds to all-reduce ``nbytes`` over ``n`` ranks in buckets of ``bucket_bytes``.

    Example:
        >>> allreduce_time(1e9, 4, Collective(1e9, 0.0))   # 2 (n - 1) / n * B / bw
        1.5
        >>> allreduce_time(1e9, 1, Collective(1e9, 1.0))
        0.0
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (n - 1)
    return steps / n * nbytes / ring.bandwidth + _buckets(nbytes, bucket_bytes) * steps * ring.latency


def reduce_time(nbytes: float, n: int, ring: Collective, bucket_bytes: float = DEFAULT_BUCKET_BYTES) -> float:
    """Seconds to reduce ``nbytes`` to one owner (or broadcast them from it), or to reduce-scatter
    (or all-gather) them: half an all-reduce.

    Example:
        >>> reduce_time(1e9, 4, Collective(1e9, 0.0))
        0.75
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    steps = n - 1
    return steps / n * nbytes / ring.bandwidth + _buckets(nbytes, bucket_bytes) * steps * ring.latency


def optimizer_time(params: float, mem_bandwidth: float) -> float:
    """Seconds of one optimizer step (with clipping) over ``params`` elements: memory bound.

    Example:
        >>> optimizer_time(1e9, 2e12)
        0.02
    """
    return params * OPTIMIZER_BYTES_PER_PARAM / mem_bandwidth


def exchange_end(
    ready: Sequence[float], cost: Sequence[float], stage_to_rank: Sequence[int], num_ranks: int
) -> tuple[float, ...]:
    """Per rank, when its gradient exchange is over, if each stage's leaves once its gradients are ready.

    ``ready[s]``: when stage ``s``'s last backward action ends (``Simulation.grads_ready``);
    ``cost[s]``: its exchange's seconds. A rank's collectives run one after another (one "dp"
    process group per rank), in the order its stages become ready; the drain of the pipeline
    runs meanwhile, so only what is left after the rank's compute shows in the step.

    Example:
        >>> exchange_end([3.0, 1.0], [1.0, 5.0], [0, 0], 1)   # stage 1 first: 1 + 5, then 6 + 1
        (7.0,)
    """
    ends = [0.0] * num_ranks
    for s in sorted(range(len(ready)), key=lambda s: (ready[s], s)):
        r = stage_to_rank[s]
        ends[r] = max(ends[r], ready[s]) + cost[s]
    return tuple(ends)
