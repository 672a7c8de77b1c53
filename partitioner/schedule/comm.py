"""The communication a schedule implies: each rank's actions with its sends and receives.

Legend: ``p`` ranks, ``S`` stages, ``s`` a stage, ``r`` a rank, ``mb`` a micro-batch.

Communication is not in the schedule IR: it follows from the actions and the placement, so it
can never disagree with them. :func:`comm_plan` derives each rank's ordered sends and receives.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from partitioner.schedule.actions import Action, Key, Kind
from partitioner.schedule.errors import ScheduleError
from partitioner.schedule.ir import Schedule
from partitioner.schedule.validation import validate

__all__ = ["Op", "Recv", "Send", "comm_plan", "grouped_program_finishes", "needs_early_receives"]

F, B, I, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT


@dataclass(frozen=True)
class _Transfer:
    """A hand-over of action ``{stage}{kind}{mb}``'s output between rank ``peer`` and this rank's ``to_stage``."""

    peer: int
    stage: int
    kind: Kind
    mb: int
    to_stage: int


@dataclass(frozen=True)
class Send(_Transfer):
    """Post the output of this rank's action ``{stage}{kind}{mb}`` for stage ``to_stage`` on rank ``peer``.

    ``F`` outputs activations (``to_stage > stage``); ``B`` and ``I`` output the gradients of
    their inputs (``to_stage < stage``). In ``runtime.transport.p2p`` terms this is the message
    ``Key(stage, to_stage, 'act' if kind is F else 'grad', mb)``.
    """

    def __str__(self) -> str:
        return f"send {self.stage}{self.kind.value}{self.mb} to stage {self.to_stage} on rank {self.peer}"


@dataclass(frozen=True)
class Recv(_Transfer):
    """Wait for the output of action ``{stage}{kind}{mb}`` of rank ``peer``, for local stage ``to_stage``."""

    def __str__(self) -> str:
        return f"recv {self.stage}{self.kind.value}{self.mb} for stage {self.to_stage} from rank {self.peer}"


Op = Action | Send | Recv
"""One entry of a rank's program in :func:`comm_plan`."""


def comm_plan(
    schedule: Schedule, *, edges: Iterable[tuple[int, int]] | None = None
) -> tuple[tuple[Op, ...], ...]:
    """Each rank's program: its actions with the sends and receives they imply, in running order.

    Activations flow along ``edges``, pairs ``(a, b)`` of stages with ``a < b`` where ``b`` reads
    an output of ``a``: the chain ``(s, s + 1)`` by default; a plan whose skip connections cross
    several stages at once adds those pairs. ``F`` of ``a`` sends to every ``b``; ``B`` or ``I`` of
    ``b`` sends input gradients back to every ``a``; ``W`` and the last stage's ``F`` send nothing.
    Stages on the same rank hand over locally (no op). Sends directly follow the action that
    produces them, in ascending ``to_stage``; the receives an action needs directly precede it, in
    ascending stage of the producer.

    The model under which a program cannot deadlock: sends are posted without waiting for the
    peer (buffered, e.g. ``isend`` waited at the end of the step) and receives block. Then a rank
    only ever waits for an input, exactly as :func:`validate` simulates, so a valid schedule
    cannot deadlock (its chain dependencies imply those of any forward ``edges``). Messages need no
    tags: between two ranks in one direction the k-th ``Recv`` matches the k-th ``Send``, as
    torch.distributed P2P pairs them. To keep that order a rank may receive a message early,
    before an action that does not read it, and hold it until the reader runs; GPipe and 1F1B
    never need that, so for them receiving lazily in action order is the same program.

    Where a send may wait for its receive (NCCL: a send kernel blocks its stream until the peer
    receives), post each run of consecutive ``Send``/``Recv`` between two actions as one
    ``batch_isend_irecv`` and wait for it; GPipe, 1F1B and ZB-H1 are tested deadlock-free that
    way, interleaved 1F1B and ZB-V are not (they need sends that never wait).

    Args:
        schedule: a valid schedule.
        edges: the stage pairs activations flow along; default the chain.

    Returns:
        Per rank, its ops: :class:`Action`, :class:`Send`, :class:`Recv`.

    Raises:
        ScheduleError: the schedule is invalid (see :func:`validate`), or an edge does not go
            forward between two of its stages.

    Example:
        >>> from partitioner.schedule.registry import get_schedule
        >>> for op in comm_plan(get_schedule("1f1b", 2, 2))[0]:
        ...     print(op)
        0F0
        send 0F0 to stage 1 on rank 1
        0F1
        send 0F1 to stage 1 on rank 1
        recv 1B0 for stage 0 from rank 1
        0B0
        recv 1B1 for stage 0 from rank 1
        0B1
    """
    validate(schedule)
    flow = _Flow.of(schedule, edges)
    channels = _channels(schedule, flow)
    return tuple(_program(schedule, r, flow, channels) for r in range(schedule.num_ranks))


@dataclass(frozen=True)
class _Flow:
    """Which stages read which: ``readers[a]`` read outputs of ``a``, ``feeders[b]`` feed ``b``."""

    readers: dict[int, list[int]]
    feeders: dict[int, list[int]]
    present: frozenset[Key]

    @classmethod
    def of(cls, schedule: Schedule, edges: Iterable[tuple[int, int]] | None) -> _Flow:
        """The flow along ``edges`` (default the chain), each checked to go forward."""
        S = schedule.num_stages
        flow = sorted(set(edges) if edges is not None else {(s, s + 1) for s in range(S - 1)})
        for a, b in flow:
            if not 0 <= a < b < S:
                raise ScheduleError(
                    f"edge {(a, b)} does not go forward between stages 0..{S - 1}; each edge (a, b) "
                    "says stage b reads an output of stage a, so a < b"
                )
        readers: dict[int, list[int]] = {s: [] for s in range(S)}
        feeders: dict[int, list[int]] = {s: [] for s in range(S)}
        for a, b in flow:  # sorted: each list ascending
            readers[a].append(b)
            feeders[b].append(a)
        return cls(readers, feeders, frozenset(a.key for row in schedule.actions for a in row))

    def grad_of(self, stage: int, mb: int) -> Key:
        """The action producing ``stage``'s input gradients: its ``I`` if the schedule splits, else ``B``."""
        return (stage, "I", mb) if (stage, "I", mb) in self.present else (stage, "B", mb)

    def inputs(self, x: Action) -> list[Key]:
        """The actions, remote or local, whose outputs ``x`` reads."""
        if x.kind is F:
            return [(a, "F", x.mb) for a in self.feeders[x.stage]]
        return [self.grad_of(b, x.mb) for b in self.readers[x.stage]] if x.kind in (B, I) else []

    def outputs(self, x: Action) -> list[int]:
        """The stages ``x`` sends its output to."""
        if x.kind is F:
            return self.readers[x.stage]
        return self.feeders[x.stage] if x.kind in (B, I) else []


def _channels(schedule: Schedule, flow: _Flow) -> dict[tuple[int, int], list[tuple[Action, int]]]:
    """Per (source rank, destination rank), the messages it carries in the order they are sent."""
    place = schedule.stage_to_rank
    channels: dict[tuple[int, int], list[tuple[Action, int]]] = {}
    for r, row in enumerate(schedule.actions):
        for x in row:
            for dst in flow.outputs(x):
                if place[dst] != r:
                    channels.setdefault((r, place[dst]), []).append((x, dst))
    return channels


def _program(
    schedule: Schedule, r: int, flow: _Flow, channels: dict[tuple[int, int], list[tuple[Action, int]]]
) -> tuple[Op, ...]:
    """Rank ``r``'s ops: each action, the receives it needs first (earlier messages of a channel
    before later ones), and its sends after it."""
    place = schedule.stage_to_rank
    ops: list[Op] = []
    taken: dict[int, int] = {}  # per source rank, how many of its messages r has received
    got: set[tuple[Key, int]] = set()
    for x in schedule.actions[r]:
        for src in flow.inputs(x):
            q = place[src[0]]
            while q != r and (src, x.stage) not in got:  # earlier messages come first
                k = taken.get(q, 0)
                y, dst = channels[(q, r)][k]
                taken[q] = k + 1
                got.add((y.key, dst))
                ops.append(Recv(q, y.stage, y.kind, y.mb, dst))
        ops.append(x)
        ops += [Send(place[d], x.stage, x.kind, x.mb, d) for d in flow.outputs(x) if place[d] != r]
    return tuple(ops)


def needs_early_receives(
    schedule: Schedule, *, edges: Iterable[tuple[int, int]] | None = None
) -> bool:
    """Whether some rank reads a peer's messages in another order than the peer sends them.

    Then :func:`comm_plan` receives a message early, before an action that does not read it.
    Transports that match messages by tag (``DistTransport`` on gloo) do not care; those that
    match them in posting order (NCCL) need the program's order. GPipe, 1F1B and ZB-H1 never
    need early receives; ZB-V does once ``m > p >= 2``, and interleaved 1F1B for some ``(p, m)``
    (e.g. ``p = 2`` with odd ``m >= 5``).

    Args:
        schedule: a valid schedule.
        edges: the stage pairs activations flow along, as for :func:`comm_plan`.

    Example:
        >>> from partitioner.schedule.registry import get_schedule
        >>> needs_early_receives(get_schedule("zbh1", 4, 8)), needs_early_receives(get_schedule("zbv", 2, 4))
        (False, True)
    """
    for ops in comm_plan(schedule, edges=edges):
        reader: Action | None = None  # the next action after each op, found walking backwards
        for op in reversed(ops):
            if isinstance(op, Action):
                reader = op
            elif isinstance(op, Recv):
                reads = reader is not None and (reader.stage, reader.mb, reader.kind is F) == (
                    op.to_stage, op.mb, op.kind is F)
                if not reads:
                    return True
    return False


def grouped_program_finishes(
    schedule: Schedule, *, edges: Iterable[tuple[int, int]] | None = None
) -> bool:
    """Whether :func:`comm_plan`'s program finishes when sends wait for their receives.

    The model of NCCL as ``DistTransport`` drives it (``groups_messages``): each run of sends and
    receives between two actions of a rank is posted as one group and waited on as a whole, and
    a send completes only once its receive is posted. A group therefore completes when every
    peer it exchanges with has reached the group holding the matching op. GPipe, 1F1B and ZB-H1
    finish on a chain; skip connections over several stages (``edges``) can make 1F1B and
    ZB-H1 wait in a circle (``p >= 3``), and interleaved and ZB-V fail even on a chain.

    Args:
        schedule: a valid schedule.
        edges: the stage pairs activations flow along, as for :func:`comm_plan`.

    Example:
        >>> from partitioner.schedule.registry import get_schedule
        >>> chain = [(0, 1), (1, 2), (2, 3)]
        >>> grouped_program_finishes(get_schedule("1f1b", 4, 8), edges=chain)
        True
        >>> grouped_program_finishes(get_schedule("1f1b", 4, 8), edges=[*chain, (0, 3)])
        False
    """
    plans = comm_plan(schedule, edges=edges)
    # Per rank, its groups; per op, where its partner op sits: (rank, group index).
    group_of: dict[tuple[int, int, int, int], tuple[int, int]] = {}  # (src, dst, k, is_send) -> (rank, group)
    sent: dict[tuple[int, int], int] = {}
    got: dict[tuple[int, int], int] = {}
    members: list[list[list[tuple[int, int, int, int]]]] = []
    for r, ops in enumerate(plans):
        groups: list[list[tuple[int, int, int, int]]] = []
        open_group = False
        for op in ops:
            if isinstance(op, Action):
                open_group = False
                continue
            if not open_group:
                groups.append([])
                open_group = True
            src, dst = (r, op.peer) if isinstance(op, Send) else (op.peer, r)
            count = sent if isinstance(op, Send) else got
            k = count.get((src, dst), 0)
            count[(src, dst)] = k + 1
            me = (src, dst, k, int(isinstance(op, Send)))
            groups[-1].append(me)
            group_of[me] = (r, len(groups) - 1)
        members.append(groups)
    done = [0] * len(plans)  # per rank, how many of its groups completed
    progress = True
    while progress:
        progress = False
        for r, groups in enumerate(members):
            while done[r] < len(groups):
                ready = all(
                    done[q] >= g
                    for src, dst, k, is_send in groups[done[r]]
                    for q, g in [group_of[(src, dst, k, 1 - is_send)]]
                )
                if not ready:
                    break
                done[r] += 1
                progress = True
    return all(done[r] == len(groups) for r, groups in enumerate(members))
