"""Shared test fixtures: every test starts from the same RNG state, on one thread; tests marked
``long`` run only in the long profile (``PIPECUT_FUZZ=long``, ``tests/profiles.py``); with
``PIPECUT_TEST_BUDGET`` set, a default-profile test that takes longer fails the run; a Hugging Face
model exported once is not exported again with the same example in the same process (``trace_memo``)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import profiles
import trace_memo
from profiles import pytest_runtest_logreport, pytest_sessionfinish, pytest_terminal_summary  # noqa: F401 (hooks)

_TRACING = Path(__file__).resolve().parent / "partitioner" / "tracing"


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    torch.manual_seed(0)


def pytest_configure(config: pytest.Config) -> None:
    # The CI machine has 2 cores; tests that spawn processes set their own thread counts.
    torch.set_num_threads(1)
    trace_memo.install()


@pytest.fixture(autouse=True)
def _trace_memo(request: pytest.FixtureRequest) -> Iterator[None]:
    # The tracer's own tests, and a test marked fresh_trace, export every model afresh.
    fresh = _TRACING in request.node.path.parents or request.node.get_closest_marker("fresh_trace") is not None
    with trace_memo.off() if fresh else contextlib.nullcontext():
        yield


@pytest.fixture(autouse=True)
def _no_inherited_terminal_size(monkeypatch: pytest.MonkeyPatch) -> None:
    # Output widths are the tests' to set: a COLUMNS inherited from the shell or a test runner
    # (pytest-xdist's workers) would wrap the CLI's tables at another width.
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    profiles.skip_long(items)
