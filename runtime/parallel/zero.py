"""ZeRO-style sharding over data-parallel replicas: each rank keeps the optimizer state (and,
after the reduction, the gradients) of its share of the parameters only.

Legend: ``dp`` replicas, ``d`` a rank's index among them. Replicas hold the same stages, so
their optimizers would all keep the same state: Adam's two moments are 8 of the 16 bytes per
parameter a mixed fp32 run holds. Here every parameter has one owner among the ``dp`` ranks
holding it (whole parameters, balanced by size, as ``torch.distributed.optim.
ZeroRedundancyOptimizer`` does), and:

1. its gradient is *reduced* to the owner (not all-reduced): the others drop theirs;
2. the gradient norm for clipping is summed over every rank of the job (each counts what it owns);
3. only the owner's optimizer holds and updates it;
4. the owner broadcasts the new values to the replicas (:func:`broadcast_from_owners`).

Reduce plus broadcast moves the bytes an all-reduce does, so the step costs no more traffic,
and the optimizer state per rank falls to ``1 / dp`` (ZeRO-1); gradients are freed on
non-owners after the reduction (ZeRO-2's saving after the step; during backward every rank
still accumulates full gradients, as pipelining needs). Whole parameters keep the optimizer's
per-parameter state and its checkpoint entries keyed by name, so a checkpoint saved sharded
loads unsharded, under any ``dp`` or plan, and the other way round.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from runtime.parallel.clipping import local_shard
from runtime.transport.collective import wait_bounded
from runtime.transport.placement import PlacementError

__all__ = ["assign_owners", "broadcast_from_owners"]


def assign_owners(sizes: Sequence[int], dp: int) -> list[int]:
    """An owner in ``range(dp)`` for each parameter of ``sizes`` (element counts), balanced:
    largest first, each to the least-loaded owner (ties: the lowest index). Deterministic, so
    every replica computes the same map.

    The largest load exceeds the mean by at most one parameter's size (the classic bound of
    longest-processing-time-first).

    Example:
        >>> assign_owners([10, 7, 5, 4, 1], 2)
        [0, 1, 1, 0, 1]
    """
    if dp < 1:
        raise PlacementError(f"dp must be >= 1, got {dp}")
    owners = [0] * len(sizes)
    loads = [(0, d) for d in range(dp)]
    heapq.heapify(loads)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, d = heapq.heappop(loads)
        owners[i] = d
        heapq.heappush(loads, (load + sizes[i], d))
    return owners


def broadcast_from_owners(
    params: Sequence[nn.Parameter],
    owners: Sequence[int],
    group: dist.ProcessGroup | None,
    group_ranks: Sequence[int],
    *,
    comm_device: Callable[[], torch.device] | None = None,
    bucket_bytes: int = 25 * 2**20,
    timeout: float = 1800.0,
) -> None:
    """Give every rank of ``group`` the owners' values of ``params`` (after the owners' step).

    Args:
        params: this rank's parameters, in the same order on every rank of the group.
        owners: each parameter's owner index in the group.
        group: the data-parallel group.
        group_ranks: the global rank of each index.
        comm_device: where the flat buckets travel (the rank's GPU on NCCL).
        bucket_bytes: the bucket size.
        timeout: seconds each bucket's broadcast may wait (the trainer's ``timeout``; default
            torch's 30 minutes).

    Raises:
        TransportTimeout: a broadcast did not complete within ``timeout`` (``PeerFailed`` /
            ``PeerGone`` when a peer failed or its process is gone).
    """
    device = comm_device() if comm_device is not None else torch.device("cpu")
    buckets: dict[tuple[int, torch.dtype], list[list[torch.Tensor]]] = {}
    filled: dict[tuple[int, torch.dtype], int] = {}  # bytes in each key's last chunk
    # A tensor-parallel shard (DTensor) travels as its local part (its storage, taken without
    # autograd): each tp rank has its own dp group.
    with torch.no_grad():
        locals_ = [local_shard(p) for p in params]
    for p, d in zip(locals_, owners):
        key, size = (d, p.dtype), p.numel() * p.element_size()
        chunks = buckets.setdefault(key, [[]])
        if chunks[-1] and filled[key] + size > bucket_bytes:
            chunks.append([])
            filled[key] = 0
        chunks[-1].append(p)
        filled[key] = filled.get(key, 0) + size
    sent = []
    with torch.no_grad():
        for (d, _), chunks in buckets.items():
            for chunk in chunks:
                flat = torch.cat([p.detach().reshape(-1) for p in chunk]).to(device)
                work = dist.broadcast(flat, src=group_ranks[d], group=group, async_op=True)
                sent.append((d, chunk, flat, work))
        for (d, chunk, flat, work) in sent:
            wait_bounded(work, timeout=timeout, group=list(group_ranks),
                         what=f"ZeRO's broadcast of {len(chunk)} updated parameters from their owner, rank "
                              f"{group_ranks[d]}, over ranks {list(group_ranks)}")
            offset = 0
            for p in chunk:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
