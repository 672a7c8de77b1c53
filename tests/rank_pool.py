"""Many cases, one spawn: a pool of gloo ranks started once per test process, sent cases by name.

Starting processes and importing torch, transformers and pipecut in each of them is the slow part
of a multi-process test (10-20 s per spawn on 2 cores); the case itself is often a second. PyTorch's
own distributed tests amortise it the same way (``MultiProcessTestCase``, ``DTensorTestBase``).

:func:`spawn` has the signature of :func:`runtime.transport.launch.spawn` and the same contract --
``fn(rank, world, *args)`` on ``world`` ranks in a fresh gloo process group (file rendezvous), each
rank's result back in rank order, a rank's failure raised as :class:`LaunchError` with its traceback
-- but the processes outlive the call. Each case gets a process group of its own (a fresh
rendezvous file), and each rank puts back what a case may have changed in the process: environment,
working directory, signal handlers, the root logger, grad mode, default dtype, thread count,
pipecut's own functions (a case that patched one to make a rank fail), and fresh RNG seeds; then
it collects the case's garbage and freezes what is left (``gc.freeze``), so that a case's
collections do not walk the modules and programs every case keeps. A case in which
a rank dies or does not finish in time takes the pool down with it (a rank may be stuck in a
collective), and the next case starts a fresh one, so no case inherits a broken peer; a case in
which every rank returned or raised leaves the pool as it was.

What the pool cannot give a case is a process of its own, so these keep the plain spawn: a case
that measures the process's peak memory (VmHWM), kills or exits a rank on purpose, patches a
library and leaves it patched (a case that patches one puts it back before it returns, as the
stalled collectives do), or checks what a spawn itself reports.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import logging
import os
import pickle
import queue as queue_mod
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Hashable
from datetime import timedelta
from typing import Any

import torch

from runtime.transport.launch import _PRELOAD, LaunchError, start_context
from runtime.transport.launch import spawn as fresh_spawn
from runtime.transport.liveness import _alive  # a worker's parent is the fork server, not the test process

__all__ = ["RankPool", "spawn", "shared_pool", "Cases", "LaunchError"]

# What a rank imports before its first case, so that no case pays for it: what the launcher's fork
# server preloads (best effort: an import that fails here fails again, with its message, in the
# case that needs it).
_WARM = _PRELOAD
_GRACE = 10.0  # seconds the other ranks get to report after one has failed
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RankPool:
    """Up to ``size`` worker processes that run ``fn(rank, world, *args)`` cases over gloo.

    Example:
        >>> pool = RankPool(size=2)
        >>> pool.run(_ranks_and_world, 2)  # doctest: +SKIP
        [(0, 2), (1, 2)]
        >>> pool.remove()
    """

    def __init__(self, size: int = 4, *, warm: tuple[str, ...] = _WARM) -> None:
        self.size = size
        self.warm = warm  # modules each rank imports before its first case
        self.starts = 0  # how many times the workers were started (a failed case restarts them)
        self._tmp = tempfile.mkdtemp(prefix="pipecut-pool-")
        self._ctx: Any = None  # the start context, taken as the workers start
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._outbox: Any = None
        self._cases = 0

    def run(
        self, fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0, threads: int = 1
    ) -> list[Any]:
        """``fn(rank, world, *args)`` on ranks ``0..world-1``; each rank's result, in rank order.

        Raises:
            LaunchError: a rank raised or died (its traceback in the message), or the case took
                longer than ``timeout`` seconds; the pool is restarted before the next case.
        """
        if world > self.size:
            raise ValueError(f"a case of {world} ranks does not fit a pool of {self.size}: "
                             f"use runtime.transport.launch.spawn for it")
        payload = pickle.dumps((fn, args))  # here, so that an unpicklable case fails in the test
        self._start(world)
        self._cases += 1
        case = self._cases
        init = "file://" + os.path.join(self._tmp, f"case-{case}")
        for rank in range(world):
            self._inboxes[rank].put((case, _case_path(), payload, rank, world, init, timeout, threads))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}  # insertion order is arrival order: the first is the cause
        deadline = time.monotonic() + timeout
        try:
            while len(results) + len(errors) < world:
                now = time.monotonic()
                if now > deadline:
                    break
                if not self._outbox.empty():
                    got_case, rank, ok, body = self._outbox.get()
                    if got_case == case:
                        (results if ok else errors)[rank] = body
                        if not ok:
                            deadline = min(deadline, now + _GRACE)
                    continue
                for rank in range(world):
                    code = self._procs[rank].exitcode
                    if code is not None and rank not in results and rank not in errors:
                        time.sleep(0.2)  # a last message may still be in flight
                        if self._outbox.empty():
                            errors[rank] = (f"process exited with code {code}" if code else
                                            "process exited (code 0) without reporting a result")
                            deadline = min(deadline, time.monotonic() + _GRACE)
                time.sleep(0.005)
        except BaseException:
            self.close()  # interrupted: the ranks may be anywhere in the case
            raise
        if len(results) + len(errors) < world or not all(p.is_alive() for p in self._procs):
            self.close()  # a rank is stuck in the case or gone: the next case gets fresh ranks
        if errors:
            first = next(iter(errors))
            raise LaunchError(
                f"rank(s) {sorted(errors)} of {world} failed; rank {first} failed first:\n{errors[first]}"
            )
        if len(results) < world:
            raise LaunchError(f"{world} ranks did not finish within {timeout:.0f} s "
                              f"(finished: {sorted(results)}, failed: {sorted(errors)})")
        return [results[r] for r in range(world)]

    def close(self) -> None:
        """Stop every worker (the next :meth:`run` starts them again)."""
        for inbox in self._inboxes:
            with contextlib.suppress(OSError, ValueError):
                inbox.put(None)
        for proc in self._procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for inbox in self._inboxes:
            inbox.close()
            inbox.cancel_join_thread()
        self._procs, self._inboxes, self._outbox = [], [], None

    def remove(self) -> None:
        """:meth:`close`, and delete the rendezvous folder."""
        self.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def _start(self, world: int) -> None:
        alive = bool(self._procs) and all(p.is_alive() for p in self._procs)
        if not alive:
            self.close()
            self._ctx = start_context()  # forked from torch's and pipecut's imports, as spawn's ranks are
            self._outbox = self._ctx.SimpleQueue()
            self.starts += 1
        while len(self._procs) < world:
            inbox = self._ctx.Queue()
            proc = self._ctx.Process(target=_serve, daemon=True,
                                     args=(inbox, self._outbox, os.getpid(), self.warm, dict(os.environ)))
            proc.start()
            self._procs.append(proc)
            self._inboxes.append(inbox)


def _serve(inbox: Any, outbox: Any, parent: int, warm: tuple[str, ...], environ: dict[str, str]) -> None:
    """A worker: take cases from ``inbox`` until ``None`` (or the parent is gone), one at a time,
    in the test process's environment as it was when the worker started (``environ``)."""
    os.environ.clear()
    os.environ.update(environ)
    for name in warm:
        with contextlib.suppress(Exception):
            __import__(name)
    import torch.distributed as dist

    cwd = os.getcwd()
    own = _own_functions()
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    root = logging.getLogger()
    root_state = (list(root.handlers), root.level)
    while True:
        try:
            task = inbox.get(timeout=5)
        except queue_mod.Empty:
            if not _alive(parent):  # the test process died without closing the pool
                return
            continue
        if task is None:
            return
        case, path, payload, rank, world, init, timeout, threads = task
        sys.path[:] = path
        with contextlib.suppress(ImportError):  # the tests' folder is on the path from the first case
            __import__("trace_memo").install()  # once: install() leaves a memoised export as it is
        torch.set_num_threads(threads)
        torch.seed()  # fresh, as a new process's generators are: a case seeds what it needs itself
        random.seed()
        joined, reply = False, None
        try:
            fn, args = pickle.loads(payload)
            dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout))
            joined = True
            dist.barrier()  # every rank has joined before one can finish and close its connections
            reply = (case, rank, True, fn(rank, world, *args))
        except BaseException:  # every failure goes to the parent, which owns the message
            # Reported before the group is destroyed: destroying it fails the peers' waits, and
            # the parent must hear of this rank's error first.
            outbox.put((case, rank, False, traceback.format_exc()))
        finally:
            if joined and dist.is_initialized():
                dist.destroy_process_group()
            os.environ.clear()
            os.environ.update(environ)
            os.chdir(cwd)
            for s, h in handlers.items():
                signal.signal(s, h)
            root.handlers[:], root.level = root_state[0], root_state[1]
            torch.set_grad_enabled(True)
            torch.set_default_dtype(torch.float32)
            _put_back(own)
            _forget_distributed_caches()
            # What is alive now outlives the case (modules, memoised programs): frozen after a
            # full collection, so that the next case's collections walk only what that case made
            # (0.3-0.5 s a collection otherwise, with torch and transformers imported).
            gc.collect()
            gc.freeze()
        if reply is None:
            continue
        try:
            outbox.put(reply)
        except Exception:
            outbox.put((case, rank, False, traceback.format_exc()))


_OWN_PACKAGES = ("runtime", "partitioner", "pipecut")


def _own_functions() -> dict[tuple[str, str], Any]:
    """The functions and classes of pipecut's packages imported so far, by module and name."""
    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] not in _OWN_PACKAGES:
            continue
        for attr, value in list(vars(module).items()):
            if callable(value):
                found[(name, attr)] = value
    return found


def _put_back(own: dict[tuple[str, str], Any]) -> None:
    """Undo a case's patch of a pipecut function it forgot to put back (a test that makes a rank
    fail by replacing one): the next case would run the patch, on this rank only."""
    for (name, attr), value in own.items():
        module = sys.modules.get(name)
        if module is not None and getattr(module, attr, value) is not value:
            setattr(module, attr, value)


_TESTS = os.path.dirname(os.path.abspath(__file__))


def _case_path() -> list[str]:
    """This process's ``sys.path`` with the tests' own folders first: a benchmark script run in
    the test process puts ``benchmarks/`` ahead of them, and its ``families.py`` would shadow the
    tests' ``families`` helper in a rank that imports it afresh."""
    def ours(p: str) -> bool:
        full = os.path.abspath(p or ".")
        return full == _TESTS or full.startswith(_TESTS + os.sep)

    return sorted(sys.path, key=lambda p: not ours(p))  # stable: each group keeps its order


def _ranks_and_world(rank: int, world: int) -> tuple[int, int]:
    return rank, world


def _forget_distributed_caches() -> None:
    """Clear torch.distributed's memoised results (DTensor's sharding propagation, in Python and in
    its C++ dispatch, the redistribution planner, ...): they key on a DeviceMesh by its shape and
    names, so a later case's mesh of the same shape would be handed a result holding the last
    case's mesh, whose process groups are gone ("Could not resolve the process group registered
    under the name 19")."""
    with warnings.catch_warnings():  # looking at a deprecated name (dist.reduce_op) warns
        warnings.simplefilter("ignore")
        for name, module in list(sys.modules.items()):
            if module is None or not name.startswith("torch.distributed"):
                continue
            for value in list(vars(module).values()):
                for owner in (value, *(vars(value).values() if isinstance(value, type) else ())):
                    if isinstance(owner, functools._lru_cache_wrapper):
                        owner.cache_clear()
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()  # a per-thread cache
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:  # the C++ dispatch's own cache (torch 2.10 and later)
        clear_native()


_POOL: RankPool | None = None


def shared_pool() -> RankPool:
    """This test process's pool of 4 ranks, started at its first case and stopped at exit."""
    global _POOL
    if _POOL is None:
        _POOL = RankPool(size=4)
        atexit.register(_POOL.remove)
    return _POOL


def spawn(
    fn: Callable[..., Any], nprocs: int, *args: Any, backend: str = "gloo", timeout: float = 300.0,
    threads: int = 1, start_method: str = "forkserver",
) -> list[Any]:
    """:func:`runtime.transport.launch.spawn` on the shared pool's ranks (a world larger than the
    pool, a backend other than gloo, or ``start_method="spawn"`` gets a fresh spawn)."""
    pool = shared_pool()
    if backend != "gloo" or nprocs > pool.size or start_method != "forkserver":
        return fresh_spawn(fn, nprocs, *args, backend=backend, timeout=timeout, threads=threads,
                           start_method=start_method)
    return pool.run(fn, nprocs, *args, timeout=timeout, threads=threads)


class Cases:
    """A matrix's cases, each run on the shared pool when a test first asks for it.

    ``Cases(fn, world, *args)(key)`` runs ``fn(rank, world, key, *args)`` on ``world`` ranks once
    per ``key`` and remembers each rank's result, or the :class:`LaunchError` (raised again to every
    test that asks for that key, without a second run). A module-scoped fixture returns one, so
    that every test pays for its own cases only and the processes are started once per test
    process. ``cases.ranks(keys)`` gives, per rank, a dict of those keys' results.
    """

    def __init__(self, fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0) -> None:
        self.fn, self.world, self.args, self.timeout = fn, world, args, timeout
        self._done: dict[Hashable, list[Any] | LaunchError] = {}

    def __call__(self, key: Hashable) -> list[Any]:
        if key not in self._done:
            try:
                self._done[key] = spawn(self.fn, self.world, key, *self.args, timeout=self.timeout)
            except LaunchError as e:
                self._done[key] = e
        got = self._done[key]
        if isinstance(got, LaunchError):
            raise got
        return got

    def ranks(self, keys: list[Hashable]) -> list[dict[Hashable, Any]]:
        """Per rank, ``{key: that rank's result}`` for each of ``keys``."""
        runs = {key: self(key) for key in keys}
        return [{key: runs[key][rank] for key in keys} for rank in range(self.world)]
