"""refine: valid, never worse, a local optimum, and better than exact where the graph branches."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from algo_cases import all_assignments, examples, forward_valid, is_valid, problems
from partitioner.algorithms import Partition, Problem, Tensor, evaluate, exact, refine
from partitioner.errors import PartitionError

INF = math.inf


def branches() -> Problem:
    """Two parallel branches a0 -> a1 and b0 -> b1 joined by j, ordered a0, b0, a1, b1, j.

    Branch-internal edges cost 1 s over the link, branch outputs 0.1 s. Every cut of this order
    cuts a branch-internal edge or leaves one stage with most of the work; branch a on stage 0
    and branch b with the join on stage 1 (2.6 s) is not contiguous in this order.
    """
    return Problem(
        compute=((1.0, 1.0, 1.0, 1.0, 0.5),) * 2, state_bytes=(0.0,) * 5, act_bytes=(0.0,) * 5,
        tensors=(Tensor(-1, (0, 1), 64.0), Tensor(0, (2,), 10.0), Tensor(1, (3,), 10.0),
                 Tensor(2, (4,), 1.0), Tensor(3, (4,), 1.0), Tensor(4, (5,), 1.0)),
        capacity=(INF, INF), inflight=(1, 1), link_bandwidth=(10.0,), link_latency=(0.0,),
        names=("a0", "b0", "a1", "b1", "j"),
    )


def test_refine_strictly_beats_exact_on_parallel_branches() -> None:
    pb = branches()
    start = exact(pb)
    # cuts at 1..4 cost max(2, 4.5), max(4, 4.5), max(3 + 1.1, 1.5 + 1.1), max(4 + 0.2, 0.5 + 0.2)
    assert start.assignment == (0, 0, 0, 1, 1)
    assert evaluate(pb, start).bottleneck == pytest.approx(4.1)
    better = refine(pb, start)
    assert better.method == "exact+refine"
    assert is_valid(pb, better)
    assert better.assignment in {(0, 1, 0, 1, 1), (1, 0, 1, 0, 1)}  # one branch per stage
    assert evaluate(pb, better).bottleneck == pytest.approx(2.6)  # b0 + b1 + j + 0.1
    # ... which is the optimum over every forward-flowing assignment
    best = min(evaluate(pb, stage).bottleneck for stage in all_assignments(pb))
    assert evaluate(pb, better).bottleneck == pytest.approx(best)


def test_refine_respects_memory() -> None:
    pb = branches()
    # stage 1 can hold only two units: the join plus one more
    tight = Problem(**{**pb.__dict__, "state_bytes": (1.0,) * 5, "capacity": (INF, 2.0)})
    out = refine(tight, exact(tight))
    assert evaluate(tight, out).feasible
    assert evaluate(tight, out).memory[1] <= 2.0
    assert sum(1 for s in out.assignment if s == 1) <= 2
    free = refine(pb, exact(pb))  # without the limit the better plan puts three units there
    assert sum(1 for s in free.assignment if s == 1) == 3


def test_refine_keeps_blocks_between_allowed_cuts_together() -> None:
    pb = Problem(**{**branches().__dict__, "cuts": (2, 4)})  # blocks {a0, b0}, {a1, b1}, {j}
    out = refine(pb, Partition((0, 0, 0, 0, 1), "manual"))
    assert is_valid(pb, out)
    assert out.assignment[0] == out.assignment[1] and out.assignment[2] == out.assignment[3]


def test_refine_rejects_an_invalid_start_and_zero_rounds_change_nothing() -> None:
    pb = branches()
    with pytest.raises(PartitionError, match="reads the output of a0"):
        refine(pb, Partition((1, 1, 0, 1, 1), "manual"))
    start = Partition((0, 0, 0, 1, 1), "exact")
    assert refine(pb, start, max_rounds=0) == Partition(start.assignment, "exact+refine")
    assert refine(pb, start, max_rounds=1).assignment != start.assignment  # one sweep moves something


def _sorted_times(pb: Problem, stage: tuple[int, ...]) -> list[float]:
    return sorted(evaluate(pb, stage).time, reverse=True)


def _blocks(pb: Problem) -> list[range]:
    bounds = [0, *sorted(set(pb.allowed_cuts())), pb.n]
    return [range(bounds[b], bounds[b + 1]) for b in range(len(bounds) - 1)]


@settings(max_examples=examples(250), deadline=None)
@given(problems(max_n=6, max_p=3, min_p=2, dyadic=True), st.randoms(use_true_random=False))
def test_refine_is_valid_never_worse_and_locally_optimal(pb: Problem, rnd) -> None:
    starts = list(all_assignments(pb))
    if not starts:
        return
    start = Partition(rnd.choice(starts), "start")
    out = refine(pb, start)
    assert out.method == "start+refine"
    assert is_valid(pb, out)
    before, after = evaluate(pb, start), evaluate(pb, out)
    assert after.bottleneck <= before.bottleneck
    assert sorted(after.time, reverse=True) <= sorted(before.time, reverse=True)
    if before.feasible:
        assert after.feasible
    # No single block move to a neighbouring stage that refine may take improves the result
    # (all values are dyadic, so these comparisons are exact).
    here = _sorted_times(pb, out.assignment)
    for block in _blocks(pb):
        s = out.assignment[block[0]]
        for d in (s - 1, s + 1):
            if not 0 <= d < pb.p:
                continue
            moved = list(out.assignment)
            for i in block:
                moved[i] = d
            stage = tuple(moved)
            if not forward_valid(pb, stage):
                continue
            if evaluate(pb, stage).memory[d] > pb.capacity[d]:
                continue
            assert _sorted_times(pb, stage) >= here, (block, d)


@settings(max_examples=examples(100), deadline=None)
@given(problems(max_n=7, max_p=3, min_p=2))
def test_refine_of_exact_is_between_the_dag_optimum_and_exact(pb: Problem) -> None:
    try:
        start = exact(pb)
    except PartitionError:
        return
    out = refine(pb, start)
    assert is_valid(pb, out)
    got = evaluate(pb, out)
    assert got.feasible
    assert got.bottleneck <= evaluate(pb, start).bottleneck
    dag_best = min(ev.bottleneck for ev in (evaluate(pb, s) for s in all_assignments(pb)) if ev.feasible)
    assert got.bottleneck >= dag_best * (1 - 1e-9) - 1e-12
