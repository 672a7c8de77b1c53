"""comm.py: the sends and receives a schedule implies run under the buffered and batched models.

Legend: ``p`` ranks, ``m`` micro-batches, ``S`` stages, ``s`` a stage, ``r`` a rank, ``mb`` a
micro-batch.
"""

from __future__ import annotations

import random

import pytest

from partitioner.schedule.actions import Action, Kind
from partitioner.schedule.comm import Recv, comm_plan, grouped_program_finishes
from partitioner.schedule.errors import ScheduleError
from partitioner.schedule.generators import gpipe, one_f_one_b
from partitioner.schedule.grid import format_grid
from partitioner.schedule.ir import Schedule
from partitioner.schedule.registry import get_schedule
from partitioner.schedule.validation import peak_inflight, validate
from schedule_cases import (
    GRID,
    TRAINING,
    chain,
    over_valid_schedules,
    run_buffered,
    run_rendezvous,
    sched,
)

# -- the comm plan ---------------------------------------------------------------------------


def test_comm_plan_of_gpipe_and_1f1b_receives_lazily_and_runs() -> None:
    for name in ("gpipe", "1f1b", "forward"):
        for p, m in GRID:
            schedule = get_schedule(name, p, m)
            skips = [
                (s, t) for s in range(p) for t in range(s + 1, p) if t == s + 1 or (s + t) % 3 == 0
            ]
            for edges in (None, skips):
                plans = comm_plan(schedule, edges=edges)
                run_buffered(schedule, plans, edges or chain(p))
                for (
                    ops
                ) in plans:  # the action right after each Recv (and its run of Recvs) reads it
                    for i, op in enumerate(ops):
                        if isinstance(op, Recv):
                            reader = next(o for o in ops[i:] if isinstance(o, Action))
                            assert (reader.stage, reader.mb) == (op.to_stage, op.mb), (
                                name,
                                p,
                                m,
                                op,
                            )
                            assert (reader.kind is Kind.FORWARD) == (op.kind is Kind.FORWARD)


def test_comm_plan_batched_is_deadlock_free_where_naive_rendezvous_is_not() -> None:
    for name in TRAINING:
        for p, m in GRID:
            assert run_rendezvous(comm_plan(get_schedule(name, p, m)), batched=True), (name, p, m)
    # Without batching, 1F1B's crossing send-act / send-grad would hang on NCCL (large tensors).
    assert not run_rendezvous(comm_plan(one_f_one_b(2, 4)), batched=False)
    assert run_rendezvous(comm_plan(gpipe(2, 4)), batched=False)


def test_comm_plan_receives_early_to_keep_pair_order() -> None:
    schedule = sched("0F0 0F1 0B0 0B1", "1F1 1F0 1B0 1B1")
    validate(schedule)
    ops = comm_plan(schedule)[1]
    assert [str(op) for op in ops[:4]] == [
        "recv 0F0 for stage 1 from rank 0",
        "recv 0F1 for stage 1 from rank 0",
        "1F1",
        "1F0",
    ]
    run_buffered(schedule, comm_plan(schedule), chain(2))


def test_comm_plan_skips_stages_on_the_same_rank() -> None:
    v_shape = sched("0F0 3F0 3B0 0B0", "1F0 2F0 2B0 1B0", placement=(0, 1, 1, 0))
    plans = comm_plan(v_shape)
    assert [str(op) for op in plans[1]] == [
        "recv 0F0 for stage 1 from rank 0",
        "1F0",
        "2F0",
        "send 2F0 to stage 3 on rank 0",
        "recv 3B0 for stage 2 from rank 0",
        "2B0",
        "1B0",
        "send 1B0 to stage 0 on rank 0",
    ]
    with pytest.raises(ScheduleError, match=r"edge \(2, 1\) does not go forward"):
        comm_plan(v_shape, edges=[(2, 1)])
    with pytest.raises(ScheduleError, match="deadlocks"):
        comm_plan(sched("0B0 0F0"))


@over_valid_schedules
def test_random_valid_schedules_run_under_the_comm_model(
    schedule: Schedule, rnd: random.Random
) -> None:
    validate(schedule)
    assert "[" not in format_grid(schedule)
    S = schedule.num_stages
    edges = sorted(
        {(s, s + 1) for s in range(S - 1)}
        | {(a, b) for a in range(S) for b in range(a + 2, S) if rnd.random() < 0.3}
    )
    run_buffered(schedule, comm_plan(schedule, edges=edges), edges)
    peak = peak_inflight(schedule)
    if schedule.forward_only:
        assert peak == (0,) * S
    else:
        assert all(1 <= peak[s] <= schedule.num_microbatches for s in range(S))


def test_comm_plan_of_interleaved_and_zero_bubble_schedules_runs_with_buffered_sends() -> None:
    for name, kw in [("interleaved", {"v": 2}), ("interleaved", {"v": 3}), ("zbh1", {}),
                     ("zbv", {})]:  # fmt: skip
        for p, m in GRID:
            schedule = get_schedule(name, p, m, **kw)
            run_buffered(schedule, comm_plan(schedule), chain(schedule.num_stages))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zbh1", "interleaved", "zbv"])
def test_grouped_program_finishes_agrees_with_the_independent_model(name: str) -> None:
    """The runtime's check equals the test model's on every (p, m) with random skip edges."""
    rnd = random.Random(7)
    for p, m in [(p, m) for p in range(2, 6) for m in range(1, 9)]:
        schedule = get_schedule(name, p, m)
        S = schedule.num_stages
        skips = [(a, b) for a in range(S) for b in range(a + 2, S)]
        for edges in [set(chain(S)), set(chain(S)) | set(rnd.sample(skips, min(len(skips), rnd.randint(1, 2))))]:
            want = run_rendezvous(comm_plan(schedule, edges=edges), batched=True)
            assert grouped_program_finishes(schedule, edges=edges) == want, (name, p, m, sorted(edges))


def test_grouped_program_with_skips_can_wait_in_a_circle() -> None:
    # Stage 0 feeding stage 3 directly: under 1F1B rank 0's group holding that send waits for a
    # receive rank 3 posts only after work that waits on rank 0.
    skip = {*chain(4), (0, 3)}
    assert not grouped_program_finishes(get_schedule("1f1b", 4, 4), edges=skip)
    assert grouped_program_finishes(get_schedule("gpipe", 4, 4), edges=skip)
    assert grouped_program_finishes(get_schedule("1f1b", 4, 4), edges=chain(4))


def test_comm_plan_batched_rendezvous_holds_for_zbh1_but_not_interleaved_or_zbv() -> None:
    # Sends that wait for their receive (NCCL, large tensors) are safe for ZB-H1 when each run
    # of sends and receives is one batch; interleaved and ZB-V need sends that never wait.
    for p, m in GRID:
        assert run_rendezvous(comm_plan(get_schedule("zbh1", p, m)), batched=True), (p, m)
    assert not run_rendezvous(comm_plan(get_schedule("interleaved", 2, 4)), batched=True)
    assert not run_rendezvous(comm_plan(get_schedule("zbv", 2, 4)), batched=True)


def _read_out_of_order(schedule: Schedule) -> bool:
    """Independent of comm_plan: does any rank, reading lazily in action order, meet a peer's
    messages in another order than the peer sent them? (chain edges)"""
    place, S = schedule.stage_to_rank, schedule.num_stages
    present = {a for row in schedule.actions for a in row}
    sent: dict[tuple[int, int], list[tuple[int, int, bool, int]]] = {}  # (src, dst rank) -> messages
    read: dict[tuple[int, int], list[tuple[int, int, bool, int]]] = {}
    for r, row in enumerate(schedule.actions):
        for a in row:
            if a.kind is Kind.FORWARD:
                if a.stage + 1 < S and place[a.stage + 1] != r:
                    sent.setdefault((r, place[a.stage + 1]), []).append((a.stage, a.stage + 1, True, a.mb))
                if a.stage > 0 and place[a.stage - 1] != r:
                    read.setdefault((place[a.stage - 1], r), []).append((a.stage - 1, a.stage, True, a.mb))
            elif a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
                if a.stage > 0 and place[a.stage - 1] != r:
                    sent.setdefault((r, place[a.stage - 1]), []).append((a.stage, a.stage - 1, False, a.mb))
                if a.stage + 1 < S and place[a.stage + 1] != r:
                    read.setdefault((place[a.stage + 1], r), []).append((a.stage + 1, a.stage, False, a.mb))
    assert present and {k: sorted(v) for k, v in sent.items()} == {k: sorted(v) for k, v in read.items()}
    return sent != read


def test_needs_early_receives_agrees_with_the_order_messages_are_read_in() -> None:
    from partitioner.schedule.comm import needs_early_receives

    seen = set()
    for name in ("gpipe", "1f1b", "zbh1", "interleaved", "zbv"):
        for p, m in GRID[::3]:
            schedule = get_schedule(name, p, m)
            got = needs_early_receives(schedule)
            assert got == _read_out_of_order(schedule), (name, p, m)
            seen.add((name, got))
    assert seen >= {("zbv", True), ("interleaved", True), ("interleaved", False), ("zbh1", False)}
    assert not any(got for name, got in seen if name in ("gpipe", "1f1b", "zbh1"))
