"""What ran when: per-rank action spans and messages, their metrics, Chrome/Perfetto traces and Gantt charts.

Legend: ``p`` ranks, ``S`` stages, ``s`` a stage, ``r`` a rank, ``mb`` a micro-batch, ``t`` a time
in seconds.

A :class:`Timeline` is the one shape both a prediction and a measurement take: the simulator
(``partitioner.schedule.simulate``) returns one, and :func:`from_records` builds one from the executor's
``ActionRecord`` list. Everything downstream (bubble, peak memory, traces, charts) reads only
the timeline, so predicted and measured steps are compared with the same code.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

from partitioner.schedule.actions import Action, ActionLike, Kind
from partitioner.schedule.errors import MissingDependencyError, TimelineError

__all__ = [
    "Message",
    "RecordLike",
    "Span",
    "Timeline",
    "TimelineError",
    "from_records",
    "save_chrome_trace",
    "save_gantt_png",
    "to_chrome_trace",
]

F, B, I, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT



@dataclass(frozen=True)
class Span:
    """Action ``{stage}{kind}{mb}`` ran on rank ``rank`` from ``start`` to ``end`` (seconds).

    Example:
        >>> span = Span(0, 1, "F", 3, 0.5, 1.5)
        >>> span.label, span.duration, span.kind
        ('1F3', 1.0, <Kind.FORWARD: 'F'>)
    """

    rank: int
    stage: int
    kind: Kind
    mb: int
    start: float
    end: float

    def __post_init__(self) -> None:
        if type(self.kind) is Kind:  # the simulator's case, a span per action: nothing to convert
            return
        try:
            object.__setattr__(self, "kind", Kind(self.kind))
        except ValueError:
            raise TimelineError(
                f"span kind {self.kind!r} is not one of F, B, I, W (Kind.FORWARD, ...)"
            ) from None

    @property
    def action(self) -> Action:
        """The schedule action this span ran."""
        return Action(self.stage, self.kind, self.mb)

    @property
    def label(self) -> str:
        """The action's notation, e.g. ``'1F3'``."""
        return f"{self.stage}{self.kind.value}{self.mb}"

    @property
    def duration(self) -> float:
        """``end - start``."""
        return self.end - self.start


@dataclass(frozen=True)
class Message:
    """Output of ``{src_stage}{kind}{mb}`` on rank ``src``, sent at ``send``, arrived on ``dst`` at ``recv``.

    ``kind`` is the producing action's: ``F`` sends activations to ``dst_stage = src_stage + 1``;
    ``B`` or ``I`` sends input gradients to ``dst_stage = src_stage - 1``. ``nbytes`` is what was
    sent, if known (0 otherwise).
    """

    src: int
    dst: int
    send: float
    recv: float
    src_stage: int
    dst_stage: int
    kind: Kind
    mb: int
    nbytes: float = 0.0

    @property
    def what(self) -> str:
        """``'act'`` for activations, ``'grad'`` for gradients (``runtime.transport.p2p`` terms)."""
        return "act" if self.kind is F else "grad"


@dataclass(frozen=True)
class Timeline:
    """Per-rank action spans and the messages between ranks, with the metrics they imply.

    Attributes:
        spans: every action that ran, sorted by rank, then start.
        messages: the messages between ranks, sorted by send time (may be empty).
        num_ranks: ``p``; ranks without spans count as idle throughout.
        activation_bytes: per stage, the bytes one micro-batch's activations hold, if known.
        replay_bytes: per stage, bytes held on top from the start of a micro-batch's first
            backward action (``B`` or ``I``) to its release: the activations a recomputing
            stage rebuilds there (``runtime.execute.recompute``); ``None`` for none.

    Memory model: a (stage, micro-batch) holds its activations from the start of its ``F`` to
    the end of its last backward action (``B``, or ``W`` of a split backward). One without any
    backward (a forward-only run) holds nothing for a backward, as ``peak_inflight`` counts.

    Example:
        >>> t = Timeline((Span(0, 0, "F", 0, 0.0, 1.0), Span(0, 0, "B", 0, 2.0, 4.0)))
        >>> t.step_time, t.bubble, t.peak_inflight
        (4.0, (0.25,), (1,))
    """

    spans: tuple[Span, ...]
    messages: tuple[Message, ...] = ()
    num_ranks: int = 0
    activation_bytes: tuple[float, ...] | None = None
    replay_bytes: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        spans = tuple(sorted(self.spans, key=lambda x: (x.rank, x.start, x.end)))
        object.__setattr__(self, "spans", spans)
        object.__setattr__(self, "messages", tuple(sorted(self.messages, key=_message_order)))
        p = max([self.num_ranks] + [x.rank + 1 for x in spans])
        object.__setattr__(self, "num_ranks", p)
        if self.activation_bytes is not None:
            object.__setattr__(self, "activation_bytes", tuple(self.activation_bytes))
        if self.replay_bytes is not None:
            object.__setattr__(self, "replay_bytes", tuple(self.replay_bytes))
        for x in spans:
            if x.rank < 0 or x.stage < 0 or x.mb < 0:
                raise TimelineError(f"span {x}: rank, stage and mb must be >= 0")
            if not (math.isfinite(x.start) and math.isfinite(x.end)) or x.end < x.start:
                raise TimelineError(
                    f"span {x.label} on rank {x.rank} runs from {x.start} to {x.end}: "
                    "times must be finite with end >= start"
                )
        for msg in self.messages:
            if not (0 <= msg.src < p and 0 <= msg.dst < p) or msg.recv < msg.send:
                raise TimelineError(f"message {msg}: ranks must be in 0..{p - 1} and recv >= send")
        stages = 1 + max((x.stage for x in spans), default=-1)
        if self.activation_bytes is not None and len(self.activation_bytes) < stages:
            raise TimelineError(
                f"activation_bytes has {len(self.activation_bytes)} entries but spans run "
                f"stages 0..{stages - 1}; give one per stage"
            )
        if self.replay_bytes is not None and len(self.replay_bytes) < stages:
            raise TimelineError(
                f"replay_bytes has {len(self.replay_bytes)} entries but spans run "
                f"stages 0..{stages - 1}; give one per stage"
            )

    @property
    def start(self) -> float:
        """The earliest span start (0 for an empty timeline)."""
        return min((x.start for x in self.spans), default=0.0)

    @property
    def step_time(self) -> float:
        """The makespan: from the first span's start to the last span's end."""
        return max((x.end for x in self.spans), default=0.0) - self.start

    def of_rank(self, rank: int) -> tuple[Span, ...]:
        """Rank ``rank``'s spans, by start time."""
        return self._by_rank[rank] if 0 <= rank < self.num_ranks else ()

    # Derived indexes, computed once: a frozen timeline never changes.
    @cached_property
    def _by_rank(self) -> tuple[tuple[Span, ...], ...]:
        rows: list[list[Span]] = [[] for _ in range(self.num_ranks)]
        for x in self.spans:
            rows[x.rank].append(x)
        return tuple(map(tuple, rows))

    @cached_property
    def _release(self) -> dict[tuple[int, int], Span]:
        """Per (stage, mb), its last backward span: where its activations are freed."""
        release: dict[tuple[int, int], Span] = {}
        for x in self.spans:
            key = (x.stage, x.mb)
            if x.kind is not F and (key not in release or x.end >= release[key].end):
                release[key] = x
        return release

    @cached_property
    def _curves(self) -> tuple[tuple[tuple[float, int, float], ...], ...]:
        return tuple(self._memory(r) for r in range(self.num_ranks))

    @property
    def busy(self) -> tuple[float, ...]:
        """Per rank, the seconds spent running actions."""
        total = [0.0] * self.num_ranks
        for x in self.spans:
            total[x.rank] += x.duration
        return tuple(total)

    @property
    def bubble(self) -> tuple[float, ...]:
        """Per rank, the fraction of the step it is idle: ``1 - busy / step_time``."""
        step = self.step_time
        return tuple(1.0 - b / step if step > 0 else 0.0 for b in self.busy)

    @property
    def bubble_total(self) -> float:
        """Idle time over all ranks as a fraction of ``p * step_time``."""
        step = self.step_time
        if step <= 0 or not self.num_ranks:
            return 0.0
        return 1.0 - sum(self.busy) / (self.num_ranks * step)

    def memory(self, rank: int) -> tuple[tuple[float, int, float], ...]:
        """Rank ``rank``'s activations over time: ``(t, micro-batches held, bytes held)`` per change.

        Bytes are 0 when ``activation_bytes`` is not known. Changes at one time come in the
        rank's running order, so a ``W`` that ends as the next ``F`` starts frees its
        micro-batch first, and a zero-length ``F`` still counts while it runs.
        """
        return self._curves[rank] if 0 <= rank < self.num_ranks else ()

    def _memory(self, rank: int) -> tuple[tuple[float, int, float], ...]:
        release = self._release
        act, replay = self.activation_bytes, self.replay_bytes
        events: list[tuple[float, int, int, float]] = []  # (t, running order, +1 / -1 / 0, bytes)
        replayed: set[tuple[int, int]] = set()
        for i, x in enumerate(self.of_rank(rank)):
            key = (x.stage, x.mb)
            if x.kind is F and key in release:
                events.append((x.start, 2 * i, 1, act[x.stage] if act else 0.0))
            extra = replay[x.stage] if replay and act else 0.0
            if extra and x.kind in (B, I) and key in release and key not in replayed:
                replayed.add(key)
                events.append((x.start, 2 * i, 0, extra))
            if release.get(key) is x:
                held = (act[x.stage] if act else 0.0) + (extra if key in replayed else 0.0)
                events.append((x.end, 2 * i + 1, -1, -held))
        curve, count, nbytes = [], 0, 0.0
        for t, _, delta, change in sorted(events):
            count += delta
            nbytes += change
            curve.append((t, count, nbytes))
        return tuple(curve)

    @property
    def peak_inflight(self) -> tuple[int, ...]:
        """Per rank, the most (stage, micro-batch) activations held at once."""
        return tuple(
            max((c for _, c, _ in self.memory(r)), default=0) for r in range(self.num_ranks)
        )

    @property
    def peak_bytes(self) -> tuple[float, ...] | None:
        """Per rank, the most activation bytes held at once; ``None`` without ``activation_bytes``."""
        if self.activation_bytes is None:
            return None
        return tuple(
            max((b for _, _, b in self.memory(r)), default=0.0) for r in range(self.num_ranks)
        )


def _message_order(msg: Message) -> tuple[float, float, int, int, int]:
    return (msg.send, msg.recv, msg.src, msg.dst, msg.mb)


# -- measured runs ------------------------------------------------------------------------------


class RecordLike(ActionLike, Protocol):
    """What :func:`from_records` reads: ``runtime.execute.executor.ActionRecord`` has these fields."""

    @property
    def rank(self) -> int: ...
    @property
    def start(self) -> float: ...
    @property
    def end(self) -> float: ...


def _spans_of(rows: list[RecordLike]) -> list[Span]:
    """The records as spans, with times shifted so that the earliest start is 0."""
    origin = min((x.start for x in rows), default=0.0)
    spans = []
    for x in rows:
        try:
            kind = Kind(x.kind)
        except ValueError:
            raise TimelineError(
                f"record {x!r} has kind {x.kind!r}; use one of F, B, I, W"
            ) from None
        spans.append(Span(x.rank, x.stage, kind, x.mb, x.start - origin, x.end - origin))
    return spans


def _hand_overs(spans: list[Span]) -> list[Message]:
    """A message per hand-over between ranks, from the producer's end to the consumer's start."""
    messages: list[Message] = []
    by_action = {(x.stage, x.kind, x.mb): x for x in spans}
    for x in spans:
        if x.kind is F:
            nxt = by_action.get((x.stage + 1, F, x.mb))
            if nxt is not None and nxt.rank != x.rank:
                messages.append(Message(x.rank, nxt.rank, x.end, max(x.end, nxt.start), x.stage, nxt.stage, F, x.mb))
        elif x.kind in (B, I) and x.stage > 0:
            prev = by_action.get((x.stage - 1, I, x.mb)) or by_action.get((x.stage - 1, B, x.mb))
            if prev is not None and prev.rank != x.rank:
                messages.append(
                    Message(x.rank, prev.rank, x.end, max(x.end, prev.start), x.stage, prev.stage, x.kind, x.mb)
                )
    return messages


def from_records(
    records: Iterable[RecordLike],
    act_bytes: Iterable[float] | None = None,
    *,
    infer_messages: bool = True,
) -> Timeline:
    """Build a timeline from measured action records (e.g. ``trainer.last_records``).

    Times are shifted so the earliest start is 0 (``time.perf_counter`` has no fixed origin).
    Measured runs do not record messages; with ``infer_messages`` each hand-over between ranks
    becomes one, sent when the producer ended and received when the consumer started (an upper
    bound on the transfer): ``F`` of ``s`` to ``F`` of ``s + 1``, and the backward (``B`` or
    ``I``) of ``s + 1`` to the backward of ``s``.

    Args:
        records: objects with ``rank, stage, kind, mb, start, end``; ``kind`` a :class:`Kind`
            or its letter.
        act_bytes: per stage, activation bytes one micro-batch holds, for the memory metrics.
        infer_messages: add the hand-overs between ranks as messages.

    Raises:
        TimelineError: a record has an unknown kind, or end before start.

    Example:
        >>> from runtime.execute.executor import ActionRecord
        >>> records = [ActionRecord(0, 0, "F", 0, 10.0, 11.0), ActionRecord(1, 1, "F", 0, 11.5, 12.0)]
        >>> t = from_records(records)
        >>> t.step_time, [(m.src, m.dst, m.send, m.recv) for m in t.messages]
        (2.0, [(0, 1, 1.0, 1.5)])
    """
    spans = _spans_of(list(records))
    messages = _hand_overs(spans) if infer_messages else []
    return Timeline(
        tuple(spans),
        tuple(messages),
        activation_bytes=None if act_bytes is None else tuple(act_bytes),
    )


# -- Chrome / Perfetto trace --------------------------------------------------------------------


def _us(t: float) -> float:
    return round(t * 1e6, 3)


def _track_events(timeline: Timeline, name: str) -> list[dict[str, Any]]:
    """Metadata events: the process's name, then a named, ordered thread track per rank."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 0, "name": "process_name", "args": {"name": name}},
    ]
    for r in range(timeline.num_ranks):
        events.append(
            {"ph": "M", "pid": 0, "tid": r, "name": "thread_name", "args": {"name": f"rank {r}"}}
        )
        events.append(
            {"ph": "M", "pid": 0, "tid": r, "name": "thread_sort_index", "args": {"sort_index": r}}
        )
    return events


def _span_events(timeline: Timeline) -> list[dict[str, Any]]:
    """One complete (``X``) event per action, on its rank's track."""
    t0 = timeline.start
    return [
        {
            "ph": "X",
            "pid": 0,
            "tid": x.rank,
            "name": x.label,
            "cat": x.kind.value,
            "ts": _us(x.start - t0),
            "dur": _us(x.duration),
            "args": {"stage": x.stage, "mb": x.mb, "kind": x.kind.value},
        }
        for x in timeline.spans
    ]


def _flow_events(timeline: Timeline) -> list[dict[str, Any]]:
    """Per message, a flow arrow (``s`` then ``f``, one ``id``) from the sending to the reading action."""
    t0 = timeline.start
    events: list[dict[str, Any]] = []
    spans = {(x.rank, x.stage, x.kind, x.mb): x for x in timeline.spans}
    for i, msg in enumerate(timeline.messages):
        producer = spans.get((msg.src, msg.src_stage, msg.kind, msg.mb))
        readers = (F,) if msg.kind is F else (I, B)
        consumer = next(
            (spans[key] for k in readers if (key := (msg.dst, msg.dst_stage, k, msg.mb)) in spans),
            None,
        )
        # Flow events bind to the slice enclosing them: start the arrow just inside the
        # producer's end and finish it at the reader's start, so viewers attach both ends.
        send = msg.send if producer is None else min(msg.send, producer.end)
        send_us = _us(send - t0)
        if producer is not None and producer.duration > 0:
            send_us = max(_us(producer.start - t0), send_us - 1e-3)
        recv_us = _us((msg.recv if consumer is None else max(msg.recv, consumer.start)) - t0)
        args = {
            "mb": msg.mb,
            "from stage": msg.src_stage,
            "to stage": msg.dst_stage,
            "sent (us)": _us(msg.send - t0),
            "arrived (us)": _us(msg.recv - t0),
            "bytes": msg.nbytes,
        }
        events.append(
            {
                "ph": "s",
                "pid": 0,
                "tid": msg.src,
                "id": i,
                "name": msg.what,
                "cat": msg.what,
                "ts": send_us,
                "args": args,
            }
        )
        events.append(
            {
                "ph": "f",
                "bp": "e",
                "pid": 0,
                "tid": msg.dst,
                "id": i,
                "name": msg.what,
                "cat": msg.what,
                "ts": recv_us,
                "args": args,
            }
        )
    return events


def _counter_events(timeline: Timeline) -> list[dict[str, Any]]:
    """A counter (``C``) track per rank of the activations held: bytes if known, else micro-batches."""
    t0 = timeline.start
    events: list[dict[str, Any]] = []
    known = timeline.activation_bytes is not None
    for r in range(timeline.num_ranks):
        track = f"rank {r} activations" + (" (bytes)" if known else " (micro-batches)")
        for t, count, nbytes in timeline.memory(r):
            events.append(
                {
                    "ph": "C",
                    "pid": 0,
                    "tid": r,
                    "name": track,
                    "ts": _us(t - t0),
                    "args": {"held": nbytes if known else count},
                }
            )
    return events


def to_chrome_trace(timeline: Timeline, *, name: str = "pipecut") -> dict[str, Any]:
    """The timeline as Chrome trace-event JSON (open in https://ui.perfetto.dev or chrome://tracing).

    One thread track per rank (``tid = rank``) with an ``X`` event per action, named like
    ``1F3`` and carrying ``stage``, ``mb`` and ``kind``; a flow arrow (``s`` then ``f`` events,
    one ``id`` each) from the action that sent each message to the action that read it; and a
    counter track per rank (``C`` events) of the activations held: bytes when the timeline has
    ``activation_bytes``, else micro-batches. Times are microseconds from the timeline's start.

    Example:
        >>> spans = (Span(0, 0, "F", 0, 0.0, 1e-3), Span(1, 1, "F", 0, 2e-3, 3e-3))
        >>> t = Timeline(spans, (Message(0, 1, 1e-3, 2e-3, 0, 1, Kind.FORWARD, 0),))
        >>> events = to_chrome_trace(t)["traceEvents"]
        >>> [(e["ph"], e["name"], e["ts"]) for e in events if e["ph"] in "Xsf"]
        [('X', '0F0', 0.0), ('X', '1F0', 2000.0), ('s', 'act', 999.999), ('f', 'act', 2000.0)]
    """
    events = _track_events(timeline, name)
    events += _span_events(timeline)
    events += _flow_events(timeline)
    events += _counter_events(timeline)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def save_chrome_trace(timeline: Timeline, path: str | Path, *, name: str = "pipecut") -> Path:
    """Write :func:`to_chrome_trace` to ``path`` as JSON; returns the path."""
    out = Path(path)
    out.write_text(json.dumps(to_chrome_trace(timeline, name=name)))
    return out


# -- Gantt chart --------------------------------------------------------------------------------

_COLOURS = {F: "#4C72B0", B: "#C44E52", I: "#DD8452", W: "#55A868"}


def save_gantt_png(timeline: Timeline, path: str | Path, *, title: str | None = None) -> Path:
    """Draw the timeline as a Gantt chart (ranks as rows, rank 0 on top) and save it as a PNG.

    Each action is a bar coloured by kind and labelled like ``1F3`` where it is wide enough.
    Needs matplotlib, an optional dependency.

    Raises:
        MissingDependencyError: matplotlib is not installed; ``pip install matplotlib`` (an
            ``ImportError``).
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise MissingDependencyError(
            "save_gantt_png needs matplotlib, an optional dependency: pip install matplotlib "
            "(or export the timeline with save_chrome_trace and open it in ui.perfetto.dev)"
        ) from err
    step = timeline.step_time
    scale, unit = next(
        ((s, u) for s, u in ((1.0, "s"), (1e3, "ms"), (1e6, "us")) if step * s >= 1),
        (1e6, "us"),
    )
    p = max(timeline.num_ranks, 1)
    inches = min(4 + 0.25 * len(timeline.spans) / p, 40)  # about a quarter per action
    fig = Figure(figsize=(inches, 0.6 * p + 1.2))
    ax = fig.add_subplot()
    t0 = timeline.start
    for x in timeline.spans:
        left, width = (x.start - t0) * scale, x.duration * scale
        ax.barh(x.rank, width, left=left, height=0.8, color=_COLOURS[x.kind], edgecolor="white")
        # A label fits when the bar is wider than its text (about 0.07 inch a character).
        if step > 0 and x.duration / step * 0.85 * inches > 0.07 * len(x.label):
            ax.text(
                left + width / 2,
                x.rank,
                x.label,
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlabel(f"time ({unit})")
    kinds = sorted({x.kind for x in timeline.spans}, key="FBIW".index)
    ax.legend(
        handles=[Patch(color=_COLOURS[k], label=k.value) for k in kinds],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),  # above the axes, clear of the bars
        fontsize=7,
        ncols=max(len(kinds), 1),
        frameon=False,
    )
    ax.set_title(
        title or f"step {step * scale:.4g} {unit}, bubble {timeline.bubble_total:.1%}", loc="left"
    )
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    return out
