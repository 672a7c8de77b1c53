"""Local search that moves units across stage boundaries, beyond one topological order.

Legend: ``n`` units, ``p`` stages, ``s`` a stage index, ``d`` a destination stage (``s +- 1``),
``k`` the boundary a move crosses (between stages ``k - 1`` and ``k``), ``b`` a block index.

``exact`` is optimal among the contiguous partitions of *one* unit order. In a graph with parallel
branches other orders, and assignments that are contiguous in none, can be better (each branch
on its own stage instead of both halves of both). ``refine`` starts from any valid assignment and
moves one *block* at a time to a neighbouring stage: a block is one unit, or with
``problem.cuts`` the units between two allowed cut positions, which must stay together. A block
of stage ``s`` may move to ``s + 1`` when every reader of its outputs is already on ``s + 1`` or
later, and to ``s - 1`` when every producer of its inputs is on ``s - 1`` or earlier; so data
keeps flowing forward, and only the bytes over the boundary between ``s`` and ``d`` change.

A move is taken when it lowers the vector of stage times sorted in decreasing order,
lexicographically: the bottleneck falls, or stays while the next largest time falls, and so on
(this lets the search cross plateaus where two stages tie for the bottleneck). A move changes
only the two stages it touches, and for such a change the sorted vector falls exactly when the
pair ``(max, min)`` of those two stages falls lexicographically, so each test is ``O(1)`` after
``O(degree)`` work on the block's tensors. The key strictly decreases with every move and the
number of assignments is finite, so the search terminates; ``max_rounds`` bounds it as well.

Cost: one round sweeps every block once, ``O(n + sum of tensor degrees)``; moves that are taken
also re-sum the two stages' compute (``math.fsum``, so stage times depend on the assignment
only, never on the path).
"""

from __future__ import annotations

import logging
import math

from partitioner.algorithms.evaluate import check_assignment, evaluate, link_time
from partitioner.algorithms.problem import Partition, Problem
from partitioner.errors import AlgorithmInputError

__all__ = ["refine"]

logger = logging.getLogger(__name__)


def refine(problem: Problem, partition: Partition, *, max_rounds: int = 100) -> Partition:
    """Improve a valid partition by moving blocks between neighbouring stages.

    Moves respect memory (the receiving stage must fit its capacity afterwards), keep every
    stage non-empty and keep data flowing forward. The result is never worse than the input: its
    sorted stage times are lexicographically no larger, so in particular its bottleneck is no
    larger (the final evaluation is checked, and the input returned if rounding ever disagreed).

    Args:
        problem: the costs.
        partition: a valid assignment (see ``check_assignment``), contiguous or not.
        max_rounds: at most this many sweeps over all blocks; the search usually stops earlier,
            at the first sweep that moves nothing.

    Returns:
        A ``Partition`` with ``method = partition.method + '+refine'``.

    Raises:
        PartitionError: if ``partition`` is not valid for ``problem``.

    Example:
        >>> from partitioner.algorithms.problem import Tensor
        >>> # Two branches a0 -> a1 and b0 -> b1 joined by j, in the order a0, b0, a1, b1, j.
        >>> pb = Problem(compute=((1.0, 1.0, 1.0, 1.0, 0.0),) * 2, state_bytes=(0,) * 5,
        ...              act_bytes=(0,) * 5, capacity=(1, 1), inflight=(1, 1),
        ...              tensors=(Tensor(0, (2,), 10.0), Tensor(1, (3,), 10.0),
        ...                       Tensor(2, (4,), 1.0), Tensor(3, (4,), 1.0), Tensor(4, (5,), 1.0)),
        ...              link_bandwidth=(10.0,), link_latency=(0.0,))
        >>> start = Partition((0, 0, 0, 0, 1), "exact")   # the best cut of this order
        >>> evaluate(pb, start).bottleneck, evaluate(pb, refine(pb, start)).bottleneck
        (4.2, 2.1)
    """
    check_assignment(problem, partition)
    if max_rounds < 0:
        raise AlgorithmInputError(f"max_rounds must be >= 0, got {max_rounds}")
    method = partition.method + "+refine"
    if problem.p == 1:
        return Partition(partition.assignment, method)
    search = _Search(problem, partition.assignment)
    moves = rounds = 0
    for rounds in range(1, max_rounds + 1):  # noqa: B007 - read after the loop, in the debug log
        moved = search.sweep()
        moves += moved
        if not moved:
            break
    result = Partition(search.assignment(), method)
    before, after = evaluate(problem, partition), evaluate(problem, result)
    if sorted(after.time, reverse=True) > sorted(before.time, reverse=True):
        logger.warning("refine: rounding made the result worse than its input; keeping the input")
        return Partition(partition.assignment, method)
    logger.debug("refine: %d moves in %d rounds, bottleneck %.6g -> %.6g",
                 moves, rounds, before.bottleneck, after.bottleneck)
    return result


class _Search:
    """The mutable state of the local search, block by block."""

    def __init__(self, problem: Problem, assignment: tuple[int, ...]) -> None:
        self.pb = problem
        n, p = problem.n, problem.p
        bounds = [0, *sorted(set(problem.allowed_cuts())), n]
        self.nb = len(bounds) - 1
        block_of = [0] * n
        for b in range(self.nb):
            for i in range(bounds[b], bounds[b + 1]):
                block_of[i] = b
        self.bounds = bounds
        self.stage = [assignment[bounds[b]] for b in range(self.nb)]
        # Per block: compute on every device, training state, activations.
        self.bcomp = [[math.fsum(row[bounds[b]:bounds[b + 1]]) for b in range(self.nb)]
                      for row in problem.compute]
        self.bstate = [math.fsum(problem.state_bytes[bounds[b]:bounds[b + 1]]) for b in range(self.nb)]
        self.bact = [math.fsum(problem.act_bytes[bounds[b]:bounds[b + 1]]) for b in range(self.nb)]
        self.members: list[set[int]] = [set() for _ in range(p)]
        for b, s in enumerate(self.stage):
            self.members[s].add(b)
        # Tensors between blocks: producer block, consumer blocks (-1 stands for the graph output).
        self.t_src: list[int] = []
        self.t_dst: list[tuple[int, ...]] = []
        self.t_bytes: list[float] = []
        self.made: list[list[int]] = [[] for _ in range(self.nb)]
        self.read: list[list[int]] = [[] for _ in range(self.nb)]
        for tensor in problem.tensors:
            if tensor.producer < 0:
                continue
            src = block_of[tensor.producer]
            dst = tuple(sorted({-1 if c >= n else block_of[c] for c in tensor.consumers} - {src}))
            if not dst:
                continue
            t = len(self.t_src)
            self.t_src.append(src)
            self.t_dst.append(dst)
            self.t_bytes.append(tensor.nbytes)
            self.made[src].append(t)
            for c in dst:
                if c >= 0:
                    self.read[c].append(t)
        ev = evaluate(problem, assignment)
        self.bytes = [0.0, *ev.boundary_bytes, 0.0]  # bytes[k]: over boundary k, k = 1..p-1
        self.state = [math.fsum(self.bstate[b] for b in self.members[s]) for s in range(p)]
        self.act = [math.fsum(self.bact[b] for b in self.members[s]) for s in range(p)]
        self.comp = [math.fsum(self.bcomp[s][b] for b in self.members[s]) for s in range(p)]

    def assignment(self) -> tuple[int, ...]:
        out = [0] * self.pb.n
        for b, s in enumerate(self.stage):
            for i in range(self.bounds[b], self.bounds[b + 1]):
                out[i] = s
        return tuple(out)

    def _link(self, k: int, nbytes: float) -> float:
        if k <= 0 or k >= self.pb.p:
            return 0.0
        return link_time(nbytes, self.pb.link_bandwidth[k - 1], self.pb.link_latency[k - 1])

    def _time(self, s: int, comp: float, k: int, nbytes_k: float) -> float:
        """Time of stage ``s`` with compute ``comp`` if boundary ``k`` (``s`` or ``s + 1``) carried ``nbytes_k``."""
        t_in = self._link(s, nbytes_k if k == s else self.bytes[s])
        t_out = self._link(s + 1, nbytes_k if k == s + 1 else self.bytes[s + 1])
        return comp + t_in + t_out

    def _last(self, t: int, moved: int = -1, to: int = -1) -> int:
        """Stage of the last reader of tensor ``t`` (with block ``moved`` placed on stage ``to``)."""
        p1 = self.pb.p - 1
        return max(p1 if c < 0 else (to if c == moved else self.stage[c]) for c in self.t_dst[t])

    def _delta(self, b: int, d: int, k: int) -> float | None:
        """Change of bytes over boundary ``k`` if block ``b`` moves to ``d``; None if flow breaks."""
        s = self.stage[b]
        delta = 0.0
        for t in self.made[b]:
            if d > s and any(c >= 0 and self.stage[c] < d for c in self.t_dst[t]):
                return None  # a reader would sit before its producer
            last = self._last(t)
            delta += self.t_bytes[t] * ((d < k <= last) - (s < k <= last))
        for t in self.read[b]:
            src = self.stage[self.t_src[t]]
            if src > d:
                return None  # the block would sit before the producer of its input
            delta += self.t_bytes[t] * ((src < k <= self._last(t, b, d)) - (src < k <= self._last(t)))
        return delta

    def _try(self, b: int, d: int) -> bool:
        pb = self.pb
        s = self.stage[b]
        if not 0 <= d < pb.p or len(self.members[s]) == 1:
            return False
        if self.state[d] + self.bstate[b] + pb.inflight[d] * (self.act[d] + self.bact[b]) > pb.capacity[d]:
            return False
        k = max(s, d)
        delta = self._delta(b, d, k)
        if delta is None:
            return False
        nbytes = self.bytes[k] + delta
        old = (self._time(s, self.comp[s], k, self.bytes[k]), self._time(d, self.comp[d], k, self.bytes[k]))
        new = (self._time(s, self.comp[s] - self.bcomp[s][b], k, nbytes),
               self._time(d, self.comp[d] + self.bcomp[d][b], k, nbytes))
        if (max(new), min(new)) >= (max(old), min(old)):
            return False
        # Take the move, re-summing the two stages exactly so times depend on the assignment only.
        self.members[s].discard(b)
        self.members[d].add(b)
        self.stage[b] = d
        self.bytes[k] = nbytes
        for r in (s, d):
            self.comp[r] = math.fsum(self.bcomp[r][x] for x in self.members[r])
            self.state[r] = math.fsum(self.bstate[x] for x in self.members[r])
            self.act[r] = math.fsum(self.bact[x] for x in self.members[r])
        return True

    def sweep(self) -> int:
        """Try every block forward, then backward; returns how many moves were taken."""
        moved = 0
        for b in range(self.nb):
            if self._try(b, self.stage[b] + 1) or self._try(b, self.stage[b] - 1):
                moved += 1
        return moved
