"""Run a function on several local processes joined by torch.distributed (gloo on loopback).

For tests, benchmarks and single-host experiments; real jobs use ``torchrun``. Rendezvous goes
through a file in a fresh temporary directory, every process is joined with a deadline, and
stragglers are killed, so a failing rank never leaves the others hanging.

Ranks are started from a fork server (``multiprocessing``'s ``forkserver``) that has imported torch
and pipecut once, so a rank starts in a fraction of a second instead of paying the 3-6 s import
again (``benchmarks/launch.py`` measures both). A rank still starts clean: the fork server is a
fresh interpreter, not a copy of the caller, and each rank gets the caller's environment,
working directory and ``sys.path`` as they are at the call. ``start_method="spawn"`` gives a
process that imports everything itself, for code that reads an environment variable at import
time and sets it between two launches.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver
import os
import sys
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

__all__ = ["spawn", "start_context", "START_METHODS", "LaunchError", "StartMethodError"]

log = logging.getLogger(__name__)

START_METHODS = ("forkserver", "spawn")
# What the fork server imports before its first fork (those of them the caller has imported), so
# that no rank imports them again.
_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "safetensors", "transformers", "partitioner", "runtime",
            "pipecut")


class LaunchError(PipecutError, RuntimeError):
    """A spawned rank failed or did not finish in time."""


class StartMethodError(PipecutError, ValueError):
    """An unknown ``start_method``."""


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
    threads: int = 1,
    start_method: str = "forkserver",
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
        start_method: ``'forkserver'`` (the default: ranks forked from a server that has imported
            torch and pipecut, given this process's environment at the call) or ``'spawn'`` (each
            rank a fresh interpreter that imports everything itself); ``'forkserver'`` falls back
            to ``'spawn'`` where the platform has no fork server.

    Raises:
        StartMethodError: an unknown ``start_method`` (a ``ValueError``).
        LaunchError: a rank raised (its traceback is in the message) or the run timed out.

    Example:
        >>> def hello(rank, world):
        ...     return rank * 10
        >>> spawn(hello, 2)  # doctest: +SKIP
        [0, 10]
    """
    ctx = start_context(start_method)
    env = dict(os.environ)  # a forked rank starts with the server's environment: it takes this one
    with tempfile.TemporaryDirectory(prefix="pipecut-launch-") as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        queue = ctx.SimpleQueue()
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, rank, nprocs, args, backend, init, timeout, threads, queue, env),
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


def start_context(start_method: str = "forkserver") -> Any:
    """The ``multiprocessing`` context :func:`spawn` starts ranks with; for ``'forkserver'``, the
    fork server is started here (if it is not running) with the modules of ``_PRELOAD`` that this
    process has imported, and ``multiprocessing``'s preload list is put back as it was.

    Raises:
        StartMethodError: ``start_method`` is not one of :data:`START_METHODS` (a ``ValueError``).
    """
    if start_method not in START_METHODS:
        raise StartMethodError(f"start_method={start_method!r}: one of {', '.join(map(repr, START_METHODS))}")
    if start_method == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    server = multiprocessing.forkserver._forkserver
    before = list(getattr(server, "_preload_modules", []))
    ctx.set_forkserver_preload(list(dict.fromkeys([*before, *(m for m in _PRELOAD if m in sys.modules)])))
    try:
        server.ensure_running()  # the preload list is read here, at the server's start, only
    finally:
        ctx.set_forkserver_preload(before)
    return ctx


def _entry(
    fn: Callable[..., Any], rank: int, world: int, args: tuple[Any, ...], backend: str,
    init: str, timeout: float, threads: int, queue: Any, env: dict[str, str],
) -> None:
    os.environ.clear()  # the caller's environment at the call (a forked rank has the server's)
    os.environ.update(env)
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend, init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
        )
    except BaseException:  # report every failure to the parent, which owns the error message
        queue.put((rank, False, traceback.format_exc()))
        return
    try:
        # Every rank has joined before any runs ``fn``: a rank that finished (and closed its
        # connections) while a slower peer was still connecting would fail that peer's join.
        dist.barrier()
        result = fn(rank, world, *args)
    except BaseException:
        # Reported before the group is destroyed: destroying it closes the connections, which
        # fails the peers' waits, and the parent must hear of this rank's error first.
        queue.put((rank, False, traceback.format_exc()))
        return
    finally:
        dist.destroy_process_group()
    queue.put((rank, True, result))
