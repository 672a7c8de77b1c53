"""The process group a distributed trainer runs in: which transport, which backend, which device."""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from runtime.errors import TransportOptionError

__all__ = ["resolve_mode", "ensure_process_group", "default_device", "comm_device"]

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
