"""In-process execution of a schedule: one long-lived thread per rank, or every rank in one thread.

Used by ``PipelineTrainer`` with ``transport='local'`` (:class:`RankThreads` and
:func:`run_threads`) and ``transport='sequential'`` (:func:`run_interleaved`).
"""

from __future__ import annotations

import functools
import queue
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from partitioner.schedule.ir import Schedule
from runtime.errors import InconsistentScheduleError
from runtime.execute.executor import Executor, RunResult
from runtime.transport.p2p import LocalTransport

__all__ = ["RankThreads", "run_interleaved", "run_threads"]


class RankThreads:
    """One long-lived thread per rank for the in-process transport, reused step after step.

    A fresh thread per rank and step (started, then joined) made the step after it slow: on a
    small model the first backward after another rank's thread had exited stalled for ~0.1 s,
    ten times the whole step. Threads that live as long as the trainer avoid that.
    """

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = tuple(ranks)
        self._inboxes: dict[int, queue.SimpleQueue[tuple[Callable[[], None], threading.Event, int] | None]] = {
            r: queue.SimpleQueue() for r in self.ranks
        }
        for r, inbox in self._inboxes.items():
            threading.Thread(target=_serve, args=(inbox,), name=f"pipecut-rank{r}", daemon=True).start()
        # The threads hold only their inboxes, so dropping the trainer ends them.
        weakref.finalize(self, _stop, list(self._inboxes.values()))

    def run(self, jobs: Mapping[int, Callable[[], None]]) -> None:
        """Run ``jobs[r]`` on rank ``r``'s thread, all at once; return when every job has."""
        done = [threading.Event() for _ in jobs]
        threads = torch.get_num_threads()
        for (r, job), ev in zip(jobs.items(), done):
            self._inboxes[r].put((job, ev, threads))
        for ev in done:
            ev.wait()


def _serve(inbox: queue.SimpleQueue[tuple[Callable[[], None], threading.Event, int] | None]) -> None:
    while (item := inbox.get()) is not None:
        job, ev, threads = item
        # OpenMP's thread count is per thread: a new thread starts at the core count, not at what
        # the caller set with torch.set_num_threads, and MKL's GEMMs then oversubscribe the cores.
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        try:
            job()
        finally:
            ev.set()
        del item, job, ev  # keep nothing of this step alive until the next


def _stop(inboxes: list[queue.SimpleQueue[Any]]) -> None:
    for inbox in inboxes:
        inbox.put(None)


def run_threads(
    threads: RankThreads, exs: Mapping[int, Executor], schedule: Schedule, transport: LocalTransport,
    ins: list[dict[str, Any]], tgts: list[Any] | None, train: bool,
) -> list[RunResult]:
    results: dict[int, RunResult] = {}
    errors: list[BaseException] = []  # in the order they happened: the first is the cause
    lock = threading.Lock()

    def work(r: int) -> None:
        try:
            results[r] = exs[r].run(schedule.actions[r], ins, tgts, train=train)
        except BaseException as e:  # stop the other stages at once instead of letting them time out
            with lock:
                errors.append(e)
            transport.close()

    threads.run({r: functools.partial(work, r) for r in exs})
    if errors:
        raise errors[0]
    return [results[r] for r in sorted(results)]


def run_interleaved(
    exs: Mapping[int, Executor], schedule: Schedule, transport: LocalTransport,
    ins: list[dict[str, Any]], tgts: list[Any] | None, train: bool,
) -> list[RunResult]:
    """All ranks in one thread: repeatedly run the next action of any rank whose inputs are here."""
    states = {r: ex.start(ins, tgts, train=train) for r, ex in exs.items()}
    pos = dict.fromkeys(exs, 0)
    lists = {r: schedule.actions[r] for r in exs}
    while any(pos[r] < len(lists[r]) for r in exs):
        progressed = False
        for r, ex in exs.items():
            while pos[r] < len(lists[r]) and all(transport.has(k) for k in ex.needs(lists[r][pos[r]])):
                ex.execute(states[r], lists[r][pos[r]])
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(lists[r][pos[r]]) for r in exs if pos[r] < len(lists[r])}
            raise InconsistentScheduleError(f"the schedule cannot progress; next actions per rank: {stuck}")
    return [exs[r].finish(states[r]) for r in sorted(exs)]
