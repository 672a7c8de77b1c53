"""Run a function on several local processes joined by torch.distributed (gloo on loopback).

For tests, benchmarks and single-host experiments; real jobs use ``torchrun``. Rendezvous goes
through a file in a fresh temporary directory, every process is joined with a deadline, and
stragglers are killed, so a failing rank never leaves the others hanging.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from partitioner.errors import PipecutError

__all__ = ["spawn", "LaunchError"]

log = logging.getLogger(__name__)


class LaunchError(PipecutError, RuntimeError):
    """A spawned rank failed or did not finish in time."""


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
    threads: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``nprocs`` processes; return each rank's result.

    Each process sets ``torch.set_num_threads(threads)``, joins a process group of ``backend``
    (file rendezvous), runs ``fn``, and destroys the group. ``fn`` and ``args`` must be
    picklable (a module-level function).

    Args:
        fn: the function to run on every rank.
        nprocs: the world size.
        args: extra arguments passed to ``fn``.
        backend: ``'gloo'`` (CPU) or ``'nccl'`` (one GPU per rank).
        timeout: seconds for the whole run, and for each collective inside it.
        threads: intra-op threads per process (1 on a small machine).

    Raises:
        LaunchError: a rank raised (its traceback is in the message) or the run timed out.

    Example:
        >>> def hello(rank, world):
        ...     return rank * 10
        >>> spawn(hello, 2)  # doctest: +SKIP
        [0, 10]
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="pipecut-launch-") as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        queue = ctx.SimpleQueue()
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, rank, nprocs, args, backend, init, timeout, threads, queue),
                daemon=True,
            )
            for rank in range(nprocs)
        ]
        for proc in procs:
            proc.start()
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}  # insertion order is arrival order: the first is the cause
        deadline = time.monotonic() + timeout
        try:
            while len(results) + len(errors) < nprocs:
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"{nprocs} ranks did not finish within {timeout:.0f} s "
                        f"(finished: {sorted(results)}, failed: {sorted(errors)})"
                    )
                if not queue.empty():
                    rank, ok, payload = queue.get()
                    (results if ok else errors)[rank] = payload
                    continue
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode is not None and r not in errors and r not in results]
                if dead and queue.empty():
                    time.sleep(0.2)  # a last message may still be in flight
                    if queue.empty():
                        for r in dead:
                            code = procs[r].exitcode
                            errors[r] = (f"process exited with code {code}" if code else
                                         "process exited (code 0) without reporting a result")
                time.sleep(0.01)
        finally:
            for proc in procs:
                proc.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        if errors:
            first = next(iter(errors))
            raise LaunchError(
                f"rank(s) {sorted(errors)} of {nprocs} failed; rank {first} failed first:\n{errors[first]}"
            )
        return [results[r] for r in range(nprocs)]


def _entry(
    fn: Callable[..., Any], rank: int, world: int, args: tuple[Any, ...], backend: str,
    init: str, timeout: float, threads: int, queue: Any,
) -> None:
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend, init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
        )
    except BaseException:  # report every failure to the parent, which owns the error message
        queue.put((rank, False, traceback.format_exc()))
        return
    try:
        result = fn(rank, world, *args)
    except BaseException:
        # Reported before the group is destroyed: destroying it closes the connections, which
        # fails the peers' waits, and the parent must hear of this rank's error first.
        queue.put((rank, False, traceback.format_exc()))
        return
    finally:
        dist.destroy_process_group()
    queue.put((rank, True, result))
