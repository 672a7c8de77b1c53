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
from runtime.generate.ring import PIECE_STRIDE, Ring
from runtime.generate.sampling import Sampling, kept_generators, next_tokens, sequence_generators
from runtime.generate.stage import Hop, StageRunner

__all__ = ["Batch", "Step", "GroupResult", "GroupState", "split_groups", "chunk_groups", "run_rank"]

log = logging.getLogger(__name__)

MAX_CHUNKED_GROUPS = PIECE_STRIDE  # a piece's message keys sit PIECE_STRIDE groups apart (runtime.generate.ring)


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
        prefill_chunk: prompt positions per prefill hop (``None``: the whole padded prompt in one).
            A group's prompt then enters the pipeline in pieces, the first rank sending the next
            piece without waiting for any token, so the second rank starts after one piece, not
            after the whole prompt: the pipeline fills sooner.
    """

    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    limits: torch.Tensor
    eos: tuple[int, ...]
    pad: int
    sampling: Sampling | None
    output_logits: bool
    prefill_chunk: int | None = None

    def prefill_pieces(self) -> list[slice]:
        """The prompt positions each prefill hop carries, in order (one slice without ``prefill_chunk``)."""
        t0, c = self.ids.shape[1], self.prefill_chunk
        if c is None or c >= t0:
            return [slice(0, t0)]
        return [slice(a, min(a + c, t0)) for a in range(0, t0, c)]


@dataclass(frozen=True)
class Step:
    """One step a rank ran for a group: for the record of what ran when (``Generation.timeline``).

    Attributes:
        rank: the pipeline position ``r`` (with replicas, the global rank is ``replica * p + r``).
        group: the group ``g``.
        step: the group's step (0 is its prefill; with ``Batch.prefill_chunk``, steps
            ``0 .. n - 1`` are the prompt's ``n`` pieces).
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


def chunk_groups(b: int, size: int) -> list[range]:
    """``b`` sequences as contiguous groups of ``size`` (the last one smaller when ``size`` does not divide ``b``).

    Raises:
        GenerateOptionError: ``size`` below 1.

    Example:
        >>> chunk_groups(7, 3)
        [range(0, 3), range(3, 6), range(6, 7)]
    """
    if not isinstance(size, int) or size < 1:
        raise GenerateOptionError(f"group_size must be an int >= 1, got {size!r}")
    return [range(start, min(start + size, b)) for start in range(0, b, size)]


def run_rank(
    ring: Ring, parts: DecoderParts, spans: Sequence[StageSpan], batch: Batch, groups: Sequence[range],
    timeline: list[Step], clock: Callable[[], float] = time.time, in_flight: int | None = None,
) -> dict[int, GroupResult]:
    """Run this rank's part of generating ``batch`` in ``groups``; the first rank returns every group's tokens.

    Args:
        ring: this rank's messages.
        parts: the model's parts.
        spans: this rank's stages, in order (a contiguous run of the plan's).
        batch: the prompts and options (the same on every rank).
        groups: the groups' rows (:func:`split_groups`, :func:`chunk_groups`), in the order they start.
        timeline: each step this rank runs is appended to it.
        clock: the time source of ``timeline``.
        in_flight: how many groups run at once (default: all). A group that ends gives its place
            in the round to the next group not started yet (continuous batching), on every rank
            alike, so the ranks' rounds stay the same.

    Returns:
        On the first rank, each group's :class:`GroupResult` by group index; elsewhere ``{}``.

    Raises:
        TransportTimeout: a message did not come within the transport's timeout (``PeerFailed``
            when another rank failed first).
    """
    slots = len(groups) if in_flight is None else in_flight
    if not isinstance(slots, int) or slots < 1:
        raise GenerateOptionError(f"in_flight must be an int >= 1, got {in_flight!r}")
    pieces = batch.prefill_pieces()
    if len(pieces) > 1:
        _check_pieces(len(pieces), len(groups), ring.ranks, batch)

    def piece(g: int) -> int:  # the prompt piece group g's next hop carries; 0 after the prefill (one in flight)
        return steps[g] if steps[g] < len(pieces) else 0
    device = batch.ids.device
    runners: dict[int, list[StageRunner]] = {}
    generators: dict[int, list[torch.Generator]] = {}
    state: dict[int, GroupState] = {}
    results: dict[int, GroupResult] = {}
    steps: dict[int, int] = {}
    waiting = deque(range(len(groups)))
    round_: deque[int] = deque()

    def start(g: int) -> None:  # a group joins the round, with a fresh cache on each of this rank's stages
        runners[g] = [StageRunner(parts, span, rank=ring.position) for span in spans]
        for stage in runners[g]:
            stage.reset()
        if ring.last and batch.sampling is not None:
            generators[g] = sequence_generators(batch.sampling, groups[g], device)
        if ring.first:
            state[g] = GroupState(batch, groups[g])
        steps[g] = 0
        round_.append(g)

    while waiting and len(round_) < slots:
        start(waiting.popleft())
    while round_:
        g = round_.popleft()
        if ring.first:
            hop = state[g].prefill(steps[g]) if steps[g] < len(pieces) else state[g].next_hop(ring, g, batch)
        else:
            hop = ring.recv_hop(g, piece(g))
        if hop is None:  # the group has ended: tell the next rank, free its caches, let the next group in
            if not ring.last:
                ring.send_hop(g, None, piece(g))
            del runners[g]
            generators.pop(g, None)
            if g in state:
                results[g] = state.pop(g).result()
            if waiting:
                start(waiting.popleft())
            continue
        begin = clock()
        out = hop
        for stage in runners[g]:
            out = stage(out)
        timeline.append(Step(ring.position, g, steps[g], begin, clock()))
        if ring.last:
            if g in generators:  # the stopped sequences' generators leave with them
                generators[g] = kept_generators(generators[g], hop.keep)
            if steps[g] >= len(pieces) - 1:  # a prompt's earlier pieces choose no token
                ring.send_tokens(g, next_tokens(out.data, batch.sampling, generators.get(g, ())),
                                 out.data if batch.output_logits else None)
        else:
            ring.send_hop(g, out, piece(g))
        steps[g] += 1
        round_.append(g)
    return results


def _check_pieces(pieces: int, groups: int, ranks: int, batch: Batch) -> None:
    """Refuse a chunked prefill whose message keys would collide or overflow a 32-bit message tag."""
    if groups > MAX_CHUNKED_GROUPS:
        raise GenerateOptionError(
            f"{groups} groups with prefill_chunk={batch.prefill_chunk}: a chunked prefill keys each piece's "
            f"messages by group, for at most {MAX_CHUNKED_GROUPS} groups; use a larger group_size or "
            "prefill_chunk=None"
        )
    # DistTransport's tag: ((mb * S + src) * S + dst) * 2 + 1 with mb up to 2 (g + PIECE_STRIDE c) + 1.
    most = ((2**31 - 1) // (2 * ranks * ranks) - ranks) // 2 // PIECE_STRIDE
    if pieces - 1 > most:
        raise GenerateOptionError(
            f"prefill_chunk={batch.prefill_chunk} cuts the {batch.ids.shape[1]}-position prompts into {pieces} "
            f"pieces; with {ranks} ranks at most {most + 1} pieces have message tags: use a prefill_chunk of at "
            f"least {-(-batch.ids.shape[1] // (most + 1))}"
        )


class GroupState:
    """The first rank's view of one group: its mask, positions, stops and tokens so far.

    Only the sequences still running travel: once a sequence stops, the next hop leaves it out
    (with ``Hop.keep`` saying which stay), so no stage computes for it again; its later tokens are
    ``pad`` and its later logits NaN.
    """

    def __init__(self, batch: Batch, rows: range) -> None:
        self.rows = rows
        sl = slice(rows.start, rows.stop)
        self.ids, self.positions = batch.ids[sl], batch.positions[sl]
        self.mask = batch.mask[sl]  # the running sequences' mask so far
        self.limits = batch.limits[sl]
        self.unfinished = self.limits > 0
        self.running = torch.arange(len(rows), device=batch.ids.device)  # the rows the last hop carried
        self.eos = torch.tensor(batch.eos, dtype=torch.long, device=batch.ids.device)
        self.tokens: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.last_positions = self.positions[:, -1:]
        self.pieces = batch.prefill_pieces()

    def prefill(self, piece: int = 0) -> Hop | None:
        """The hop carrying the prompt's ``piece`` (:meth:`Batch.prefill_pieces`); ``None`` when no
        sequence of the group is to run at all (every limit 0)."""
        if not bool(self.unfinished.any()):
            return None
        sl = self.pieces[piece]
        return Hop(self.ids[:, sl], self.positions[:, sl], self.mask[:, :sl.stop])

    def next_hop(self, ring: Ring, g: int, batch: Batch) -> Hop | None:
        tokens, logits = ring.recv_tokens(g, len(self.running), batch.output_logits)
        return self.advance(tokens, logits, batch.pad)

    def advance(self, tokens: torch.Tensor, logits: torch.Tensor | None, pad: int) -> Hop | None:
        """Take the last stage's chosen ``tokens`` (and ``logits``) for the running rows: the next hop, or
        ``None`` once all stopped."""
        b = len(self.rows)
        if logits is not None:
            full = logits.new_full((b, logits.shape[1]), float("nan"))
            full[self.running] = logits
            self.logits.append(full)
        chosen = tokens.new_full((b,), pad)
        chosen[self.running] = tokens
        chosen = torch.where(self.unfinished, chosen, pad)
        self.tokens.append(chosen)
        self.unfinished &= ~torch.isin(chosen, self.eos) & (self.limits > len(self.tokens))
        if not bool(self.unfinished.any()):
            return None
        stay = self.unfinished[self.running]  # of the rows the last hop carried, those still running
        keep = None
        if not bool(stay.all()):
            keep = stay.nonzero().flatten()
            self.running = self.running[keep]
            self.mask = self.mask[keep]
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.running), 1)], dim=1)
        self.last_positions = self.last_positions + 1
        new = chosen[self.running][:, None]
        return Hop(new, self.last_positions[self.running], self.mask, keep)

    def result(self) -> GroupResult:
        tokens = torch.stack(self.tokens, 1) if self.tokens else self.ids.new_zeros(len(self.rows), 0)
        return GroupResult(self.rows, tokens, tuple(self.logits))
