"""The user's own cut positions, checked and turned into a partition.

Legend: ``n`` units, ``p`` stages, ``k`` a cut position (units ``< k`` lie before it).
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Sequence

from partitioner.algorithms.problem import Partition, Problem
from partitioner.errors import AmbiguousSplitPointError, SplitPointError

__all__ = ["manual", "resolve_split_point"]

logger = logging.getLogger(__name__)


def manual(problem: Problem, cuts: Sequence[int]) -> Partition:
    """The contiguous partition with exactly the cuts given: stage ``s`` is units ``cuts[s-1]..cuts[s]-1``.

    Nothing is optimised and memory is not checked (``evaluate`` the result to see its cost).

    Args:
        problem: the problem to cut.
        cuts: ``p - 1`` strictly increasing positions in ``1..n-1``, each allowed by
            ``problem.cuts`` when that is set.

    Returns:
        A ``Partition`` with ``method='manual'``.

    Raises:
        SplitPointError: naming the first bad position, why it is bad and how to fix it.

    Example:
        >>> pb = Problem(compute=((1.0,) * 4,) * 2, state_bytes=(0,) * 4, act_bytes=(0,) * 4,
        ...              tensors=(), capacity=(1, 1), inflight=(1, 1),
        ...              link_bandwidth=(1.0,), link_latency=(0.0,))
        >>> manual(pb, [3]).assignment
        (0, 0, 0, 1)
        >>> manual(pb, [4])
        Traceback (most recent call last):
          ...
        partitioner.errors.SplitPointError: cut position 4 (cuts[0]) is outside 1..3: a cut at k puts units 0..k-1 on one stage and k.. on the next, so it must leave a unit on each side; use a position between 1 and 3
    """  # noqa: E501 - the error message above is one line, as the doctest compares it
    n, p = problem.n, problem.p
    cuts = list(cuts)
    for idx, k in enumerate(cuts):
        if isinstance(k, bool) or not isinstance(k, int):
            raise SplitPointError(
                f"cut position {k!r} (cuts[{idx}]) is not an integer; give unit positions "
                f"as ints in 1..{n - 1}"
            )
    if len(cuts) != p - 1:
        raise SplitPointError(
            f"{len(cuts)} cut positions given for {p} stages (cuts: {cuts}); {p} stages need "
            f"exactly {p - 1} cuts: give {p - 1} positions, or ask for {len(cuts) + 1} stages"
        )
    for idx, k in enumerate(cuts):
        if not 1 <= k <= n - 1:
            raise SplitPointError(
                f"cut position {k} (cuts[{idx}]) is outside 1..{n - 1}: a cut at k puts units "
                "0..k-1 on one stage and k.. on the next, so it must leave a unit on each side; "
                f"use a position between 1 and {n - 1}"
            )
        if idx and k <= cuts[idx - 1]:
            raise SplitPointError(
                f"cut position {k} (cuts[{idx}]) does not come after {cuts[idx - 1]} "
                f"(cuts[{idx - 1}]): every stage needs at least one unit, so positions must be "
                f"strictly increasing; sort them and drop duplicates (sorted: {sorted(set(cuts))})"
            )
    if problem.cuts is not None:
        allowed = sorted(set(problem.cuts))
        for idx, k in enumerate(cuts):
            if k not in allowed:
                near = min(allowed, key=lambda a: (abs(a - k), a)) if allowed else None
                hint = f"the nearest allowed position is {near}" if near is not None else "no cut is allowed"
                raise SplitPointError(
                    f"cut position {k} (cuts[{idx}]) falls between {problem.unit_name(k - 1)} and "
                    f"{problem.unit_name(k)}, where no cut is allowed (cuts must fall on module "
                    f"edges); {hint}, or use granularity='node' to cut inside modules"
                )
    logger.debug("manual: cuts %s", cuts)
    return Partition.from_cuts(cuts, n, "manual")


def resolve_split_point(name: str, modules: Iterable[str]) -> str:
    """The full module name a split point stands for: ``name`` itself when it is one of
    ``modules``, else the one module whose name ends with ``'.' + name`` (a suffix at a dot
    boundary: ``h.4`` is ``model.transformer.h.4``, never ``model.transformer.hh.4``).

    Args:
        name: the split point as the user wrote it (``--split-points h.4,h.8``).
        modules: every module name of the traced graph (each node's module and its parents).

    Returns:
        The full module name.

    Raises:
        AmbiguousSplitPointError: ``name`` ends more than one module name (they are listed).
        SplitPointError: ``name`` ends none; the message lists the closest names.

    Example:
        >>> mods = ["model", "model.transformer", "model.transformer.h.4", "model.transformer.hh.4"]
        >>> resolve_split_point("h.4", mods)
        'model.transformer.h.4'
        >>> resolve_split_point("transformer.hh.4", mods)
        'model.transformer.hh.4'
        >>> resolve_split_point("4", mods)
        Traceback (most recent call last):
          ...
        partitioner.errors.AmbiguousSplitPointError: split point '4' is the end of 2 module names: model.transformer.h.4, model.transformer.hh.4; give enough of the name to pick one (e.g. 'model.transformer.h.4')
    """  # noqa: E501 - the error message above is one line, as the doctest compares it
    known = sorted(set(modules) - {""})
    if name in known:
        return name
    matches = [m for m in known if m.endswith("." + name)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise AmbiguousSplitPointError(name, matches)
    # The close names by their full spelling and by the same number of trailing parts.
    parts = name.count(".") + 1
    tails = {".".join(m.split(".")[-parts:]): m for m in known}
    close = [tails[t] for t in difflib.get_close_matches(name, list(tails), n=3)]
    close += [m for m in difflib.get_close_matches(name, known, n=3) if m not in close]
    hint = f"; did you mean {', '.join(close[:3])}?" if close else f"; modules look like {known[:4]}"
    raise SplitPointError(f"split point {name!r} names no module of the traced graph, nor ends one{hint}")
