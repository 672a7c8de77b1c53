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

import math
from collections.abc import Sequence
from dataclasses import dataclass

from partitioner.schedule.actions import Action, Kind, Numbered
from partitioner.schedule.errors import SimulationError
from partitioner.schedule.ir import Schedule
from partitioner.schedule.timeline import Message, Span, Timeline
from partitioner.schedule.validation import validate_numbered

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

    def __post_init__(self) -> None:
        for field in ("forward", "backward_input", "backward_weight"):
            object.__setattr__(self, field, tuple(getattr(self, field)))
        for field in ("activation_bytes", "output_bytes", "replay_bytes"):
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
        return {
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
        timeline: every action's span on its rank and every message between ranks.
        step_time: the makespan, seconds.
        bubble: per rank, the fraction of the step it is idle.
        bubble_total: idle time over all ranks as a fraction of ``p * step_time``.
        peak_inflight: per rank, the most (stage, micro-batch) activations held at once, from
            an ``F``'s start to the end of its ``B`` or ``W``.
        peak_bytes: per rank, the most activation bytes held at once (``None`` without
            ``StageCosts.activation_bytes``).
    """

    timeline: Timeline
    step_time: float
    bubble: tuple[float, ...]
    bubble_total: float
    peak_inflight: tuple[int, ...]
    peak_bytes: tuple[float, ...] | None

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


class _Network:
    """When each result is there for each stage that reads it, and the messages that carried it.

    Results are by action id (``actions.number``); each is read on its own stage (``B``/``I``
    after ``F``, ``W`` after ``I``) and by at most one neighbour (``F`` by the next stage, ``B``
    and ``I`` by the previous), so slot ``2k`` says when result ``k`` is there for its own stage
    and slot ``2k + 1`` when it is there for that neighbour; ``None``: not yet.
    """

    def __init__(
        self, place: tuple[int, ...], links: tuple[Link, ...], out_bytes: tuple[float, ...], results: int
    ) -> None:
        self.place = place  # stage_to_rank
        self.links, self.out_bytes = links, out_bytes  # per boundary
        self.ready: list[float | None] = [None] * (2 * results + 2)  # the last two: never there
        self.link_free: dict[tuple[int, int], float] = {}  # (src rank, dst rank) -> when the link is idle
        self.messages: list[Message] = []
        # Per (stage, kind): the stage reading the result besides its own, or None.
        S = len(place)
        self.reader = {
            (s, kind): s + 1 if kind is F and s + 1 < S else s - 1 if kind in (B, I) and s > 0 else None
            for s in range(S)
            for kind in Kind
        }

    def deliver(self, a: Action, k: int, end: float) -> None:
        """``a`` (id ``k``) ended at ``end``: ready at once on its stage, on arrival at the stage across a link."""
        self.ready[2 * k] = end  # its own later actions (B/I after F, W after I)
        dst = self.reader[a.stage, a.kind]
        if dst is None:
            return
        src_rank, dst_rank = self.place[a.stage], self.place[dst]
        if src_rank == dst_rank:
            self.ready[2 * k + 1] = end
            return
        boundary = min(a.stage, dst)
        link, nbytes = self.links[boundary], self.out_bytes[boundary]
        leave = max(end, self.link_free.get((src_rank, dst_rank), 0.0))
        self.link_free[(src_rank, dst_rank)] = leave + nbytes / link.bandwidth
        arrive = leave + link.transfer_time(nbytes)
        self.ready[2 * k + 1] = arrive
        self.messages.append(Message(src_rank, dst_rank, end, arrive, a.stage, dst, a.kind, a.mb, nbytes))


def _run_lists(schedule: Schedule, costs: StageCosts, network: _Network, numbered: Numbered) -> list[Span]:
    """Run each rank's list in order, every action once its rank is free and its inputs are there.

    In passes over the ranks, ``0`` to ``p - 1``, each rank running as far as its inputs allow,
    until a pass moves nothing (a valid schedule never stalls all ranks). The order actions run
    in here decides which message takes a busy link first, so it is kept exactly; what is
    skipped is only looking at a rank that cannot move: a rank stopped at an input is parked
    on it and visited again when that input arrives, later in the same pass if its number is
    higher than the rank that sent it, else in the next pass. Linear in the actions, plus ``p``
    flags looked at per pass (about ``m v`` passes for the registry's schedules).
    """
    acts, ids = schedule.actions, numbered.ids
    # Per id, the slots of network.ready its inputs are read from (see _Network).
    stage = [a.stage for a in numbered.actions]
    slots = [
        tuple(2 * d + (d < numbered.missing and stage[d] != stage[k]) for d in reads)
        for k, reads in enumerate(numbered.reads)
    ]
    duration = {(s, kind): costs.duration(Action(s, kind, 0)) for s in range(schedule.num_stages) for kind in Kind}
    ready, deliver = network.ready, network.deliver
    spans: list[Span] = []
    pos, free = [0] * len(acts), [0.0] * len(acts)
    waiting: dict[int, list[int]] = {}  # slot -> ranks stopped until it is filled
    now = bytearray(b"\x01" * len(acts))  # per rank, whether this pass visits it
    nxt = bytearray(len(acts))  # and the next pass
    while any(now):
        for r in range(len(acts)):
            if not now[r]:
                continue
            now[r] = 0
            row, row_ids, i, end = acts[r], ids[r], pos[r], free[r]
            while i < len(row):
                a, k = row[i], row_ids[i]
                start = end
                for x in slots[k]:
                    t = ready[x]
                    if t is None:
                        waiting.setdefault(x, []).append(r)
                        break
                    if t > start:
                        start = t
                else:
                    end = start + duration[a.stage, a.kind]
                    spans.append(Span(r, a.stage, a.kind, a.mb, start, end))
                    deliver(a, k, end)
                    for x in (2 * k, 2 * k + 1):
                        if x in waiting:
                            for q in waiting.pop(x):  # later in this pass if q > r, else in the next
                                (now if q > r else nxt)[q] = 1
                    i += 1
                    continue
                break
            pos[r], free[r] = i, end
        now, nxt = nxt, now
    return spans


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
    numbered = validate_numbered(schedule)
    per_boundary = _boundary_links(schedule, costs, links)
    S, p = schedule.num_stages, schedule.num_ranks
    out_bytes = costs.output_bytes or (0.0,) * max(S - 1, 0)
    network = _Network(schedule.stage_to_rank, per_boundary, out_bytes, numbered.missing)
    spans = _run_lists(schedule, costs, network, numbered)
    timeline = Timeline(tuple(spans), tuple(network.messages), p, costs.activation_bytes, costs.replay_bytes)
    return Simulation(
        timeline=timeline,
        step_time=timeline.step_time,
        bubble=timeline.bubble,
        bubble_total=timeline.bubble_total,
        peak_inflight=timeline.peak_inflight,
        peak_bytes=timeline.peak_bytes,
    )
