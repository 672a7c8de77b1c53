"""The partitioners other pipeline libraries ship, over the same Problem, for comparison.

Legend: ``n`` units, ``p`` stages, ``s`` a stage index, ``k`` a cut position, ``b`` a block (the
units between two allowed cut positions; one unit when ``problem.cuts`` is None).

None of them looks at time, communication or memory -- that is the point of a baseline: the
plans they make are evaluated (``evaluate``) like any other, so their cost can be compared with
``exact``. Each returns exactly ``p`` non-empty contiguous stages whose cuts are allowed ones.
"""

from __future__ import annotations

import bisect
import logging
from itertools import accumulate

import numpy as np

from partitioner.algorithms.exact import _Instance  # the threshold search of `exact`, reused on plain prefix sums
from partitioner.algorithms.problem import Partition, Problem
from partitioner.errors import TooManyStagesError

__all__ = ["equal_count", "balanced_params", "equal_size"]

logger = logging.getLogger(__name__)


def equal_count(problem: Problem) -> Partition:
    """The same number of units on every stage (torchgpipe's and DeepSpeed's ``'uniform'``).

    Stage ``s`` starts at ``s * (n // p) + min(s, n % p)``: the first ``n % p`` stages hold one unit
    more, as DeepSpeed's ``partition_uniform`` does. With ``problem.cuts`` each boundary moves to
    the nearest allowed position (ties to the earlier one) that still leaves one position for each
    later boundary, so the stages stay non-empty and as equal as the allowed cuts permit.

    Raises:
        TooManyStagesError: ``p`` exceeds the units (or the blocks between allowed cuts).

    Example:
        >>> from partitioner.algorithms.problem import Problem
        >>> pb = Problem(compute=((1.0,) * 7,) * 3, state_bytes=(0,) * 7, act_bytes=(0,) * 7,
        ...              tensors=(), capacity=(1,) * 3, inflight=(1,) * 3,
        ...              link_bandwidth=(1.0,) * 2, link_latency=(0.0,) * 2)
        >>> equal_count(pb).assignment
        (0, 0, 0, 1, 1, 2, 2)
    """
    n, p = problem.n, problem.p
    allowed = _allowed(problem)
    chunk, extra = divmod(n, p)
    targets = [s * chunk + min(s, extra) for s in range(1, p)]
    return Partition.from_cuts(_snap(targets, allowed), n, "equal_count")


def balanced_params(problem: Problem) -> Partition:
    """The contiguous partition with the least largest per-stage parameter count.

    This is DeepSpeed's ``partition_method='parameters'`` (its ``partition_balanced`` over the
    parameter count of each layer): weights are ``problem.param_counts``, or ``state_bytes`` when
    those are absent. The min-max is solved exactly, with the same threshold search as ``exact``
    (a stage's weight is a plain prefix-sum difference, no links, no memory). Among equally
    balanced partitions any one may be returned.

    Raises:
        TooManyStagesError: ``p`` exceeds the units (or the blocks between allowed cuts).

    Example:
        >>> from partitioner.algorithms.problem import Problem
        >>> pb = Problem(compute=((1.0,) * 5,) * 2, state_bytes=(4, 1, 1, 1, 1), act_bytes=(0,) * 5,
        ...              tensors=(), capacity=(1, 1), inflight=(1, 1),
        ...              link_bandwidth=(1.0,), link_latency=(0.0,))
        >>> balanced_params(pb).assignment
        (0, 1, 1, 1, 1)
    """
    n, p = problem.n, problem.p
    allowed = _allowed(problem)
    weight = _weights(problem)
    pos = np.array([0, *allowed, n], dtype=np.intp)
    prefix = np.concatenate(([0.0], np.cumsum(weight)))[pos]
    rows = np.tile(prefix, (p, 1))
    inst = _Instance(pos, rows, rows, np.zeros_like(rows), np.full(p, np.inf))
    blocks = np.diff(prefix)
    path, _ = inst.solve(max(float(blocks.max(initial=0.0)), float(prefix[-1]) / p))
    assert path is not None  # without memory limits every partition is feasible
    return Partition.from_cuts([int(pos[j]) for j in path[1:-1]], n, "balanced_params")


def equal_size(problem: Problem) -> Partition:
    """PiPPy's ``split_into_equal_size``: a greedy pass that cuts when a stage would grow too large.

    With ``threshold = total / p`` (parameter counts, or ``state_bytes`` when those are absent),
    walk the blocks in order keeping a running size; a block that does not fit under the threshold
    starts a new stage, and a block that alone exceeds it becomes a stage of its own -- PiPPy's
    ``_split_on_size_threshold_with_max_stages``. Like PiPPy, only the first ``p - 1`` cuts are
    kept. Where PiPPy asserts, we repair: if the pass made fewer than ``p - 1`` cuts (sizes
    concentrated at the end, or all zero), the heaviest stage that has two blocks or more is split
    where its two halves are closest in size (ties: the stage with more blocks, the cut nearest
    its middle), until there are ``p`` stages.

    Raises:
        TooManyStagesError: ``p`` exceeds the units (or the blocks between allowed cuts).

    Example:
        >>> from partitioner.algorithms.problem import Problem
        >>> pb = Problem(compute=((1.0,) * 6,) * 3, state_bytes=(1, 1, 5, 1, 1, 0), act_bytes=(0,) * 6,
        ...              tensors=(), capacity=(1,) * 3, inflight=(1,) * 3,
        ...              link_bandwidth=(1.0,) * 2, link_latency=(0.0,) * 2)
        >>> equal_size(pb).assignment   # threshold 3: [1, 1] [5] [1, 1, 0]
        (0, 0, 1, 2, 2, 2)
    """
    n, p = problem.n, problem.p
    allowed = _allowed(problem)
    bounds = [0, *allowed, n]
    weight = _weights(problem)
    block = [float(sum(weight[bounds[b]:bounds[b + 1]])) for b in range(len(bounds) - 1)]
    threshold = sum(block) / p
    cuts: list[int] = []  # block indices where a new stage starts
    size = 0.0
    for b, w in enumerate(block):
        if size + w <= threshold:
            size += w
        elif size == 0.0:  # this block alone exceeds the threshold: it is a stage by itself
            if b + 1 < len(block):
                cuts.append(b + 1)
        else:
            cuts.append(b)
            size = w
    cuts = sorted(set(cuts))[: p - 1]
    while len(cuts) < p - 1:
        cuts = _split_heaviest(block, cuts)
    logger.debug("equal_size: threshold %.6g, cuts at blocks %s", threshold, cuts)
    return Partition.from_cuts([bounds[b] for b in cuts], n, "equal_size")


def _allowed(problem: Problem) -> list[int]:
    allowed = sorted(set(problem.allowed_cuts()))
    most = min(problem.n, len(allowed) + 1)  # stages that can each get a unit
    if problem.p > most:
        raise TooManyStagesError(problem.p, most, "node" if problem.cuts is None else "module")
    return allowed


def _weights(problem: Problem) -> list[float]:
    src = problem.param_counts if problem.param_counts is not None else problem.state_bytes
    return [float(w) for w in src]


def _snap(targets: list[int], allowed: list[int]) -> list[int]:
    """For each target (increasing), the nearest allowed position after the previous choice,
    leaving enough positions for the targets still to come."""
    out: list[int] = []
    first = 0
    for t, target in enumerate(targets):
        last = len(allowed) - (len(targets) - t)  # index of the latest position still usable
        i = bisect.bisect_left(allowed, target, first, last + 1)
        options = [j for j in (i - 1, i) if first <= j <= last]
        j = min(options, key=lambda j: (abs(allowed[j] - target), j))
        out.append(allowed[j])
        first = j + 1
    return out


def _split_heaviest(block: list[float], cuts: list[int]) -> list[int]:
    """Add one cut inside the heaviest stage of two or more blocks, balancing its halves."""
    edges = [0, *cuts, len(block)]
    stages = [(sum(block[edges[s]:edges[s + 1]]), edges[s + 1] - edges[s], s)
              for s in range(len(edges) - 1) if edges[s + 1] - edges[s] >= 2]
    _, _, s = max(stages, key=lambda x: (x[0], x[1], -x[2]))
    a, c = edges[s], edges[s + 1]
    prefix = list(accumulate(block[a:c], initial=0.0))  # prefix[k - a]: weight of blocks a..k-1
    mid = (a + c) / 2
    k = min(range(a + 1, c), key=lambda k: (max(prefix[k - a], prefix[-1] - prefix[k - a]), abs(k - mid)))
    return sorted([*cuts, k])
