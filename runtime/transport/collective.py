"""Collectives with a deadline: an asynchronous collective waited at most the trainer's ``timeout``.

A blocking ``dist.all_reduce`` waits as long as the process group lets it (30 minutes under
torchrun), however short the trainer's ``timeout``; a rank that died makes it fail with gloo's
bare ``RuntimeError``. Every collective of a step (the loss broadcast, the gradient exchanges,
the clipping and fp16 all-reduces, ZeRO's broadcast, the ranks' agreement check) is posted with
``async_op=True`` (:func:`run_bounded`) and waited here instead, so each ends within ``timeout``
with the transport's typed errors: ``PeerGone`` when a peer's process is gone (one line naming
it, ``runtime.transport.liveness``), ``PeerFailed`` when a peer failed or exited otherwise
(quoting the first failing rank's announced error, ``runtime.transport.p2p.DistTransport.announce``),
``TransportTimeout`` when it did not arrive.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from runtime.transport.p2p import _TIMED_OUT, PeerFailed, TransportTimeout, _reason, announced_failure, gone_error

__all__ = ["run_bounded", "wait_bounded", "group_ranks"]


def run_bounded(
    collective: Callable[..., Any], /, *args: Any, timeout: float, what: str, group: dist.ProcessGroup | None = None,
    **kwargs: Any,
) -> None:
    """Run ``collective`` (``dist.all_reduce``, ``dist.broadcast``, ``dist.barrier``...) on
    ``group`` and wait for it at most ``timeout`` seconds.

    Args:
        collective: a ``torch.distributed`` collective that takes ``async_op``.
        args: its positional arguments (the tensor).
        timeout: seconds to wait (the trainer's ``timeout``).
        what: the collective, for messages (``"the broadcast of the loss from rank 1"``); the
            group's ranks are added.
        group: the process group (``None``: the world).
        kwargs: its other keyword arguments (``op=``, ``src=``).

    Raises:
        PeerGone, PeerFailed, TransportTimeout: as :func:`wait_bounded`.

    Example:
        >>> t = torch.ones(1)  # doctest: +SKIP
        >>> run_bounded(dist.all_reduce, t, timeout=30, what="the sum of the norms")  # doctest: +SKIP
    """
    ranks = group_ranks(group)
    work = collective(*args, group=group, async_op=True, **kwargs)
    wait_bounded(work, timeout=timeout, what=f"{what} over ranks {ranks}", group=ranks)


def wait_bounded(
    work: Any, *, timeout: float, what: str, peers: str = "another rank", group: list[int] | None = None,
) -> None:
    """Wait for an asynchronous collective's ``work`` at most ``timeout`` seconds.

    Args:
        work: what ``dist.all_reduce(..., async_op=True)`` (or another collective) returned;
            ``None`` (no collective was needed) returns at once.
        timeout: seconds to wait.
        what: the collective, for messages (``"the all-reduce of tied weights' gradients with
            ranks [0, 1]"``).
        peers: who may have failed when it ends early (``"a rank of another replica"``).
        group: the global ranks of the collective's group, checked for a rank that is gone when
            it fails early (default: the world).

    Raises:
        PeerGone: the collective failed before the timeout and a peer's process is gone.
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
            if group is None and dist.is_initialized():
                group = group_ranks(None)
            named = gone_error(me, what, elapsed, group or [])
            if named is not None:
                raise named from None  # one line: gloo's text says no more than that
            first = announced_failure(me)
            raise PeerFailed(
                f"rank {me}: {what} failed after {elapsed:.1f} s ({_reason(e)}), before the {timeout:g} s "
                f"timeout; {peers} failed or exited, and its own error is the cause to read"
                + (f"\n  The first rank to fail reported: {first}" if first else "")
            ) from e
        raise _late(me, what, timeout, time.monotonic() - start) from e
    if ok is False:
        raise _late(me, what, timeout, time.monotonic() - start)


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` (``None``: the world), for messages."""
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _late(me: int, what: str, timeout: float, elapsed: float) -> TransportTimeout:
    first = announced_failure(me)
    return TransportTimeout(
        f"rank {me}: {what} did not complete within {timeout:g} s (the timeout; waited {elapsed:.1f} s); "
        "a rank is stuck or slow, "
        "or never reached it (it failed, or runs other code there); raise timeout= if a rank is just slow"
        + (f"\n  The first rank to fail reported: {first}" if first else "")
    )
