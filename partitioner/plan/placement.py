"""Where a plan's stages sit: the cluster one stage per entry sees, with several stages per device.

Legend: ``S`` stages, ``v`` stages per device (2 for interleaved and ZB-V), ``p = S / v`` devices.
"""

from __future__ import annotations

from dataclasses import replace

from partitioner.cost.devices import Cluster
from partitioner.errors import PartitionOptionError
from partitioner.schedule.registry import stage_schedule, stages_per_rank

__all__ = ["stage_cluster", "per_stage_capacity"]


def stage_cluster(cluster: Cluster | None, stages: int, schedule: str) -> Cluster:
    """One entry per stage: a stage's device and the link to the next stage's device.

    With several stages per device (interleaved, ZB-V), stage ``s`` runs on the device of its
    rank; consecutive stages on one device get a free link; others the slower of the links.
    """
    v = stages_per_rank(schedule)
    if stages % v:
        raise PartitionOptionError(
            f"schedule {schedule!r} places {v} stages on every device: ask for a multiple of {v} "
            f"stages (got {stages})"
        )
    ranks = stages // v
    if cluster is None:
        cluster = Cluster.uniform(ranks, "cpu")
    if len(cluster) < ranks:
        raise PartitionOptionError(
            f"the cluster has {len(cluster)} devices but {stages} stages need {ranks} "
            f"({v} per device for {schedule!r}); give one device per rank"
        )
    cluster = cluster.with_devices(ranks)
    if v == 1:
        return cluster
    to_rank = stage_schedule(schedule, stages, max(ranks, 1)).stage_to_rank
    slow_bw = min(cluster.link_bandwidth, default=float("inf"))
    slow_lat = max(cluster.link_latency, default=0.0)
    bws, lats = [], []
    for s in range(stages - 1):
        a, b = to_rank[s], to_rank[s + 1]
        if a == b:
            bws.append(float("inf"))
            lats.append(0.0)
        elif abs(a - b) == 1:
            bws.append(cluster.link_bandwidth[min(a, b)])
            lats.append(cluster.link_latency[min(a, b)])
        else:  # the wrap-around of a round-robin placement: no direct link in a chain
            bws.append(slow_bw)
            lats.append(slow_lat)
    return Cluster(tuple(cluster.devices[r] for r in to_rank), tuple(bws), tuple(lats), calibrated=cluster.calibrated)


def per_stage_capacity(cluster: Cluster, schedule: str) -> Cluster:
    """The cluster the Problem sees: with ``v`` stages per device each gets 1/v of its memory."""
    v = stages_per_rank(schedule)
    if v == 1:
        return cluster
    devices = tuple(replace(d, memory=d.memory / v, memory_reserve=d.memory_reserve / v) for d in cluster.devices)
    return replace(cluster, devices=devices)
