"""Collectives with a deadline: an asynchronous collective waited at most the trainer's ``timeout``.

A blocking ``dist.all_reduce`` waits as long as the process group lets it (30 minutes under
torchrun), however short the trainer's ``timeout``; a rank that died makes it fail with gloo's
bare ``RuntimeError``. The gradient exchanges of a step (data-parallel buckets, the sum of tied
weights' gradients) and the ranks' agreement check post theirs with ``async_op=True`` and wait
here instead, so each ends within ``timeout`` with the transport's typed errors: ``PeerFailed``
when a peer failed or exited (quoting the first failing rank's announced error,
``runtime.transport.p2p.DistTransport.announce``), ``TransportTimeout`` when it did not arrive.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from runtime.transport.p2p import _TIMED_OUT, PeerFailed, TransportTimeout, _reason, announced_failure

__all__ = ["wait_bounded", "group_ranks"]


def wait_bounded(work: Any, *, timeout: float, what: str, peers: str = "another rank") -> None:
    """Wait for an asynchronous collective's ``work`` at most ``timeout`` seconds.

    Args:
        work: what ``dist.all_reduce(..., async_op=True)`` (or another collective) returned;
            ``None`` (no collective was needed) returns at once.
        timeout: seconds to wait.
        what: the collective, for messages (``"the all-reduce of tied weights' gradients with
            ranks [0, 1]"``).
        peers: who may have failed when it ends early (``"a rank of another replica"``).

    Raises:
        PeerFailed: the collective failed before the timeout: a peer failed or exited.
        TransportTimeout: it did not complete within ``timeout``: a peer is stuck, slow, or never
            called it.
    """
    if work is None:
        return
    me = dist.get_rank()
    start = time.monotonic()
    try:
        ok = work.wait(timedelta(seconds=timeout))
    except RuntimeError as e:
        elapsed = time.monotonic() - start
        # gloo reports a wait that ran out of time as a RuntimeError too: tell it by its text
        # and by the time waited, as the point-to-point transport does.
        if _TIMED_OUT.search(str(e)) is None and elapsed < 0.95 * timeout:
            first = announced_failure(me)
            raise PeerFailed(
                f"rank {me}: {what} failed after {elapsed:.1f} s ({_reason(e)}), before the {timeout:g} s "
                f"timeout; {peers} failed or exited, and its own error is the cause to read"
                + (f"\n  The first rank to fail reported: {first}" if first else "")
            ) from e
        raise _late(me, what, timeout) from e
    if ok is False:
        raise _late(me, what, timeout)


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` (``None``: the world), for messages."""
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _late(me: int, what: str, timeout: float) -> TransportTimeout:
    first = announced_failure(me)
    return TransportTimeout(
        f"rank {me}: {what} did not complete within {timeout:g} s (the timeout); a rank is stuck or slow, "
        "or never reached it (it failed, or runs other code there); raise timeout= if a rank is just slow"
        + (f"\n  The first rank to fail reported: {first}" if first else "")
    )
