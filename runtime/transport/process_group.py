"""The process group a distributed trainer runs in: which transport, which backend, which device."""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from runtime.errors import TransportOptionError

__all__ = ["resolve_mode", "ensure_process_group", "default_device", "comm_device", "world_split"]

log = logging.getLogger(__name__)


def resolve_mode(transport: str) -> str:
    """The transport a trainer uses: ``'dist'`` when launched by torchrun (or a process group is
    up), else ``'local'``, for ``transport='auto'``; a named one as is."""
    if transport not in ("auto", "local", "sequential", "dist"):
        raise TransportOptionError(f"transport must be 'auto', 'local', 'sequential' or 'dist', got {transport!r}")
    if transport != "auto":
        return transport
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return "dist" if dist.is_initialized() or launched else "local"


def ensure_process_group(timeout: float | None = None) -> None:
    """Join the job's process group (NCCL with GPUs, on ``LOCAL_RANK``'s device; else gloo).

    Args:
        timeout: seconds any collective of the group may wait (``init_process_group``'s
            ``timeout``); default torch's own (10 minutes for NCCL, 30 for gloo). A group
            already joined is kept as it is.
    """
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if timeout is None:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    log.info("initialised torch.distributed with %s, rank %d of %d", backend, dist.get_rank(), dist.get_world_size())


def default_device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def comm_device() -> torch.device:
    """Where collectives' buffers live: the rank's GPU under NCCL, else the CPU."""
    return default_device() if dist.is_initialized() else torch.device("cpu")


def world_split(world: int, pp: int | None, dp: int | None) -> tuple[int, int]:
    """``--pp`` and ``--dp`` of a job of ``world`` processes, either or both left out (``None``).

    In one process a missing count is 1; under torchrun a missing one is the world over the
    other (both missing: one pipeline of every process). A count that cannot be comes back as 0
    (the world is not a multiple of the other), and the caller refuses ``pp x dp != world`` with
    its own message.

    Example:
        >>> world_split(4, 2, None), world_split(4, None, None), world_split(6, None, 4), world_split(1, 2, None)
        ((2, 2), (4, 1), (0, 4), (2, 1))
    """
    if world == 1:
        return pp or 1, dp or 1
    if pp is None and dp is None:
        return world, 1
    if pp is None:
        assert dp is not None  # internal invariant
        return (world // dp if world % dp == 0 else 0), dp
    if dp is None:
        return pp, (world // pp if world % pp == 0 else 0)
    return pp, dp
