"""The optimal contiguous partition: least bottleneck over every cut of one unit order, memory-feasible.

Legend: ``n`` units, ``p`` stages, ``s`` a stage index, ``k`` a cut position (units ``< k`` lie
before it), ``m`` the number of *positions* (``0``, the allowed cuts, ``n``), ``j`` a position
index, ``T`` a bottleneck threshold.

Why it is exact
---------------
Stage ``s`` covering units ``[b, c)`` costs ``cost(s, b, c) = C_s[c] - C_s[b] + x_in(s, b) +
x_out(s, c)`` (``C_s``: prefix sums of row ``s`` of ``compute``; ``x_in``/``x_out``: the link time
of the bytes crossing position ``b``/``c``, which depend on that position only, because in a
contiguous partition a tensor made by unit ``i`` and last read by unit ``j`` crosses exactly the
positions ``i < k <= j``). Its memory ``M_s[c] - M_s[b]`` grows with ``c`` and shrinks with ``b``.

*Probe.* For a threshold ``T`` let ``R_0 = {0}`` and ``R_{s+1}`` the positions ``c`` (allowed
cuts; ``n`` for the last stage) with some ``b`` in ``R_s``, ``b < c``, memory ``<= cap[s]`` and
``cost(s, b, c) <= T``. By induction ``R_s`` is exactly the set of positions where some
``s``-stage prefix with every stage ``<= T`` and within memory can end, so a partition with
bottleneck ``<= T`` exists iff ``n`` is in ``R_p`` -- every cut set is examined, none is guessed.
This matters because the boundary cost is not monotone in the cut position (a position inside a
block may cross several skip connections, the next one only one), so a greedy "extend the
stage while it fits" probe can miss the optimum. Rearranged, ``c`` is reached iff
``max{C_s[b] - x_in(s, b) : b in R_s, lo_s(c) <= b < c} >= C_s[c] + x_out(s, c) - T``, where
``lo_s(c)``, the first start whose memory fits, never decreases with ``c``; the window maxima come
from a sparse table, one numpy pass per stage.

*Search.* ``hi`` is always the *actual* bottleneck of a partition we hold (a feasible probe at
``T`` yields one with bottleneck ``<= T``, reconstructed from the sets), so ``OPT <= hi``. An
infeasible probe at ``T`` proves ``OPT > T`` and more: take an optimal partition and the first
stage ``s`` whose end ``c`` is not in ``R_{s+1}``; its start is in ``R_s``, so ``c`` is an
unreached position whose cheapest reachable start costs ``<= OPT``. Hence ``OPT >= next(T)``, the
least such cheapest cost over all unreached positions, which the probe computes for free; ``lo``
jumps there. We bisect ``(lo, hi)``, and once ``hi - lo <= 1e-12 * hi`` probe at ``lo`` itself: a
feasible answer there gives ``hi <= lo <= OPT``, i.e. ``hi`` is optimal. The returned partition is
optimal, or (after a few final probes, only when candidate values crowd within 1e-12 of each
other) within a relative ``1e-12`` of optimal. All comparisons use the same floating-point
expressions ``a - v``, so the sets, the reconstruction and ``hi`` agree exactly.

Cost: ``O(p * m log m)`` numpy work per probe and ~40 probes; memory ``O(p * m)``.
"""

from __future__ import annotations

import logging
import math

import numpy as np
from numpy.typing import NDArray

from partitioner.algorithms.evaluate import lower_bound
from partitioner.algorithms.problem import Partition, Problem
from partitioner.errors import InfeasibleMemoryError, PartitionError, TooManyStagesError

__all__ = ["exact"]

logger = logging.getLogger(__name__)

_RTOL = 1e-12
_FINAL_PROBES = 8  # probes at lo once the gap is below _RTOL; each one either ends or raises lo
_NEG = -np.inf


def exact(problem: Problem) -> Partition:
    """The contiguous partition of the unit order into ``p`` stages with the least bottleneck.

    Stage ``s`` runs on device ``s`` (``compute[s]``), pays the links into and out of it, and must
    fit ``capacity[s]``; cuts only fall on ``problem.cuts`` when given. See the module docstring for
    the algorithm and why it is exact.

    Args:
        problem: the costs; its units must be in a topological order.

    Returns:
        A contiguous ``Partition`` with ``method='exact'``.

    Raises:
        TooManyStagesError: ``p`` exceeds the number of units (or of cut blocks with ``cuts``).
        InfeasibleMemoryError: no partition fits memory; ``needed`` is the per-stage memory of
            the partition that comes closest (least largest ratio of memory to capacity).
        PartitionError: the units are not in a topological order.

    Example:
        >>> from partitioner.algorithms.problem import Tensor
        >>> pb = Problem(compute=((1.0, 1.0, 1.0, 2.0),) * 2, state_bytes=(0, 0, 0, 0),
        ...              act_bytes=(0, 0, 0, 0), capacity=(1, 1), inflight=(1, 1),
        ...              tensors=(Tensor(0, (1,), 1.0), Tensor(1, (2,), 8.0), Tensor(2, (3,), 1.0)),
        ...              link_bandwidth=(1.0,), link_latency=(0.0,))
        >>> exact(pb).assignment   # cuts at 1, 2, 3 send 1, 8, 1 bytes
        (0, 0, 0, 1)
    """
    inst = _Instance.build(problem)
    best, _ = inst.solve(lower_bound(problem))
    if best is None:
        raise _memory_error(problem, inst)
    return Partition.from_cuts([int(inst.pos[j]) for j in best[1:-1]], problem.n, "exact")


def _crossing_bytes(problem: Problem) -> NDArray[np.float64]:
    """Bytes crossing each cut position ``k = 0..n`` of a contiguous partition (ends are 0).

    A tensor made by unit ``i >= 0`` and last read by unit ``j`` (``n`` for the graph output)
    crosses every ``i < k <= j``; a difference array sums them in ``O(n + tensors)``.

    Raises:
        PartitionError: a tensor is read by a unit at or before its producer, or names a unit
            outside ``0..n``.
    """
    n = problem.n
    diff = np.zeros(n + 2)
    for tensor in problem.tensors:
        i = tensor.producer
        if not tensor.consumers:
            continue
        j = max(tensor.consumers)
        if i >= n or j > n or min(tensor.consumers) < 0:
            raise PartitionError(
                f"a tensor of {tensor.nbytes:g} bytes names units outside 0..{n} "
                f"(producer {i}, consumers {tensor.consumers}); units are 0..{n - 1}, {n} is the output"
            )
        if i < 0:
            continue
        first = min(tensor.consumers)
        if first <= i:
            raise PartitionError(
                f"{problem.unit_name(first)} reads the output of {problem.unit_name(i)}, which does "
                "not come before it: the units are not in a topological order; order them so that "
                "every unit comes after the units it reads from"
            )
        diff[i + 1] += tensor.nbytes
        diff[j + 1] -= tensor.nbytes
    out = np.cumsum(diff)[: n + 1]
    out[0] = 0.0
    out[n] = 0.0
    return out


class _Instance:
    """The arrays of one problem, over positions ``pos`` (0, allowed cuts, n).

    ``a[s, j] = C_s[pos j] + x_out(s, pos j)`` and ``v[s, j] = C_s[pos j] - x_in(s, pos j)``, so
    stage ``s`` over positions ``jb < jc`` costs ``a[s, jc] - v[s, jb]``; its memory fits iff
    ``jb >= lo[s, jc]``.
    """

    def __init__(self, pos: NDArray[np.intp], a: NDArray[np.float64], v: NDArray[np.float64],
                 mem: NDArray[np.float64], cap: NDArray[np.float64]) -> None:
        self.pos = pos
        self.a = a
        self.v = v
        self.mem = mem  # (p, m): prefix memory per stage, at each position
        self.cap = cap
        self.p, self.m = a.shape
        self.lo = self.windows(cap)
        self._log2 = np.zeros(self.m + 1, dtype=np.intp)
        self._log2[2:] = np.floor(np.log2(np.arange(2, self.m + 1))).astype(np.intp)

    @staticmethod
    def build(problem: Problem) -> _Instance:
        n, p = problem.n, problem.p
        allowed = problem.allowed_cuts() if problem.cuts is None else tuple(sorted(set(problem.cuts)))
        most = min(n, len(allowed) + 1)  # stages that can each get a unit
        if p > most:
            raise TooManyStagesError(p, most, "node" if problem.cuts is None else "module")
        pos = np.array([0, *allowed, n], dtype=np.intp)
        x = _crossing_bytes(problem)[pos]
        compute = np.asarray(problem.compute, dtype=float).reshape(p, n)
        prefix = np.zeros((p, n + 1))
        np.cumsum(compute, axis=1, out=prefix[:, 1:])
        c = prefix[:, pos]
        link = np.zeros((p + 1, len(pos)))  # link[t]: time over boundary t at each position
        for t in range(1, p):
            bw, lat = problem.link_bandwidth[t - 1], problem.link_latency[t - 1]
            with np.errstate(divide="ignore"):
                cost = lat + x / bw if bw > 0 else np.full_like(x, math.inf)
            link[t] = np.where(x > 0, cost, 0.0)
        a = c + link[1:]  # x_out of stage s is boundary s + 1 (0 for the last stage)
        v = c - link[:-1]  # x_in of stage s is boundary s (0 for stage 0)
        state = np.asarray(problem.state_bytes, dtype=float)
        act = np.asarray(problem.act_bytes, dtype=float)
        mem = np.zeros((p, len(pos)))
        for s in range(p):
            mem[s] = np.concatenate(([0.0], np.cumsum(state + problem.inflight[s] * act)))[pos]
        return _Instance(pos, a, v, mem, np.asarray(problem.capacity, dtype=float))

    def windows(self, cap: NDArray[np.float64]) -> NDArray[np.intp]:
        """``lo[s, j]``: the first start position index whose stage ``s`` up to ``j`` fits ``cap[s]``."""
        lo = np.empty((self.p, self.m), dtype=np.intp)
        for s in range(self.p):
            lo[s] = np.searchsorted(self.mem[s], self.mem[s] - cap[s], side="left")
        return lo

    # -- the probe ---------------------------------------------------------------------------

    def probe(self, T: float, lo: NDArray[np.intp] | None = None) -> tuple[NDArray[np.bool_] | None, float]:
        """Reachable sets for threshold ``T``; returns ``(reach, next)``, ``reach`` None if infeasible.

        ``next`` (infeasible probes only) is the least cost of reaching a position not reached,
        a lower bound on the optimum (see the module docstring).
        """
        lo = self.lo if lo is None else lo
        p, m = self.p, self.m
        reach = np.zeros((p + 1, m), dtype=bool)
        reach[0, 0] = True
        nxt = math.inf
        for s in range(p):
            starts = np.flatnonzero(reach[s])
            first, last = int(starts[0]), int(starts[-1])
            # Ends past every window that still holds a reachable start are out of reach; lo[s]
            # never decreases, so those form a suffix and the ends tried form one range.
            top = m - 1 if s == p - 1 else min(m - 2, int(np.searchsorted(lo[s], last, side="right")) - 1)
            bottom = m - 1 if s == p - 1 else first + 1
            if bottom > top:
                return None, nxt
            ends = np.arange(bottom, top + 1, dtype=np.intp)
            vals = np.where(reach[s, first:last + 1], self.v[s, first:last + 1], _NEG)
            left = np.maximum(lo[s, ends], first) - first
            right = np.minimum(ends - 1, last) - first
            best = self._window_max(vals, left, right)
            cost = self.a[s, ends] - best  # inf where no reachable start fits memory
            ok = cost <= T
            ok &= best > _NEG
            reach[s + 1, ends] = ok
            missed = cost[~ok & (best > _NEG)]
            if missed.size:
                nxt = min(nxt, float(missed.min()))
            if not ok.any():
                return None, nxt
        if not reach[p, m - 1]:
            return None, nxt
        return reach, nxt

    def _window_max(
        self, vals: NDArray[np.float64], left: NDArray[np.intp], right: NDArray[np.intp]
    ) -> NDArray[np.float64]:
        """``max(vals[left[e]:right[e] + 1])`` for each ``e`` (``-inf`` if empty), via a sparse table."""
        length = right - left + 1
        out = np.full(length.shape, _NEG)
        has = length > 0
        if not has.any():
            return out
        left, right, length = left[has], right[has], length[has]
        if not left.any():  # every window starts at 0: a running maximum will do
            out[has] = np.maximum.accumulate(vals)[right]
            return out
        levels = int(self._log2[int(length.max())]) + 1
        table = np.empty((levels, vals.size))
        table[0] = vals
        for k in range(1, levels):
            half = 1 << (k - 1)
            table[k] = table[k - 1]
            np.maximum(table[k - 1, :-half], table[k - 1, half:], out=table[k, :-half])
        k = self._log2[length]
        out[has] = np.maximum(table[k, left], table[k, right - (1 << k) + 1])
        return out

    def reconstruct(
        self, reach: NDArray[np.bool_], lo: NDArray[np.intp] | None = None
    ) -> tuple[list[int], float]:
        """Walk back from ``n`` through the reachable sets; returns position indices and bottleneck.

        Each stage takes the reachable start with the largest ``v`` in its window: the very start
        whose cost the probe compared with ``T``, so the walk never fails.
        """
        lo = self.lo if lo is None else lo
        j = self.m - 1
        path = [j]
        worst = -math.inf
        for s in range(self.p - 1, -1, -1):
            window = np.where(reach[s, lo[s, j]:j], self.v[s, lo[s, j]:j], _NEG)
            b = int(lo[s, j] + np.argmax(window))
            worst = max(worst, float(self.a[s, j] - self.v[s, b]))
            j = b
            path.append(j)
        assert j == 0, "reconstruction left the reachable sets"  # the probe's own invariant
        return path[::-1], worst

    # -- the search --------------------------------------------------------------------------

    def solve(self, bound: float) -> tuple[list[int] | None, float]:
        """Least-bottleneck path of position indices, or ``(None, inf)`` if memory rules out all."""
        reach, _ = self.probe(math.inf)
        if reach is None:
            return None, math.inf
        best, hi = self.reconstruct(reach)
        lo = min(bound, hi)
        probes, final = 1, 0
        while lo < hi:
            if hi - lo <= _RTOL * hi:
                if final == _FINAL_PROBES:
                    break
                T, final = lo, final + 1
            else:
                T = lo + 0.5 * (hi - lo)
            reach, nxt = self.probe(T)
            probes += 1
            if reach is not None:
                best, hi = self.reconstruct(reach)
            else:
                lo = max(lo, nxt)
        logger.debug("exact: %d probes, bottleneck %.6g, proven lower bound %.6g", probes, hi, lo)
        return best, hi

    def least_memory_ratio(self) -> list[int] | None:
        """Positions of the partition with the least ``max_s memory / capacity`` (for errors)."""
        def fits(r: float) -> NDArray[np.bool_] | None:
            reach, _ = self.probe(math.inf, self.windows(self.cap * r))
            return reach

        r = 1.0
        while fits(r) is None:
            r *= 2.0
            if r > 1e30:  # only zero-capacity stages can do this
                return None
        lo_r, hi_r = r / 2.0, r
        for _ in range(60):
            mid = 0.5 * (lo_r + hi_r)
            if fits(mid) is None:
                lo_r = mid
            else:
                hi_r = mid
        reach = fits(hi_r)
        assert reach is not None
        return self.reconstruct(reach, self.windows(self.cap * hi_r))[0]


def _memory_error(problem: Problem, inst: _Instance) -> InfeasibleMemoryError:
    path = inst.least_memory_ratio()
    if path is None:  # only zero-capacity stages make every ratio infinite: report one unit each
        path = [*range(inst.p), inst.m - 1]
    needed = [float(inst.mem[s, path[s + 1]] - inst.mem[s, path[s]]) for s in range(inst.p)]

    def ratio(s: int) -> float:
        cap = problem.capacity[s]
        return needed[s] / cap if cap > 0 else (math.inf if needed[s] > 0 else 0.0)

    worst = max(range(inst.p), key=ratio)
    first, last = int(inst.pos[path[worst]]), int(inst.pos[path[worst + 1]]) - 1
    detail = (
        f"The closest partition still needs {ratio(worst):.2f}x the capacity of stage {worst} "
        f"({problem.unit_name(first)} .. {problem.unit_name(last)})."
    )
    return InfeasibleMemoryError(needed, list(problem.capacity), detail)
