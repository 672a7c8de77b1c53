"""Pure partition algorithms over plain data (see problem.py for the cost they minimise).

``exact`` is the planner's algorithm; ``refine`` improves any plan beyond one unit order;
``equal_count``, ``balanced_params`` and ``equal_size`` are what other libraries do, kept for
comparison; ``manual`` takes the user's cuts. ``evaluate`` prices any assignment.
"""

from __future__ import annotations

from collections.abc import Callable

from partitioner.algorithms.baselines import balanced_params, equal_count, equal_size
from partitioner.algorithms.evaluate import Evaluation, check_assignment, evaluate, lower_bound
from partitioner.algorithms.exact import exact
from partitioner.algorithms.manual import manual, resolve_split_point
from partitioner.algorithms.problem import Partition, Problem, Tensor
from partitioner.algorithms.refine import refine

__all__ = [
    "Problem",
    "Tensor",
    "Partition",
    "Evaluation",
    "evaluate",
    "lower_bound",
    "check_assignment",
    "exact",
    "refine",
    "equal_count",
    "balanced_params",
    "equal_size",
    "manual",
    "resolve_split_point",
    "METHODS",
]

# The automatic partitioners by name: each maps a Problem to a Partition.
METHODS: dict[str, Callable[[Problem], Partition]] = {
    "exact": exact,
    "equal_count": equal_count,
    "balanced_params": balanced_params,
    "equal_size": equal_size,
}
