"""Gradient-norm clipping over every stage of a pipeline, as if the model were one.

``torch.nn.utils.clip_grad_norm_`` on the unpartitioned model computes one norm over all
gradients and scales them all by ``max_norm / norm`` when that is below 1. Here each process
holds some stages: it sums ``|g|^p`` over the gradients it holds (the maximum for ``p = inf``),
the processes add (or take the maximum of) their partial sums, and every process scales its own
gradients by the same factor. A tied parameter, held by several stages, counts once: on the
process holding its first stage, and there in its first copy. Under FSDP
(``runtime.parallel.fsdp``) a gradient is a ``DTensor`` shard: each process counts its own
shard, the sum runs over the whole job, and each scales its shard. Under tensor parallelism
(``runtime.parallel.tensor``) a stage's split weights are ``DTensor`` shards over its tp group and
its other weights are whole and identical on every tp rank: each rank counts its shards, a whole
gradient is counted on the group's first rank only, and the partial sums add over the tp group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence

import torch
import torch.distributed as dist
from torch import nn

from runtime.transport.collective import run_bounded

__all__ = ["clip_grad_norm_", "local_shard"]


def clip_grad_norm_(
    params: Sequence[nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    counted: Collection[int] | None = None,
    distributed: bool = False,
    comm_device: Callable[[], torch.device] | None = None,
    group: dist.ProcessGroup | None = None,
    tp_group: dist.ProcessGroup | None = None,
    timeout: float = 1800.0,
) -> torch.Tensor:
    """Clip the gradients of ``params`` to a total norm taken over every process.

    Args:
        params: this process's parameters (every copy: all are scaled).
        max_norm: the largest total norm kept.
        norm_type: ``p`` of the p-norm; ``float('inf')`` for the largest entry.
        counted: ids of the parameters whose gradients enter the norm (default: all); leave
            out second copies of a tied weight.
        distributed: reduce the partial sums over ``group``.
        comm_device: where that reduction runs (the rank's GPU on NCCL).
        group: the ranks holding the rest of the model (default: the world). With data
            parallelism, one pipeline's ranks: after the gradients are averaged every replica
            holds the same ones, so counting other replicas would count them again.
        tp_group: the tensor-parallel group of this process's stages, if any: a gradient that is
            not a sharded ``DTensor`` (a whole weight, plain or ``Replicate``, the same on every tp
            rank) is counted on its first rank only, and the partial sums are reduced over it before ``group`` (not when
            ``group`` is the world, which holds it).
        timeout: seconds the reduction may wait (the trainer's ``timeout``; default torch's 30 minutes).

    Returns:
        The total norm (fp32 scalar on the CPU), before clipping.

    Raises:
        TransportTimeout: the reduction did not complete within ``timeout`` (``PeerFailed`` /
            ``PeerGone`` when a peer failed or its process is gone).

    Example:
        >>> w = nn.Parameter(torch.ones(4)); w.grad = torch.full((4,), 3.0)
        >>> float(clip_grad_norm_([w], max_norm=1.0)), round(w.grad[0].item(), 4)  # 3 x 1/6
        (6.0, 0.5)
    """
    whole_here = tp_group is None or dist.get_rank(tp_group) == 0
    grads = [local_shard(p.grad) for p in params if p.grad is not None and (counted is None or id(p) in counted)
             and (whole_here or _is_shard(p.grad))]
    p = float(norm_type)
    if p == math.inf:
        partial = max((g.detach().abs().max().float().cpu() for g in grads), default=torch.zeros(()))
    else:
        partial = sum((g.detach().float().abs().pow(p).sum().cpu() for g in grads), torch.zeros(()))
    total = torch.as_tensor(partial, dtype=torch.float32)
    if distributed:
        buf = total.to(comm_device() if comm_device is not None else torch.device("cpu"))
        op = dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM
        # The tp shards first, then the stages: two scalars, where one group of both would be one
        # more process group per replica to build.
        for over in ([tp_group] if tp_group is not None and group is not None else []) + [group]:
            run_bounded(dist.all_reduce, buf, op=op, group=over, timeout=timeout,
                        what=f"the all-reduce of the gradient norm (max_norm={max_norm:g})")
        total = buf.cpu()
    norm = total if p == math.inf else total.pow(1.0 / p)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as torch: the same epsilon
    for prm in params:
        if prm.grad is not None:
            g = local_shard(prm.grad)
            g.mul_(coef.to(g.device, g.dtype))
    return norm


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor (a gradient, a parameter): a ``DTensor``'s local shard (the
    same storage), else itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _is_shard(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` sharded on some mesh dim (its own process's part of a tensor);
    a replicated one is whole. Read without importing DTensor. A packed layer's weight is a
    ``_StridedShard`` (a slice of each of its parts), which is no ``Shard``: it has a split factor."""
    return any(pl.is_shard() or hasattr(pl, "split_factor") for pl in getattr(t, "placements", ()))
