"""Bytes live in PyTorch's CPU allocator over time: the CPU analogue of ``torch.cuda.max_memory_allocated``.

Torch keeps no running count of CPU tensor bytes outside the profiler, so :class:`TensorTrace` runs
``torch.profiler.profile(activities=[CPU], profile_memory=True)`` over a window and replays its
memory events. c10's ``ProfiledCPUMemoryReporter`` reports each allocation (``alloc_size > 0``) and
the free of each block it saw allocated while profiling (``alloc_size < 0``); the free of a block
allocated before the window is not reported. So the count replayed here is *the bytes allocated
since the window opened and still live*: measured from the same moment as an RSS baseline taken
just before, and blind to glibc (its arenas, its mmap threshold, what it keeps after a free). Frees
are matched to this window's allocations by address, so a block an earlier profiling session in the
same process left in c10's table cannot make the count go negative.

Named spans (:meth:`TensorTrace.span`, a ``record_function`` range) split the window: for each one,
the bytes live as it starts, at its highest, and as it ends. :meth:`TensorTrace.live_at` lists the
allocations live at a moment, each with the profiler ops it was made under (what the peak holds).

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
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

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


class TensorTrace:
    """A profiler window over which CPU tensor bytes are counted; a context manager, used once.

    Args:
        ops: keep, for each allocation, the names of the profiler ops above it (for :meth:`live_at`).
    """

    def __init__(self, *, ops: bool = False) -> None:
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._ops = ops
        self._times: list[int] = []  # per memory event, in time order: when, and the bytes live after it
        self._live: list[int] = []
        self._events: list[tuple[int, int, int, tuple[str, ...]]] = []  # (ns, bytes, ptr, ops)
        self._spans: list[tuple[str, int, int]] = []  # (name, start ns, end ns)

    def __enter__(self) -> TensorTrace:
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self._replay()

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Mark ``name`` as a range of the window (a ``record_function``)."""
        with record_function(_SPAN + name):
            yield

    def _replay(self) -> None:
        alloc = torch._C._profiler._ExtraFields_Allocation
        cpu = torch.device("cpu")
        todo = [(e, ()) for e in self._prof.profiler.kineto_results.experimental_event_tree()]
        while todo:
            e, above = todo.pop()
            fields = e.extra_fields
            if isinstance(fields, alloc):
                if fields.device == cpu:
                    self._events.append((e.start_time_ns, fields.alloc_size, fields.ptr, above))
                continue
            if e.name.startswith(_SPAN):
                self._spans.append((e.name[len(_SPAN):], e.start_time_ns, e.end_time_ns))
            below = (*above, e.name) if self._ops else ()
            todo.extend((c, below) for c in e.children)
        self._events.sort(key=lambda ev: ev[0])
        self._spans.sort(key=lambda s: s[1])
        live, total = {}, 0  # ptr -> bytes of this window's live blocks
        for at, nbytes, ptr, _ in self._events:
            if nbytes > 0:
                live[ptr] = nbytes
                total += nbytes
            else:
                total -= live.pop(ptr, 0)  # a block from before the window: not counted either way
            self._times.append(at)
            self._live.append(total)

    def bytes_at(self, ns: int) -> int:
        """Bytes live just after every memory event at or before ``ns`` (0 before the first)."""
        i = bisect.bisect_right(self._times, ns)
        return self._live[i - 1] if i else 0

    @property
    def peak(self) -> int:
        """The highest count over the whole window."""
        return max(self._live, default=0)

    def spans(self, prefix: str = "") -> list[Span]:
        """The spans whose names start with ``prefix``, in time order."""
        out = []
        for name, t0, t1 in self._spans:
            if not name.startswith(prefix):
                continue
            i, j = bisect.bisect_left(self._times, t0), bisect.bisect_right(self._times, t1)
            start = self._live[i - 1] if i else 0
            inside = self._live[i:j]
            k = max(range(len(inside)), key=inside.__getitem__, default=None)
            peak, peak_ns = (start, t0) if k is None or inside[k] <= start else (inside[k], self._times[i + k])
            out.append(Span(name, start, peak, self.bytes_at(t1), t0, t1, peak_ns))
        return out

    def live_at(self, ns: int) -> list[Allocation]:
        """The blocks this window allocated that are still live just after ``ns``, largest first."""
        live: dict[int, Allocation] = {}
        for at, nbytes, ptr, ops in self._events:
            if at > ns:
                break
            if nbytes > 0:
                live[ptr] = Allocation(nbytes, at, ops)
            else:
                live.pop(ptr, None)
        return sorted(live.values(), key=lambda a: -a.nbytes)
