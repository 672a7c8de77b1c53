"""The test profiles: the default one, which CI runs, and the opt-in long one (``PIPECUT_FUZZ=long``).

The default profile runs one representative of each behaviour; the long one adds the rest of a
matrix (more schedules, ranks and options of a behaviour already run) and the benchmarks' larger
smoke runs, and gives the hypothesis tests more examples. A test or case marked ``long``
(``@pytest.mark.long``, ``pytest.param(..., marks=pytest.mark.long)``) is skipped in the default
profile (``tests/conftest.py``); a fixture that runs a matrix in one spawn asks :func:`in_profile`
which cases to run.

The default profile has a budget per test: with ``PIPECUT_TEST_BUDGET=SECONDS`` set (``.ci/run``
sets 60), a run in which one test took longer -- its setup, call and
teardown together, so a module's shared spawn counts against the test that starts it -- fails
after its report, with the tests over budget named (:func:`over_budget`). The long profile has none.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import pytest

LONG = os.environ.get("PIPECUT_FUZZ") == "long"
BUDGET_VARIABLE = "PIPECUT_TEST_BUDGET"
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


def long_only(values: Iterable[K], long: Iterable[K]) -> list[Any]:
    """``values`` as ``pytest.parametrize`` values, those in ``long`` marked ``long`` (the
    parametrized twin of :func:`in_profile`).

    Example:
        >>> [getattr(v, "marks", ()) and v.values for v in long_only(["a", "b"], ["b"])]
        [(), ('b',)]
    """
    values = list(values)
    left_out = set(long)
    unknown = left_out - set(values)
    if unknown:  # a renamed case would otherwise run in every profile
        raise KeyError(f"long names cases that do not exist: {sorted(map(str, unknown))}")
    return [pytest.param(v, marks=pytest.mark.long) if v in left_out else v for v in values]


def skip_long(items: Iterable[pytest.Item]) -> None:
    """Mark every item marked ``long`` to be skipped, unless the long profile runs (collected all
    the same: the ids in a run's report show what the default profile leaves out)."""
    if LONG:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if item.get_closest_marker("long") is not None:
            item.add_marker(skip)


def budget() -> float | None:
    """The seconds one default-profile test may take (``PIPECUT_TEST_BUDGET``), or ``None``: no
    budget is set, or the long profile runs."""
    raw = os.environ.get(BUDGET_VARIABLE, "").strip()
    if LONG or not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{BUDGET_VARIABLE}={raw!r} is not a number of seconds (CI sets 60)") from None
    if not seconds > 0:
        raise ValueError(f"{BUDGET_VARIABLE}={raw!r} must be above 0 seconds (CI sets 60)")
    return seconds


def over_budget(durations: Mapping[str, float], seconds: float) -> list[tuple[str, float]]:
    """The tests of ``durations`` (test id -> seconds of setup, call and teardown) that took longer
    than ``seconds``, slowest first.

    Example:
        >>> over_budget({"a": 12.0, "b": 75.5, "c": 61.0}, 60)
        [('b', 75.5), ('c', 61.0)]
    """
    return sorted(((k, v) for k, v in durations.items() if v > seconds), key=lambda kv: (-kv[1], kv[0]))


# The budget's hooks (tests/conftest.py imports them; ``-p profiles`` loads them into any run).
_SECONDS: dict[str, float] = {}  # test id -> seconds of its setup, call and teardown
_OVER: list[tuple[str, float]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Under pytest-xdist the controller gets every worker's reports here too.
    _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    seconds = budget()
    if seconds is None or hasattr(session.config, "workerinput"):  # none set, or an xdist worker
        return
    _OVER[:] = over_budget(_SECONDS, seconds)
    if _OVER and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    seconds = budget()
    if not _OVER or seconds is None:
        return
    terminalreporter.section(f"over the {seconds:g} s budget of a default-profile test", sep="=", red=True)
    for nodeid, took in _OVER:
        terminalreporter.write_line(f"{took:7.1f}s  {nodeid}")
    terminalreporter.write_line(
        "make each one smaller (its smallest configuration, or its cases in the module's shared spawn), "
        "or move its matrix to the long profile (CONTRIBUTING.md, Running the tests); "
        f"{BUDGET_VARIABLE} unset runs without the budget")
