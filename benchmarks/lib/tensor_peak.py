"""Bytes live in PyTorch's CPU allocator over time: the CPU analogue of ``torch.cuda.max_memory_allocated``.

Torch exposes no running count of CPU tensor bytes outside the profiler, so :class:`TensorTrace`
runs the profiler (``torch.profiler.profile(activities=[CPU], profile_memory=True)``'s engine) over
a window and replays its memory events. c10's ``ProfiledCPUMemoryReporter`` reports each allocation
(``alloc_size > 0``) and the free of each block it saw allocated while profiling (``alloc_size <
0``), so the count replayed here is *the bytes allocated since the window opened and still live*,
measured from the same moment as an RSS baseline taken just before, and blind to glibc (its
arenas, its mmap threshold, what it keeps after a free). The free of a block allocated before the
window is not reported, so it does not lower the count. Frees are matched to this window's
allocations by address.

What c10 does not report: memory events reach only the threads that hold the profiler's
thread-local state (the one that opened the window, autograd's); a block freed by another thread
(a gloo worker dropping a collective's buffers) has no free event, and counts as live until its
address is allocated again (then it is taken as freed: :attr:`TensorTrace.reused` counts those).
So the count can overstate, by blocks freed unseen and never reused. (``_ExperimentalConfig(
profile_all_threads=True)`` reports no memory events at all in torch 2.13.)

Named spans (:meth:`TensorTrace.span`, a ``record_function`` range) split the window: for each one,
the bytes live as it starts, at its highest, and as it ends. :meth:`TensorTrace.live_at` lists the
allocations live at a moment, each with the profiler ranges it was made under (what the peak holds),
replayed event by event.

File mappings: ``UntypedStorage.from_file`` (how safetensors 0.8's ``safe_open`` maps a whole file for
``framework='pt'``) goes through c10's reporting too, as one allocation of the file's size while the file
is open, although only the pages read take memory (file pages, in RSS as ``RssFile``). Pass those
sizes as ``exclude``: blocks of them are left out of the count and counted on their own
(:attr:`TensorTrace.excluded_peak`).

Only ``record_function`` ranges (``RecordScope.USER_SCOPE``) are recorded unless ``ops=True``:
``torch.profiler.profile`` has no way to leave out the events of every aten op, and those add
time and buffers (the allocations are reported all the same: c10 reports them to an enabled
profiler whatever the scopes). Even so the profiler's buffers, malloc'd as a step runs, change
glibc's heap and so the RSS measured beside it: see ``benchmarks/lib/memory_engines.py``.

    >>> with TensorTrace() as trace:
    ...     with trace.span("step"):
    ...         a = torch.empty(1 << 20, dtype=torch.uint8)
    ...         del a
    >>> trace.spans()[0].peak
    1048576
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._C._profiler import ProfilerActivity, ProfilerConfig, ProfilerState, RecordScope, _ExperimentalConfig
from torch.autograd import _disable_profiler, _enable_profiler, _prepare_profiler
from torch.profiler import record_function

__all__ = ["Allocation", "Span", "TensorTrace"]

_SPAN = "pipecut.span::"  # the record_function prefix of a span


@dataclasses.dataclass(frozen=True)
class Span:
    """A named range of the window: bytes live (allocated since the window opened) at its start, highest, end."""

    name: str
    start: int
    peak: int
    end: int
    start_ns: int
    end_ns: int
    peak_ns: int


@dataclasses.dataclass(frozen=True)
class Allocation:
    """One live block: its bytes, when it was allocated, and the ops it was allocated under (outermost first)."""

    nbytes: int
    at_ns: int
    ops: tuple[str, ...]


_Event = tuple[int, int, int, tuple[str, ...]]  # (ns, bytes: + allocated, - freed, ptr, ops)
_Block = tuple[int, int, tuple[str, ...]]  # (bytes, ns, ops)


class TensorTrace:
    """A profiler window over which CPU tensor bytes are counted; a context manager, used once.

    Args:
        ops: record every op (aten, autograd), not only ``record_function`` ranges, as the ranges
            above each allocation (:meth:`live_at`); costs time and profiler memory.
        exclude: block sizes left out of the count (a mapped file's, see the module docstring);
            their own highest count live at once is :attr:`excluded_peak`.
    """

    def __init__(self, *, ops: bool = False, exclude: Collection[int] = ()) -> None:
        # (state, record shapes, profile memory, with stack, with flops, with modules, experimental, trace id)
        self._config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig(), "")
        self._scopes = set() if ops else {RecordScope.USER_SCOPE}  # empty: every scope
        self._times: list[int] = []  # per memory event, in time order: when, and the bytes live after it
        self._live: list[int] = []
        self._events: list[_Event] = []
        self.reused = 0  # allocations at an address still live: its block freed unseen, or its free stamped late
        self._spans: list[tuple[str, int, int]] = []  # (name, start ns, end ns)
        self._exclude = frozenset(exclude)
        self.excluded_peak = 0  # the highest bytes of excluded blocks live at once

    def __enter__(self) -> TensorTrace:
        _prepare_profiler(self._config, {ProfilerActivity.CPU})
        _enable_profiler(self._config, {ProfilerActivity.CPU}, self._scopes)
        return self

    def __exit__(self, *exc: Any) -> None:
        results = _disable_profiler()
        if exc[0] is None:
            self._replay(results)

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Mark ``name`` as a range of the window (a ``record_function``)."""
        with record_function(_SPAN + name):
            yield

    def _replay(self, results: Any) -> None:
        alloc = torch._C._profiler._ExtraFields_Allocation
        cpu = torch.device("cpu")
        todo: list[tuple[Any, tuple[str, ...]]] = [(e, ()) for e in results.experimental_event_tree()]
        while todo:
            e, above = todo.pop()
            fields = e.extra_fields
            if isinstance(fields, alloc):
                if fields.device == cpu:
                    self._events.append((e.start_time_ns, fields.alloc_size, fields.ptr, above))
                continue
            if e.name.startswith(_SPAN):
                self._spans.append((e.name[len(_SPAN):], e.start_time_ns, e.end_time_ns))
            below = (*above, e.name)
            todo.extend((c, below) for c in e.children)
        self._events.sort(key=lambda ev: ev[0])
        self._spans.sort(key=lambda s: s[1])
        if self._exclude:
            excluded = [ev for ev in self._events if abs(ev[1]) in self._exclude]
            self._events = [ev for ev in self._events if abs(ev[1]) not in self._exclude]
            live: dict[int, int] = {}
            total = 0
            for _, nbytes, ptr, _ in excluded:
                total -= live.pop(ptr, 0)  # an allocation at a live address: its free went unseen
                if nbytes > 0:
                    live[ptr] = nbytes
                    total += nbytes
                self.excluded_peak = max(self.excluded_peak, total)
        self._replay_blocks(None)

    def _replay_blocks(self, until: int | None) -> dict[int, _Block]:
        """Replay the events up to ``until`` ns (all: None, which also fills the count over time):
        the blocks of this window then live, by address.

        c10 reports memory only to threads that hold the profiler's state (this one and autograd's),
        so a block freed by another thread (a gloo worker's, dropping a collective's buffers) has no
        free event: an allocation at an address still live means its block was freed unseen. The
        free can also be stamped late (the clock is read after c10's lock is released): then two
        frees of the address follow before its next allocation, and the late one is skipped.
        """
        frees_next: dict[int, list[int]] = {}  # an allocation's event -> the frees of its address before the next
        last: dict[int, int] = {}
        for i, (_, nbytes, ptr, _) in enumerate(self._events):
            if nbytes > 0:
                last[ptr] = i
                frees_next[i] = []
            elif ptr in last:
                frees_next[last[ptr]].append(i)
        live: dict[int, _Block] = {}
        skip: set[int] = set()  # late-stamped frees
        total = 0
        if until is None:
            self._times, self._live = [], []
        for i, (at, nbytes, ptr, ops) in enumerate(self._events):
            if until is not None and at > until:
                break
            if nbytes > 0:
                old = live.pop(ptr, None)
                if old is not None:  # freed unseen, or its free stamped late (then skipped)
                    total -= old[0]
                    if until is None:
                        self.reused += 1
                    if len(frees_next[i]) >= 2:
                        skip.add(frees_next[i][0])
                live[ptr] = (nbytes, at, ops)
                total += nbytes
            elif i not in skip:
                old = live.pop(ptr, None)  # None: a block from before the window, not counted either way
                total -= old[0] if old is not None else 0
            if until is None:
                self._times.append(at)
                self._live.append(total)
        return live

    def bytes_at(self, ns: int) -> int:
        """Bytes live just after every memory event at or before ``ns`` (0 before the first)."""
        i = bisect.bisect_right(self._times, ns)
        return self._live[i - 1] if i else 0

    @property
    def allocations(self) -> int:
        """How many blocks the window allocated (each one an event the profiler held until it ended)."""
        return sum(1 for ev in self._events if ev[1] > 0)

    @property
    def peak(self) -> int:
        """The highest count over the whole window."""
        return max(self._live, default=0)

    def peak_between(self, t0: int, t1: int) -> tuple[int, int]:
        """The highest count from ``t0`` to ``t1`` (the count at ``t0`` included), and when it was reached."""
        i, j = bisect.bisect_left(self._times, t0), bisect.bisect_right(self._times, t1)
        best, when = (self._live[i - 1] if i else 0), t0
        for k in range(i, j):
            if self._live[k] > best:
                best, when = self._live[k], self._times[k]
        return best, when

    def spans(self, prefix: str = "") -> list[Span]:
        """The spans whose names start with ``prefix``, in time order."""
        out = []
        for name, t0, t1 in self._spans:
            if name.startswith(prefix):
                peak, peak_ns = self.peak_between(t0, t1)
                out.append(Span(name, self.bytes_at(t0 - 1), peak, self.bytes_at(t1), t0, t1, peak_ns))
        return out

    def live_at(self, ns: int) -> list[Allocation]:
        """The blocks this window allocated that are still live just after ``ns``, largest first."""
        blocks = [Allocation(*b) for b in self._replay_blocks(ns).values()]
        return sorted(blocks, key=lambda a: -a.nbytes)
