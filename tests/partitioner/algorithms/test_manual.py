"""manual: the user's cuts, exactly, or an error that names the bad position."""

from __future__ import annotations

import math

import pytest

from partitioner.algorithms import Problem, manual
from partitioner.errors import PartitionError, SplitPointError

INF = math.inf


def _problem(n: int = 6, p: int = 3, cuts: tuple[int, ...] | None = None) -> Problem:
    return Problem(compute=((1.0,) * n,) * p, state_bytes=(0.0,) * n, act_bytes=(0.0,) * n,
                   tensors=(), capacity=(INF,) * p, inflight=(1,) * p, link_bandwidth=(1.0,) * (p - 1),
                   link_latency=(0.0,) * (p - 1), cuts=cuts,
                   names=tuple(f"layer{i}" for i in range(n)))


def test_manual_honours_the_cuts() -> None:
    part = manual(_problem(), [1, 5])
    assert part.assignment == (0, 1, 1, 1, 1, 2) and part.method == "manual"
    assert manual(_problem(p=1), []).assignment == (0,) * 6
    assert manual(_problem(cuts=(2, 4)), (2, 4)).cuts() == (2, 4)


@pytest.mark.parametrize(
    ("cuts", "message"),
    [
        ([3], r"1 cut positions given for 3 stages .* give 2 positions, or ask for 2 stages"),
        ([1, 2, 3], r"3 cut positions given for 3 stages"),
        ([0, 3], r"cut position 0 \(cuts\[0\]\) is outside 1..5"),
        ([3, 6], r"cut position 6 \(cuts\[1\]\) is outside 1..5"),
        ([4, 2], r"cut position 2 \(cuts\[1\]\) does not come after 4 .* \(sorted: \[2, 4\]\)"),
        ([3, 3], r"cut position 3 \(cuts\[1\]\) does not come after 3 .*sorted: \[3\]"),
        ([2.0, 4], r"cut position 2.0 \(cuts\[0\]\) is not an integer"),
        ([True, 4], r"cut position True \(cuts\[0\]\) is not an integer"),
    ],
)
def test_manual_errors_name_the_position_and_the_fix(cuts: list, message: str) -> None:
    with pytest.raises(SplitPointError, match=message):
        manual(_problem(), cuts)


def test_manual_cut_must_be_an_allowed_position() -> None:
    with pytest.raises(SplitPointError, match=r"cut position 3 \(cuts\[0\]\) falls between layer2 and "
                                              r"layer3.* nearest allowed position is 2"):
        manual(_problem(cuts=(2, 5)), [3, 5])
    with pytest.raises(SplitPointError, match="no cut is allowed"):
        manual(_problem(p=2, cuts=()), [3])


def test_split_point_error_is_a_partition_error() -> None:
    with pytest.raises(PartitionError):
        manual(_problem(), [])
