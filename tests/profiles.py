"""The test profiles: the default one, which CI runs, and the opt-in long one (``PIPECUT_FUZZ=long``).

The default profile runs one representative of each behaviour; the long one adds the rest of a
matrix (more schedules, ranks and options of a behaviour already run) and the benchmarks' larger
smoke runs, and gives the hypothesis tests more examples. A test or case marked ``long``
(``@pytest.mark.long``, ``pytest.param(..., marks=pytest.mark.long)``) is skipped in the default
profile (``tests/conftest.py``); a fixture that runs a matrix in one spawn asks :func:`in_profile`
which cases to run.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TypeVar

import pytest

LONG = os.environ.get("PIPECUT_FUZZ") == "long"
SKIP_REASON = "the long profile's: run with PIPECUT_FUZZ=long"

K = TypeVar("K")
V = TypeVar("V")


def in_profile(cases: Mapping[K, V], long_only: Iterable[K]) -> dict[K, V]:
    """``cases`` less those in ``long_only``, unless the long profile runs.

    Example:
        >>> sorted(in_profile({"a": 1, "b": 2}, {"b"})) == (["a", "b"] if LONG else ["a"])
        True
    """
    left_out = set(long_only)
    unknown = left_out - set(cases)
    if unknown:  # a renamed case would otherwise run in no profile at all
        raise KeyError(f"long_only names cases that do not exist: {sorted(map(str, unknown))}")
    return {k: v for k, v in cases.items() if LONG or k not in left_out}


def skip_long(items: Iterable[pytest.Item]) -> None:
    """Mark every item marked ``long`` to be skipped, unless the long profile runs (collected all
    the same: the ids in a run's report show what the default profile leaves out)."""
    if LONG:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if item.get_closest_marker("long") is not None:
            item.add_marker(skip)
