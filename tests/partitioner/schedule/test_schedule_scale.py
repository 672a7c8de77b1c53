"""Building, checking and simulating a schedule costs the same work per action at any size.

Not timed: the work is counted, as the function calls (Python and C) the profiler hook sees,
which is deterministic. Per action it must not grow with the stages or the micro-batches: it
once grew with ``p`` (every rank looked at every step of the unit-time run, every pass of the
simulator, waiting or not), 63 calls per action for the unit-time run of 1F1B on 16 stages
and 162 on 64.

ZB-V is measured with ``m >= 2p - 1``: for fewer micro-batches its generator builds the schedule
for ``2p - 1`` and drops the rest (``zero_bubble.zbv``), at most ``6 p (2p - 1)`` actions.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

from partitioner.schedule.comm import comm_plan
from partitioner.schedule.grid import unit_run
from partitioner.schedule.registry import TRAINING_SCHEDULES, stage_schedule
from partitioner.schedule.simulate import StageCosts, simulate
from partitioner.schedule.validation import peak_inflight, validate

SIZES = ((16, 4), (64, 4), (16, 32), (16, 128))  # (S, m): 4x the stages, 8x then 32x the micro-batches
# Calls per action at most (about 1.3x what each takes on CPython 3.11; checking a schedule took
# 50 per action before, simulating one 111, for ZB-V on 16 stages).
MOST = {"build": 8, "unit_run": 26, "validate": 30, "peak_inflight": 32, "simulate": 84, "comm_plan": 52}


def _calls(fn: Callable[[], Any]) -> int:
    count = 0

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal count
        count += event in ("call", "c_call")

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def _per_action(name: str, S: int, m: int) -> dict[str, float]:
    if name == "zbv":
        m = max(m, S - 1)  # p = S / 2 ranks, 2p - 1 = S - 1
    built: list[Any] = []
    n_calls = {"build": _calls(lambda: built.append(stage_schedule(name, S, m)))}
    s = built[0]
    n_calls |= {
        "unit_run": _calls(lambda: unit_run(s)),
        "validate": _calls(lambda: validate(s)),
        "peak_inflight": _calls(lambda: peak_inflight(s)),
        "simulate": _calls(lambda: simulate(s, StageCosts.uniform(S, output_bytes=1.0))),
        "comm_plan": _calls(lambda: comm_plan(s)),
    }
    actions = sum(map(len, s.actions))
    return {k: v / actions for k, v in n_calls.items()}


@pytest.mark.parametrize("name", TRAINING_SCHEDULES)
def test_work_per_action_does_not_grow_with_stages_or_microbatches(name: str) -> None:
    small, *larger = (_per_action(name, S, m) for S, m in SIZES)
    for (S, m), big in zip(SIZES[1:], larger):
        for what, per in big.items():
            # Same work per action, up to a few calls of set-up spread over fewer actions.
            assert per <= 1.1 * small[what] + 2, (what, S, m, per, small[what])
    for what, per in small.items():
        assert per <= MOST[what], (what, per)
