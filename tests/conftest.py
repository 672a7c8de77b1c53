"""Shared test fixtures: every test starts from the same RNG state, on one thread."""

from __future__ import annotations

import random

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    torch.manual_seed(0)


def pytest_configure(config: pytest.Config) -> None:
    # The CI machine has 2 cores; tests that spawn processes set their own thread counts.
    torch.set_num_threads(1)
