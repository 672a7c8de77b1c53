"""Predict a step: run a schedule against per-stage compute times and link costs, get its timeline.

Legend: ``p`` ranks, ``m`` micro-batches, ``S`` stages, ``s`` a stage, ``r`` a rank, ``mb`` a
micro-batch; boundary ``s`` is the cut between stages ``s`` and ``s + 1``. Times in seconds,
sizes in bytes.

The model: each rank runs its action list in order, one action at a time. An action starts when
its rank is free and every result it reads (``partitioner.schedule.ir.dependencies``) is there: at
once for a stage on the same rank, on arrival for one on another rank. Sends do not block the
rank: a message leaves when its producer ends and occupies the link between the two ranks (one
per direction) for ``bytes / bandwidth``, in the order the sender produced them, then arrives
``latency`` later. ``B`` costs ``b + w``: a fused backward does both parts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from partitioner.schedule.actions import KIND_CODE, Action, Kind, Numbered
from partitioner.schedule.errors import SimulationError
from partitioner.schedule.ir import Schedule
from partitioner.schedule.timeline import Message, Span, Timeline
from partitioner.schedule.validation import record_deadlock_free, validate, validate_numbered

__all__ = ["Link", "Simulation", "SimulationError", "StageCosts", "simulate"]

F, B, I, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT



def _check_value(name: str, x: object, *, positive: bool = False) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x) or x < 0:
        raise SimulationError(f"{name} = {x!r}: use a number >= 0")
    if positive and x == 0:
        raise SimulationError(f"{name} = {x!r}: use a number > 0 (math.inf for free)")
    if not positive and math.isinf(x):
        raise SimulationError(f"{name} = {x!r}: use a finite number")


def _check(name: str, values: Sequence[float], count: int, per: str = "stage") -> None:
    if len(values) != count:
        raise SimulationError(f"{name} has {len(values)} entries but needs {count}, one per {per}")
    for i, x in enumerate(values):
        _check_value(f"{name}[{i}]", x)


@dataclass(frozen=True)
class StageCosts:
    """What each stage costs per micro-batch.

    Attributes:
        forward: ``f[s]``, seconds for stage ``s``'s forward.
        backward_input: ``b[s]``, seconds for its backward to the inputs (``I``).
        backward_weight: ``w[s]``, seconds for its backward to the weights (``W``); a fused
            ``B`` costs ``b[s] + w[s]``.
        activation_bytes: per stage, bytes one micro-batch's activations hold (memory), if known.
        output_bytes: per boundary ``s`` (``S - 1`` entries), bytes of activations stage ``s``
            sends stage ``s + 1``; their gradient, sent back, is as large. Default: 0.
        replay_bytes: per stage, bytes held on top of ``activation_bytes`` from a micro-batch's
            first backward action to its last: what a recomputing stage rebuilds (then its
            ``activation_bytes`` are only its inputs, and its ``backward_input`` includes the
            forward it runs again). ``None``: no stage recomputes.
        action_overhead: seconds every action of the stage costs on top of its work, whatever its
            kind (the runtime's scheduling, stashing and posting of sends: a fused ``B`` pays it
            once, ``I`` and ``W`` once each). Default: 0.

    Example:
        >>> StageCosts.uniform(2, forward=1.0, backward_input=2.0, output_bytes=8e6).output_bytes
        (8000000.0,)
    """

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    activation_bytes: tuple[float, ...] | None = None
    output_bytes: tuple[float, ...] | None = None
    replay_bytes: tuple[float, ...] | None = None
    action_overhead: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for field in ("forward", "backward_input", "backward_weight"):
            object.__setattr__(self, field, tuple(getattr(self, field)))
        for field in ("activation_bytes", "output_bytes", "replay_bytes", "action_overhead"):
            if getattr(self, field) is not None:
                object.__setattr__(self, field, tuple(getattr(self, field)))
        S = len(self.forward)
        _check("forward", self.forward, S)
        _check("backward_input", self.backward_input, S)
        _check("backward_weight", self.backward_weight, S)
        if self.activation_bytes is not None:
            _check("activation_bytes", self.activation_bytes, S)
        if self.replay_bytes is not None:
            _check("replay_bytes", self.replay_bytes, S)
        if self.action_overhead is not None:
            _check("action_overhead", self.action_overhead, S)
        if self.output_bytes is not None:
            _check("output_bytes", self.output_bytes, max(S - 1, 0), "boundary between stages")

    @property
    def num_stages(self) -> int:
        """``S``."""
        return len(self.forward)

    @classmethod
    def uniform(
        cls,
        num_stages: int,
        *,
        forward: float = 1.0,
        backward_input: float = 1.0,
        backward_weight: float = 1.0,
        activation_bytes: float | None = None,
        output_bytes: float = 0.0,
    ) -> StageCosts:
        """Every stage the same: ``num_stages`` copies of each cost (``S - 1`` of ``output_bytes``)."""
        S = num_stages
        return cls(
            (forward,) * S,
            (backward_input,) * S,
            (backward_weight,) * S,
            None if activation_bytes is None else (activation_bytes,) * S,
            (output_bytes,) * max(S - 1, 0),
        )

    def duration(self, action: Action) -> float:
        """Seconds ``action`` takes."""
        s = action.stage
        extra = self.action_overhead[s] if self.action_overhead is not None else 0.0
        return extra + {
            F: self.forward[s],
            I: self.backward_input[s],
            W: self.backward_weight[s],
            B: self.backward_input[s] + self.backward_weight[s],
        }[action.kind]


@dataclass(frozen=True)
class Link:
    """A link between two ranks: a message of ``n`` bytes takes ``latency + n / bandwidth`` seconds.

    The link carries one message at a time per direction for ``n / bandwidth``; ``latency`` is
    added after, without holding the link. For a flat seconds-per-message cost, give it as
    ``latency`` with the default infinite bandwidth.

    Example:
        >>> Link(latency=5e-6, bandwidth=25e9).transfer_time(50e6)
        0.002005
    """

    latency: float = 0.0
    bandwidth: float = math.inf

    def __post_init__(self) -> None:
        _check_value("latency", self.latency)
        _check_value("bandwidth", self.bandwidth, positive=True)

    def transfer_time(self, nbytes: float) -> float:
        """Seconds from send to arrival for ``nbytes`` on an idle link."""
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Simulation:
    """A predicted step.

    Attributes:
        step_time: the makespan, seconds.
        bubble: per rank, the fraction of the step it is idle.
        bubble_total: idle time over all ranks as a fraction of ``p * step_time``.
        peak_inflight: per rank, the most (stage, micro-batch) activations held at once, from
            an ``F``'s start to the end of its ``B`` or ``W``.
        peak_bytes: per rank, the most activation bytes held at once (``None`` without
            ``StageCosts.activation_bytes``).
        busy: per rank, the seconds spent running actions.

    The metrics are counted during the run; :attr:`timeline`, every span and message, is built
    only when asked for (a step of ``64 x 4096`` holds about a million), and its metrics are
    the same numbers, bit for bit.
    """

    step_time: float
    bubble: tuple[float, ...]
    bubble_total: float
    peak_inflight: tuple[int, ...]
    peak_bytes: tuple[float, ...] | None
    busy: tuple[float, ...]
    _run: _Run = dataclasses.field(repr=False, compare=False)

    @cached_property
    def timeline(self) -> Timeline:
        """Every action's span on its rank and every message between ranks."""
        return self._run.timeline()

    @cached_property
    def grads_ready(self) -> tuple[float, ...]:
        """Per stage, when its last backward action (``B`` or ``W``) ends: from then on its
        gradients are final and the data-parallel exchange may take them. Seconds from the
        step's start, like ``step_time``; ``0.0`` for a stage without backward."""
        run = self._run
        acts, ready, S = run.numbered.actions, run.ready, run.schedule.num_stages
        first = min((run.start[row[0]] for row in run.numbered.ids if row), default=0.0)
        out = [first] * S
        for k, a in enumerate(acts):
            if a.kind is B or a.kind is W:
                end = ready[2 * k]
                assert end is not None  # every action ran
                if end > out[a.stage]:
                    out[a.stage] = end
        return tuple(t - first for t in out)

    @property
    def max_peak_bytes(self) -> float | None:
        """The largest per-rank peak: the activation memory the fullest device needs."""
        return None if self.peak_bytes is None else max(self.peak_bytes, default=0.0)


def _boundary_links(
    schedule: Schedule, costs: StageCosts, links: Link | Sequence[Link] | None
) -> tuple[Link, ...]:
    """The link at each boundary, after checking that the costs and links fit the schedule's stages."""
    S = schedule.num_stages
    if costs.num_stages != S:
        raise SimulationError(
            f"costs are for {costs.num_stages} stages but schedule {schedule.name!r} has {S}; "
            "build StageCosts with one entry per stage"
        )
    if links is None or isinstance(links, Link):
        return (links or Link(),) * max(S - 1, 0)
    per_boundary = tuple(links)
    if len(per_boundary) != S - 1 or not all(isinstance(x, Link) for x in per_boundary):
        raise SimulationError(
            f"links has {len(per_boundary)} entries but the schedule has {S - 1} boundaries "
            "between stages; give one Link per boundary, or a single Link for all"
        )
    return per_boundary


# Per (stage, kind), what happens to the result of one of its actions when it ends.
_OWN, _SAME_RANK, _ACROSS = 0, 1, 2  # read on its own stage only; also by a stage on its rank; sent


@dataclass(frozen=True)
class _Classes:
    """Per class ``c = 4 s + kind code`` (stage ``s``), what :func:`_run` needs of its actions.

    Results are by action id (``actions.number``); each is read on its own stage (``B``/``I``
    after ``F``, ``W`` after ``I``) and by at most one neighbour (``F`` by the next stage, ``B``
    and ``I`` by the previous), so slot ``2k`` of the run's ``ready`` list says when result
    ``k`` is there for its own stage and slot ``2k + 1`` when it is there for that neighbour.
    """

    duration: tuple[float, ...]
    route: tuple[int, ...]  # _OWN, _SAME_RANK or _ACROSS
    reader: tuple[int | None, ...]  # the neighbour stage reading the result
    link: tuple[int, ...]  # for _ACROSS: the directed link's index (one per (src rank, dst rank))
    occupy: tuple[float, ...]  # seconds the message holds its link: bytes / bandwidth
    transfer: tuple[float, ...]  # seconds from leaving to arriving: Link.transfer_time(bytes)
    nbytes: tuple[float, ...]


def _classes(schedule: Schedule, costs: StageCosts, links: tuple[Link, ...], out_bytes: tuple[float, ...]) -> _Classes:
    S, place = schedule.num_stages, schedule.stage_to_rank
    link_ids: dict[tuple[int, int], int] = {}  # (src rank, dst rank) -> its index, 0.. in first use
    rows = []
    for s in range(S):
        for kind in Kind:  # in KIND_CODE order
            dst = s + 1 if kind is F and s + 1 < S else s - 1 if kind in (B, I) and s > 0 else None
            route, key, occupy, transfer, nbytes = _OWN, -1, 0.0, 0.0, 0.0
            if dst is not None and place[dst] == place[s]:
                route = _SAME_RANK
            elif dst is not None:
                boundary = min(s, dst)
                link, nbytes = links[boundary], out_bytes[boundary]
                route, key = _ACROSS, link_ids.setdefault((place[s], place[dst]), len(link_ids))
                occupy, transfer = nbytes / link.bandwidth, link.transfer_time(nbytes)
            rows.append((costs.duration(Action(s, kind, 0)), route, dst, key, occupy, transfer, nbytes))
    columns = tuple(zip(*rows)) if rows else ((),) * 7
    return _Classes(*columns)


@dataclass(frozen=True)
class _Run:
    """What :func:`_run` found: per action id when it started and when its result was where."""

    schedule: Schedule
    numbered: Numbered
    classes: _Classes
    cls: list[int]  # per id, its class
    start: list[float]  # per id
    ready: list[float | None]  # per slot (see _Classes): slot 2k is action k's end
    order: list[int]  # ids in the order they ran (which message took a busy link first)
    activation_bytes: tuple[float, ...] | None
    replay_bytes: tuple[float, ...] | None

    def timeline(self) -> Timeline:
        """The spans and messages of the run."""
        acts, start, ready, cls, c = self.numbered.actions, self.start, self.ready, self.cls, self.classes
        place = self.schedule.stage_to_rank
        spans = []
        for r, row in enumerate(self.numbered.ids):
            for k in row:
                a = acts[k]
                spans.append(Span(r, a.stage, a.kind, a.mb, start[k], ready[2 * k]))  # type: ignore[arg-type]
        messages = []
        for k in self.order:
            j = cls[k]
            if c.route[j] == _ACROSS:
                a, dst = acts[k], c.reader[j]
                assert dst is not None  # _ACROSS has a reader
                messages.append(Message(place[a.stage], place[dst], ready[2 * k], ready[2 * k + 1],  # type: ignore[arg-type]
                                        a.stage, dst, a.kind, a.mb, c.nbytes[j]))
        p = self.schedule.num_ranks
        return Timeline(tuple(spans), tuple(messages), p, self.activation_bytes, self.replay_bytes)


def _run(schedule: Schedule, costs: StageCosts, links: tuple[Link, ...], numbered: Numbered) -> _Run:
    """Run each rank's list in order, every action once its rank is free and its inputs are there.

    In passes over the ranks, ``0`` to ``p - 1``, each rank running as far as its inputs allow,
    until a pass moves nothing (a valid schedule never stalls all ranks). The order actions run
    in here decides which message takes a busy link first, so it is kept exactly; what is
    skipped is only looking at a rank that cannot move: a rank stopped at an input is parked
    on it and visited again when that input arrives, later in the same pass if its number is
    higher than the rank that sent it, else in the next pass. Linear in the actions, plus ``p``
    flags looked at per pass (about ``m v`` passes for the registry's schedules). Per action it
    only reads and writes lists: the spans and messages are built after, if asked for.
    """
    S, p, K = schedule.num_stages, schedule.num_ranks, numbered.missing
    out_bytes = costs.output_bytes or (0.0,) * max(S - 1, 0)
    c = _classes(schedule, costs, links, out_bytes)
    ids, acts = numbered.ids, numbered.actions
    cls = [4 * a.stage + KIND_CODE[a.kind._value_] for a in acts]
    # Per id, the slots of ``ready`` its inputs are read from (``actions.dependency_keys``): an
    # ``F`` reads the previous stage's ``F`` (across); a ``W`` its own ``I``; a ``B`` or ``I`` its
    # own ``F``, then the next stage's gradient (across) unless it is the last stage.
    slots = [
        ((2 * rd[0] + 1,) if a.kind is F else (2 * rd[0],) if len(rd) == 1 else (2 * rd[0], 2 * rd[1] + 1))
        if rd else ()
        for a, rd in zip(acts, numbered.reads)
    ]
    duration, route, link_of, occupy, transfer = c.duration, c.route, c.link, c.occupy, c.transfer
    ready: list[float | None] = [None] * (2 * K + 2)  # the last two: a result no action makes, never there
    start = [0.0] * K
    order: list[int] = []
    link_free = [0.0] * (1 + max(c.link, default=0))  # per directed link, when it is next idle
    pos, free = [0] * p, [0.0] * p
    waiting: dict[int, list[int]] = {}  # slot -> ranks stopped until it is filled
    now = bytearray(b"\x01" * p)  # per rank, whether this pass visits it
    nxt = bytearray(p)  # and the next pass
    while any(now):
        for r in range(p):
            if not now[r]:
                continue
            now[r] = 0
            row, i, end = ids[r], pos[r], free[r]
            while i < len(row):
                k = row[i]
                begin = end
                for x in slots[k]:
                    t = ready[x]
                    if t is None:
                        waiting.setdefault(x, []).append(r)
                        break
                    if t > begin:
                        begin = t
                else:
                    j = cls[k]
                    end = begin + duration[j]
                    start[k] = begin
                    ready[2 * k] = end
                    order.append(k)
                    how = route[j]
                    if how == _SAME_RANK:
                        ready[2 * k + 1] = end
                    elif how == _ACROSS:
                        key = link_of[j]
                        idle = link_free[key]
                        leave = idle if idle > end else end
                        link_free[key] = leave + occupy[j]
                        ready[2 * k + 1] = leave + transfer[j]
                    if waiting:
                        for x in (2 * k, 2 * k + 1):
                            if x in waiting:
                                for q in waiting.pop(x):  # later in this pass if q > r, else in the next
                                    (now if q > r else nxt)[q] = 1
                    i += 1
                    continue
                break
            pos[r], free[r] = i, end
        now, nxt = nxt, now
    if any(pos[r] < len(ids[r]) for r in range(p)):
        validate(schedule)  # stalled: the lists deadlock, and validate says where
        raise SimulationError(f"schedule {schedule.name!r} stalled at positions {pos} but validates")
    record_deadlock_free(schedule, numbered)
    return _Run(schedule, numbered, c, cls, start, ready, order, costs.activation_bytes, costs.replay_bytes)


def _metrics(run: _Run) -> Simulation:
    """The step's metrics from the run, as :class:`~partitioner.schedule.timeline.Timeline` computes them.

    Per rank, in its running order: busy time summed span by span, and the activations held,
    counted as ``Timeline.memory`` does (held from an ``F``'s start to the end of the
    micro-batch's last backward action, ``B`` or ``W``, plus replayed bytes from its first ``B``
    or ``I``). A rank's running order is its span order, and its memory changes in that order
    too, so the sums are the same floating-point operations in the same order: equal bits.
    """
    schedule, numbered, start, ready = run.schedule, run.numbered, run.start, run.ready
    acts, S, p = numbered.actions, schedule.num_stages, schedule.num_ranks
    act, replay = run.activation_bytes, run.replay_bytes
    busy, peak_count, peak_bytes = [0.0] * p, [0] * p, [0.0] * p
    first, last = math.inf, -math.inf
    for r, row in enumerate(numbered.ids):
        if not row:
            continue
        total, count, nbytes = 0.0, 0, 0.0
        # One point per change of the memory curve; a forward-only run holds nothing: no points.
        top_count, top_bytes, points = 0, 0.0, False
        replayed: set[int] = set()
        for k in row:
            begin, end = start[k], ready[2 * k]
            assert end is not None  # every action ran
            total += end - begin
            if schedule.forward_only:
                continue
            a = acts[k]
            kind, s = a.kind, a.stage
            if kind is F:
                count += 1
                nbytes += act[s] if act else 0.0
            else:
                key = a.mb * S + s
                extra = replay[s] if replay and act else 0.0
                if extra and kind is not W and key not in replayed:  # B or I rebuilds the activations
                    replayed.add(key)
                    nbytes += extra
                    top_bytes = nbytes if not points or nbytes > top_bytes else top_bytes
                    top_count = count if not points or count > top_count else top_count
                    points = True
                if kind is I:
                    continue
                count -= 1  # B or W: the micro-batch's last backward action frees it
                nbytes += -((act[s] if act else 0.0) + (extra if key in replayed else 0.0))
            top_bytes = nbytes if not points or nbytes > top_bytes else top_bytes
            top_count = count if not points or count > top_count else top_count
            points = True
        busy[r], peak_count[r], peak_bytes[r] = total, top_count, top_bytes
        end = ready[2 * row[-1]]
        assert end is not None
        first, last = min(first, start[row[0]]), max(last, end)
    step = last - first if last >= first else 0.0
    bubble = tuple(1.0 - b / step if step > 0 else 0.0 for b in busy)
    bubble_total = 1.0 - sum(busy) / (p * step) if step > 0 and p else 0.0
    return Simulation(step, bubble, bubble_total, tuple(peak_count), None if act is None else tuple(peak_bytes),
                      tuple(busy), run)


def simulate(
    schedule: Schedule,
    costs: StageCosts,
    *,
    links: Link | Sequence[Link] | None = None,
) -> Simulation:
    """Run ``schedule`` under ``costs`` and ``links``; see the module docstring for the model.

    Args:
        schedule: a valid schedule.
        costs: per-stage times (and sizes); ``costs.num_stages`` must equal the schedule's ``S``.
        links: the link at each boundary ``s`` (``S - 1`` entries), or one for all; ``None``
            makes communication free. Boundaries within one rank cost nothing whatever is given.

    Returns:
        The predicted step.

    Raises:
        ScheduleError: the schedule is invalid (see ``partitioner.schedule.validation.validate``).
        SimulationError: the costs or links do not match the schedule's stages.

    Example:
        >>> from partitioner.schedule.registry import get_schedule
        >>> sim = simulate(get_schedule("1f1b", 4, 8), StageCosts.uniform(4, backward_weight=0.0))
        >>> sim.step_time, round(sim.bubble_total, 4)   # (m + p - 1)(F + B), (p - 1) / (m + p - 1)
        (22.0, 0.2727)
    """
    numbered = validate_numbered(schedule, deadlock=False)  # the run below proves it cannot deadlock
    return _metrics(_run(schedule, costs, _boundary_links(schedule, costs, links), numbered))
