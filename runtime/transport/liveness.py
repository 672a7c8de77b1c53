"""Which ranks of a job are gone: each rank records its host and process id in the job's store
when it joins, and a rank whose wait failed early checks its peers' processes by those records.

gloo reports a peer's death as ``Connection closed by peer [127.0.0.1]:41235``: an address, not a
rank. The record turns that into a rank: a peer on this host whose process has exited (or is a
zombie) is gone. A peer on another host cannot be checked this way; it is reported as unknown
and the caller keeps its general message.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["register", "gone", "Gone"]

log = logging.getLogger(__name__)

_KEY = "pipecut/alive/{rank}"


@dataclass(frozen=True)
class Gone:
    """A rank whose process has exited: its global ``rank``, ``pid`` and ``host``."""

    rank: int
    pid: int
    host: str

    def __str__(self) -> str:
        return f"rank {self.rank} (process {self.pid} on {self.host})"


def register() -> None:
    """Record this rank's host and process id in the job's store (idempotent; a no-op without a
    process group or a store)."""
    store = default_store()
    if store is None:
        return
    try:
        store.set(_KEY.format(rank=dist.get_rank()), f"{socket.gethostname()} {os.getpid()}")
    except Exception:
        log.debug("could not record rank %d's process in the store", dist.get_rank(), exc_info=True)


def gone(ranks: Sequence[int], *, settle: float = 1.0) -> list[Gone]:
    """The ranks among ``ranks`` (global) whose process on this host has exited.

    A connection closes while its process exits, a moment before the process is gone, so the
    check is repeated for up to ``settle`` seconds until some rank is found gone.

    Example:
        >>> gone([])
        []
    """
    records = [r for r in (_record(rank) for rank in ranks) if r is not None]
    here = socket.gethostname()
    local = [r for r in records if r.host == here and r.pid != os.getpid()]
    deadline = time.monotonic() + settle
    while True:
        dead = [r for r in local if not _alive(r.pid)]
        if dead or not local or time.monotonic() >= deadline:
            return dead
        time.sleep(0.05)


def _record(rank: int) -> Gone | None:
    """What ``rank`` registered, as a ``Gone`` to be (its host and pid), or ``None``."""
    store = default_store()
    if store is None:
        return None
    key = _KEY.format(rank=rank)
    try:
        if not store.check([key]):  # never blocks, unlike get on a missing key
            return None
        host, pid = store.get(key).decode().rsplit(" ", 1)
        return Gone(rank, int(pid), host)
    except Exception:  # the store itself may be gone with the rank that hosted it
        return None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and is not a zombie (exited, not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (macOS): os.kill said it exists
    return state not in ("Z", "X")


def default_store() -> Any:  # a torch.distributed.Store (compare_set, check, get), or None
    """The default process group's store (torchrun's TCPStore, a FileStore...), or ``None``."""
    # Private in torch, hence the guard, as runtime.transport.p2p reads it.
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None or not dist.is_initialized():
        return None
    try:
        return get()
    except Exception:
        return None
