"""Baselines: valid p-stage partitions, faithful to the libraries they come from."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings

from algo_cases import contiguous_partitions, examples, is_valid, problems
from partitioner.algorithms import (
    METHODS,
    Partition,
    Problem,
    balanced_params,
    equal_count,
    equal_size,
    exact,
)
from partitioner.errors import TooManyStagesError

INF = math.inf
BASELINES = (equal_count, balanced_params, equal_size)


def _problem(n: int, p: int, *, state: tuple[float, ...] | None = None,
             params: tuple[float, ...] | None = None, cuts: tuple[int, ...] | None = None) -> Problem:
    return Problem(compute=((1.0,) * n,) * p, state_bytes=state or (1.0,) * n, act_bytes=(0.0,) * n,
                   tensors=(), capacity=(INF,) * p, inflight=(1,) * p, link_bandwidth=(1.0,) * (p - 1),
                   link_latency=(0.0,) * (p - 1), cuts=cuts, param_counts=params)


def _weights(pb: Problem) -> tuple[float, ...]:
    return pb.param_counts if pb.param_counts is not None else pb.state_bytes


def _deepspeed_partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's runtime.utils.partition_uniform, restated (boundaries, num_parts + 1 of them)."""
    chunk = num_items // num_parts
    residual = num_items - chunk * num_parts
    parts = [i * chunk for i in range(num_parts + 1)]
    for i in range(residual):
        parts[i + 1:] = [x + 1 for x in parts[i + 1:]]
    return parts


def _pippy_cuts(weights: list[float], p: int) -> list[int]:
    """PiPPy's _split_on_size_threshold_with_max_stages on per-unit sizes, restated."""
    threshold = sum(weights) / p
    before: list[int] = []
    acc = 0.0
    for i, w in enumerate(weights):
        if acc + w <= threshold:
            acc += w
        elif acc == 0 and w > threshold:
            before.append(i + 1)
        else:
            before.append(i)
            acc = w
    return [k for k in before if k < len(weights)][: p - 1]


@settings(max_examples=examples(200), deadline=None)
@given(problems(memory=False))
def test_every_baseline_gives_p_valid_contiguous_stages(pb: Problem) -> None:
    blocks = len(set(pb.allowed_cuts())) + 1
    for method in BASELINES:
        if pb.p > blocks:
            with pytest.raises(TooManyStagesError):
                method(pb)
            continue
        part = method(pb)
        assert part.method == method.__name__
        assert is_valid(pb, part)
        assert list(part.assignment) == sorted(part.assignment)
        assert len(part.cuts()) == pb.p - 1


@settings(max_examples=examples(150), deadline=None)
@given(problems(memory=False))
def test_balanced_params_is_the_min_max_parameter_partition(pb: Problem) -> None:
    if pb.p > len(set(pb.allowed_cuts())) + 1:
        return
    w = _weights(pb)

    def heaviest(part: Partition) -> float:
        return max(sum(w[i] for i in units) for units in part.stage_units(pb.p))

    best = min(heaviest(part) for part in contiguous_partitions(pb))
    assert heaviest(balanced_params(pb)) == best


def test_equal_count_is_deepspeed_uniform() -> None:
    for n in range(1, 30):
        for p in range(1, n + 1):
            bounds = _deepspeed_partition_uniform(n, p)
            assert equal_count(_problem(n, p)).cuts() == tuple(bounds[1:-1]), (n, p)


def test_equal_count_snaps_to_allowed_cuts() -> None:
    # 12 units, 3 stages: ideal boundaries 4 and 8; allowed 3, 5, 6, 11
    assert equal_count(_problem(12, 3, cuts=(3, 5, 6, 11))).cuts() == (3, 6)  # 4 -> 3 (tie to earlier), 8 -> 6
    # not enough room after the nearest choice: the first boundary leaves one position for the second
    assert equal_count(_problem(12, 3, cuts=(9, 10))).cuts() == (9, 10)


def test_balanced_params_uses_param_counts_then_state_bytes() -> None:
    pb = _problem(4, 2, state=(1.0, 1.0, 1.0, 9.0), params=(9.0, 1.0, 1.0, 1.0))
    assert balanced_params(pb).cuts() == (1,)
    pb = _problem(4, 2, state=(1.0, 1.0, 1.0, 9.0))
    assert balanced_params(pb).cuts() == (3,)


@settings(max_examples=examples(120), deadline=None)
@given(problems(memory=False, cuts=False))
def test_equal_size_is_pippy_when_pippy_makes_enough_stages(pb: Problem) -> None:
    if pb.p > pb.n:
        return
    reference = _pippy_cuts(list(_weights(pb)), pb.p)
    if len(reference) == pb.p - 1:
        assert equal_size(pb).cuts() == tuple(reference)


def test_equal_size_greedy_and_its_repairs() -> None:
    # threshold 10: [3, 3, 3] [6, 4] [10] ... PiPPy's cuts, first p - 1 kept
    w = (3.0, 3.0, 3.0, 6.0, 4.0, 10.0, 1.0)
    assert equal_size(_problem(7, 3, params=w)).cuts() == (3, 5)
    # a unit bigger than the threshold is a stage of its own
    assert equal_size(_problem(4, 2, params=(1.0, 20.0, 1.0, 1.0))).cuts() == (1,)
    # everything in the last unit: the greedy makes no cut (PiPPy would return one stage); the
    # repair splits the heaviest stage nearest its middle, twice: [0, 1] [2] [3, 4]
    assert equal_size(_problem(5, 3, params=(0.0, 0.0, 0.0, 0.0, 9.0))).cuts() == (2, 3)
    # all zero: no greedy cut at all; repeated halving by unit count
    assert equal_size(_problem(8, 4, params=(0.0,) * 8)).cuts() == (2, 4, 6)
    # as many stages as units
    assert equal_size(_problem(3, 3, params=(5.0, 0.0, 0.0))).cuts() == (1, 2)


def test_baselines_ignore_memory_but_exact_does_not() -> None:
    pb = Problem(compute=((1.0,) * 4,) * 2, state_bytes=(1.0, 1.0, 1.0, 1.0), act_bytes=(0.0,) * 4,
                 tensors=(), capacity=(3.0, 1.0), inflight=(1, 1), link_bandwidth=(1.0,), link_latency=(0.0,))
    assert equal_count(pb).cuts() == (2,)  # stage 1 holds 2 bytes of 1
    assert exact(pb).cuts() == (3,)


def test_methods_registry() -> None:
    assert set(METHODS) == {"exact", "equal_count", "balanced_params", "equal_size"}
    pb = _problem(6, 3)
    for name, fn in METHODS.items():
        assert fn(pb).method == name


def test_too_many_stages_for_the_allowed_cuts() -> None:
    with pytest.raises(TooManyStagesError, match="units: 2"):
        equal_size(_problem(6, 3, cuts=(3,)))
