"""Pipelined decoding: the sequences split into groups, each rank running whichever group's step reached it.

Legend: ``p`` pipeline ranks, ``r`` a rank's position, ``G`` groups, ``g`` a group, ``B`` sequences
(``B_g`` in group ``g``), ``T0`` the padded prompt length, ``n`` new tokens.

With one group in flight a pipeline of ``p`` ranks has one rank working at a time (the others wait
for its hidden states, or for the tokens to come back): what running the stages one after another
on ``p`` devices does. Split into ``G >= p`` groups, the first rank starts group 1's step while
rank 1 runs group 0's, and so on round the ring: every rank is busy once ``p`` groups are in flight.

Every rank runs the same program, :func:`run_rank`, on its own stages: it takes the groups in a
fixed round (0, 1, ..., G - 1, 0, 1, ...), dropping a group from the round when it ends. The
first rank runs a group's step once that group's tokens from its previous step are back (the
prefill needs none), chooses whether the group goes on (each sequence's stop), and sends the
hidden states on; each later rank receives, runs, sends; the last chooses the next tokens and
sends them to the first. Because every rank keeps the same round, a rank always waits for the
message that comes next on its link: nothing can wait in a circle.

Each group has its own :class:`~runtime.generate.stage.StageRunner` per stage, so its own
``DynamicCache`` per stage. A group is a slice of the batch left-padded together (the same
``T0`` as one group would have), and each sequence samples from its own seeded generator, so the
tokens are the same whatever the group count, the transport and the stage count.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from runtime.generate.cut import StageSpan
from runtime.generate.errors import GenerateOptionError
from runtime.generate.parts import DecoderParts
from runtime.generate.ring import Ring
from runtime.generate.sampling import Sampling, next_tokens, sequence_generators
from runtime.generate.stage import Hop, StageRunner

__all__ = ["Batch", "Step", "GroupResult", "GroupState", "split_groups", "run_rank"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Batch:
    """The padded prompts and the options every rank needs: the same on every rank.

    Attributes:
        ids: (B, T0) left-padded prompt ids.
        mask: (B, T0) 1 on tokens, 0 on left padding.
        positions: (B, T0) each token's position in its sequence.
        limits: (B,) each sequence's ``max_new_tokens``.
        eos: the end-of-sequence ids.
        pad: what a stopped sequence gets after its stop.
        sampling: ``None`` for greedy decoding.
        output_logits: whether the last rank sends each step's logits back too.
    """

    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    limits: torch.Tensor
    eos: tuple[int, ...]
    pad: int
    sampling: Sampling | None
    output_logits: bool


@dataclass(frozen=True)
class Step:
    """One step a rank ran for a group: for the record of what ran when (``Generation.timeline``).

    Attributes:
        rank: the pipeline position ``r`` (with replicas, the global rank is ``replica * p + r``).
        group: the group ``g``.
        step: the group's step (0 is its prefill).
        start, end: ``time.time()`` around the rank's stages (comparable across processes of one host).
    """

    rank: int
    group: int
    step: int
    start: float
    end: float


@dataclass(frozen=True)
class GroupResult:
    """What the first rank knows of a group at its end.

    Attributes:
        rows: the group's sequences' indices in the batch.
        tokens: (B_g, n_g) the tokens chosen at each of its steps (``pad`` after a sequence's stop).
        logits: with ``output_logits``, each step's logits (B_g, V); else empty.
    """

    rows: range
    tokens: torch.Tensor
    logits: tuple[torch.Tensor, ...]


def split_groups(b: int, groups: int) -> list[range]:
    """``b`` sequences as ``groups`` contiguous groups of nearly equal size (the first ones larger).

    Raises:
        GenerateOptionError: ``groups`` below 1.

    Example:
        >>> split_groups(7, 3)
        [range(0, 3), range(3, 5), range(5, 7)]
        >>> split_groups(2, 4)  # never an empty group
        [range(0, 1), range(1, 2)]
    """
    if not isinstance(groups, int) or groups < 1:
        raise GenerateOptionError(f"groups must be an int >= 1, got {groups!r}")
    g = min(groups, b)
    size, extra = divmod(b, g)
    out, start = [], 0
    for i in range(g):
        stop = start + size + (i < extra)
        out.append(range(start, stop))
        start = stop
    return out


def run_rank(
    ring: Ring, parts: DecoderParts, spans: Sequence[StageSpan], batch: Batch, groups: Sequence[range],
    timeline: list[Step], clock: Callable[[], float] = time.time,
) -> dict[int, GroupResult]:
    """Run this rank's part of generating ``batch`` in ``groups``; the first rank returns every group's tokens.

    Args:
        ring: this rank's messages.
        parts: the model's parts.
        spans: this rank's stages, in order (a contiguous run of the plan's).
        batch: the prompts and options (the same on every rank).
        groups: the groups' rows (:func:`split_groups`).
        timeline: each step this rank runs is appended to it.
        clock: the time source of ``timeline``.

    Returns:
        On the first rank, each group's :class:`GroupResult` by group index; elsewhere ``{}``.

    Raises:
        TransportTimeout: a message did not come within the transport's timeout (``PeerFailed``
            when another rank failed first).
    """
    runners = {g: [StageRunner(parts, span) for span in spans] for g in range(len(groups))}
    for stages in runners.values():
        for stage in stages:
            stage.reset()
    device = batch.ids.device
    generators = {}
    if ring.last and batch.sampling is not None:
        generators = {g: sequence_generators(batch.sampling, rows, device) for g, rows in enumerate(groups)}
    state = {g: GroupState(batch, rows) for g, rows in enumerate(groups)} if ring.first else {}
    steps = dict.fromkeys(range(len(groups)), 0)
    round_ = deque(range(len(groups)))
    while round_:
        g = round_.popleft()
        rows = len(groups[g])
        if ring.first:
            hop = state[g].next_hop(ring, g, batch) if steps[g] else state[g].prefill()
        else:
            hop = ring.recv_hop(g, rows)
        if hop is None:  # the group has ended: tell the next rank, and leave it out of the round
            if not ring.last:
                ring.send_hop(g, None)
            continue
        start = clock()
        out = hop
        for stage in runners[g]:
            out = stage(out)
        timeline.append(Step(ring.position, g, steps[g], start, clock()))
        steps[g] += 1
        if ring.last:
            ring.send_tokens(g, next_tokens(out.data, batch.sampling, generators.get(g, ())),
                             out.data if batch.output_logits else None)
        else:
            ring.send_hop(g, out)
        round_.append(g)
    return {g: s.result() for g, s in state.items()}


class GroupState:
    """The first rank's view of one group: its mask, positions, stops and tokens so far."""

    def __init__(self, batch: Batch, rows: range) -> None:
        self.rows = rows
        sl = slice(rows.start, rows.stop)
        self.ids, self.mask, self.positions = batch.ids[sl], batch.mask[sl], batch.positions[sl]
        self.limits = batch.limits[sl]
        self.unfinished = self.limits > 0
        self.eos = torch.tensor(batch.eos, dtype=torch.long, device=batch.ids.device)
        self.tokens: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.last_positions = self.positions[:, -1:]

    def prefill(self) -> Hop | None:
        return Hop(self.ids, self.positions, self.mask) if bool(self.unfinished.any()) else None

    def next_hop(self, ring: Ring, g: int, batch: Batch) -> Hop | None:
        tokens, logits = ring.recv_tokens(g, len(self.rows), batch.output_logits)
        return self.advance(tokens, logits, batch.pad)

    def advance(self, tokens: torch.Tensor, logits: torch.Tensor | None, pad: int) -> Hop | None:
        """Take the last stage's chosen ``tokens`` (and ``logits``): the next hop, or ``None`` once all stopped."""
        if logits is not None:
            self.logits.append(logits)
        chosen = torch.where(self.unfinished, tokens, pad)
        self.tokens.append(chosen)
        self.unfinished &= ~torch.isin(chosen, self.eos) & (self.limits > len(self.tokens))
        if not bool(self.unfinished.any()):
            return None
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=1)
        self.last_positions = self.last_positions + 1
        return Hop(chosen[:, None], self.last_positions, self.mask)

    def result(self) -> GroupResult:
        tokens = torch.stack(self.tokens, 1) if self.tokens else self.ids.new_zeros(len(self.rows), 0)
        return GroupResult(self.rows, tokens, tuple(self.logits))
