"""schedules.py: generated schedules are valid and hold what they promise; broken lists are caught.

Legend: ``p`` ranks, ``m`` micro-batches, ``v`` stages per rank, ``S`` stages, ``s`` a stage,
``r`` a rank, ``mb`` a micro-batch.

The executor-level checks (``_run_buffered``, ``_run_rendezvous``) re-derive dependencies and
message matching here, independently of the module, so they can disagree with it.
"""

from __future__ import annotations

import ast
import doctest
import random
from collections import deque
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import runtime.schedules as schedules_module
from runtime.schedules import (
    Action,
    Kind,
    Op,
    Recv,
    Schedule,
    ScheduleError,
    ScheduleFormatError,
    Send,
    UnknownScheduleError,
    comm_plan,
    format_grid,
    forward_only,
    get_schedule,
    gpipe,
    one_f_one_b,
    peak_inflight,
    schedule_names,
    validate,
)

A = Action.parse
GRID = [(p, m) for p in range(1, 7) for m in range(1, 13)]
TRAINING = ("gpipe", "1f1b")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "runtime.md"


def sched(
    *rows: str, placement: tuple[int, ...] | None = None, m: int = 0, **kw: object
) -> Schedule:
    """A schedule from one string of actions per rank; ``m`` defaults to the largest mb + 1."""
    actions = [[A(tok) for tok in row.split()] for row in rows]
    m = m or 1 + max(a.mb for row in actions for a in row)
    return Schedule(_tuples(actions), placement or tuple(range(len(rows))), m, **kw)  # type: ignore[arg-type]


def _tuples(rows: list[list[Action]]) -> tuple[tuple[Action, ...], ...]:
    return tuple(map(tuple, rows))


def error_of(schedule: Schedule) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    return info.value


# -- an independent model of what an executor does -------------------------------------------


def _reads(x: Action, present: set[Action], S: int, edges: list[tuple[int, int]]) -> list[Action]:
    """What ``x`` reads, re-derived here: forward edges, own F before backward, own I before W."""
    if x.kind is Kind.FORWARD:
        return [Action(a, Kind.FORWARD, x.mb) for a, b in edges if b == x.stage]
    if x.kind is Kind.BACKWARD_WEIGHT:
        return [Action(x.stage, Kind.BACKWARD_INPUT, x.mb)]
    grads = []
    for a, b in edges:
        if a == x.stage:
            i = Action(b, Kind.BACKWARD_INPUT, x.mb)
            grads.append(i if i in present else Action(b, Kind.BACKWARD, x.mb))
    return [Action(x.stage, Kind.FORWARD, x.mb)] + grads


def _chain(S: int) -> list[tuple[int, int]]:
    return [(s, s + 1) for s in range(S - 1)]


def _deadlocks(schedule: Schedule) -> bool:
    """Greedy run in any order: running an action never blocks another, so the verdict is unique."""
    present = {a for row in schedule.actions for a in row}
    edges = _chain(schedule.num_stages)
    pos, done = [0] * schedule.num_ranks, set[Action]()
    moved = True
    while moved:
        moved = False
        for r, row in enumerate(schedule.actions):
            while (
                pos[r] < len(row)
                and set(_reads(row[pos[r]], present, schedule.num_stages, edges)) <= done
            ):
                done.add(row[pos[r]])
                pos[r] += 1
                moved = True
    return any(pos[r] < len(row) for r, row in enumerate(schedule.actions))


def _run_buffered(
    schedule: Schedule, plans: tuple[tuple[Op, ...], ...], edges: list[tuple[int, int]]
) -> None:
    """Execute the programs: sends never block, receives block, untagged FIFO per rank pair.

    Asserts that every action finds its inputs (done locally, or received), every receive gets
    the message it names, nothing is left in flight, and no rank is stuck.
    """
    place, S = schedule.stage_to_rank, schedule.num_stages
    present = {a for row in schedule.actions for a in row}
    queues: dict[tuple[int, int], deque[tuple[int, Kind, int, int]]] = {}
    pos = [0] * len(plans)
    done: list[set[Action]] = [set() for _ in plans]
    inbox: list[set[tuple[Action, int]]] = [set() for _ in plans]
    moved = True
    while moved:
        moved = False
        for r, ops in enumerate(plans):
            while pos[r] < len(ops):
                op = ops[pos[r]]
                if isinstance(op, Recv):
                    queue = queues.get((op.peer, r))
                    if not queue:
                        break
                    assert queue.popleft() == (op.stage, op.kind, op.mb, op.to_stage), (
                        f"rank {r}: {op}"
                    )
                    inbox[r].add((Action(op.stage, op.kind, op.mb), op.to_stage))
                elif isinstance(op, Send):
                    assert Action(op.stage, op.kind, op.mb) in done[r]
                    assert place[op.to_stage] == op.peer != r
                    queues.setdefault((r, op.peer), deque()).append(
                        (op.stage, op.kind, op.mb, op.to_stage)
                    )
                else:
                    assert place[op.stage] == r
                    for src in _reads(op, present, S, edges):
                        local = place[src.stage] == r
                        assert (src in done[r]) if local else ((src, op.stage) in inbox[r]), (
                            f"rank {r}: {op} before {src}"
                        )
                    done[r].add(op)
                pos[r] += 1
                moved = True
    assert all(pos[r] == len(ops) for r, ops in enumerate(plans)), f"deadlock at {pos}"
    assert not any(queues.values()), "messages sent but never received"


def _run_rendezvous(plans: tuple[tuple[Op, ...], ...], *, batched: bool) -> bool:
    """Whether the programs finish when a send completes only once its receive is posted.

    ``batched``: each run of consecutive sends/receives between two actions is posted as one
    group (``batch_isend_irecv``) and waited on as a whole; else each op is waited on alone.
    Between two ranks in one direction the k-th send meets the k-th receive. Actions never block.
    """
    segments: list[
        list[list[tuple[str, int, int, int]]]
    ] = []  # rank -> group -> (side, src, dst, k)
    where: dict[tuple[str, int, int, int], tuple[int, int]] = {}  # op -> (rank, group)
    counts: dict[tuple[str, int, int], int] = {}
    for r, ops in enumerate(plans):
        groups: list[list[tuple[str, int, int, int]]] = []
        after_comm = False
        for op in ops:
            if isinstance(op, (Send, Recv)):
                side, src, dst = (
                    ("send", r, op.peer) if isinstance(op, Send) else ("recv", op.peer, r)
                )
                k = counts.get((side, src, dst), 0)
                counts[(side, src, dst)] = k + 1
                if not (batched and after_comm):
                    groups.append([])
                groups[-1].append((side, src, dst, k))
                where[(side, src, dst, k)] = (r, len(groups) - 1)
            after_comm = isinstance(op, (Send, Recv))
        segments.append(groups)
    at = [0] * len(plans)
    moved = True
    while moved:
        moved = False
        for r, groups in enumerate(segments):
            while at[r] < len(groups):
                partners = [
                    where[("recv" if side == "send" else "send", src, dst, k)]
                    for side, src, dst, k in groups[at[r]]
                ]
                if any(at[q] < g for q, g in partners):
                    break
                at[r] += 1
                moved = True
    return all(at[r] == len(groups) for r, groups in enumerate(segments))


# -- hypothesis strategies ---------------------------------------------------------------------


def _placement(style: str, p: int, v: int, rnd: random.Random) -> tuple[int, ...]:
    if style == "interleaved":
        return tuple(s % p for s in range(p * v))
    if style == "v":  # chunk c runs up the ranks when even, back down when odd (ZB-V for v = 2)
        return tuple(r if c % 2 == 0 else p - 1 - r for c in range(v) for r in range(p))
    ranks = [r for r in range(p) for _ in range(v)]
    rnd.shuffle(ranks)
    return tuple(ranks)


@st.composite
def valid_schedules(draw: st.DrawFn) -> Schedule:
    """Random placements and split backwards; each rank's list projects one random valid run."""
    p, v, m = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 5))
    rnd = draw(st.randoms(use_true_random=False))
    placement = _placement(draw(st.sampled_from(["interleaved", "v", "random"])), p, v, rnd)
    S, infer = p * v, draw(st.booleans()) and draw(st.booleans())
    todo = {Action(s, Kind.FORWARD, mb) for s in range(S) for mb in range(m)}
    if not infer:
        for s in range(S):
            for mb in range(m):
                kinds = (
                    [Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT]
                    if rnd.random() < 0.5
                    else [Kind.BACKWARD]
                )
                todo |= {Action(s, k, mb) for k in kinds}
    present, done = set(todo), set[Action]()
    rows: list[list[Action]] = [[] for _ in range(p)]
    while todo:
        ready = sorted((a for a in todo if set(_reads(a, present, S, _chain(S))) <= done), key=str)
        a = rnd.choice(ready)
        todo.remove(a)
        done.add(a)
        rows[placement[a.stage]].append(a)
    name = draw(st.text("abcxyz-1_", max_size=8))
    return Schedule(_tuples(rows), placement, m, forward_only=infer, name=name)


actions = st.builds(
    Action, st.integers(0, 10**6), st.sampled_from(list(Kind)), st.integers(0, 10**6)
)
quick = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- notation and text form ------------------------------------------------------------------


def test_schedules_module_imports_only_the_standard_library() -> None:
    tree = ast.parse(Path(schedules_module.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert imported <= {
        "__future__",
        "collections",
        "dataclasses",
        "difflib",
        "enum",
        "re",
        "typing",
    }, imported


def test_docstring_examples_run() -> None:
    result = doctest.testmod(schedules_module)
    assert result.attempted > 10 and result.failed == 0


@given(actions)
def test_action_round_trips(a: Action) -> None:
    assert Action.parse(str(a)) == a


@given(st.text("0123456789FBIWXf -", max_size=8))
def test_action_parse_accepts_only_its_own_notation(text: str) -> None:
    try:
        a = Action.parse(text)
    except ScheduleFormatError:
        return
    assert str(a) == text


def test_action_rejects_bad_fields() -> None:
    assert Action(1, "F", 3) == A("1F3")  # type: ignore[arg-type]  # letters are accepted at runtime
    for bad in ("1X3", "1f3", "01F3", "1F", "F3", "1F3 ", "-1F3", "1F-3", "1F1F"):
        with pytest.raises(ScheduleFormatError, match="cannot parse"):
            A(bad)
    with pytest.raises(ScheduleFormatError, match="unknown action kind 'X'"):
        Action(0, "X", 0)  # type: ignore[arg-type]
    with pytest.raises(ScheduleFormatError, match=r"stage must be an int >= 0 \(got -1"):
        Action(-1, Kind.FORWARD, 0)
    with pytest.raises(ScheduleFormatError, match="mb must be an int"):
        Action(0, Kind.FORWARD, 1.0)  # type: ignore[arg-type]


@quick
@given(valid_schedules())
def test_valid_schedule_text_round_trips(schedule: Schedule) -> None:
    assert Schedule.from_text(schedule.to_text()) == schedule


@quick
@given(
    st.lists(st.lists(actions, max_size=5), min_size=1, max_size=4),
    st.lists(st.integers(0, 9), max_size=5),
)
def test_any_schedule_text_round_trips(rows: list[list[Action]], placement: list[int]) -> None:
    schedule = Schedule(_tuples(rows), tuple(placement), 3, name="x y")
    assert Schedule.from_text(schedule.to_text()) == schedule


def test_text_form_is_one_line_per_rank() -> None:
    text = get_schedule("1f1b", 2, 4).to_text()
    assert text.splitlines()[-2:] == [
        "rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3",
        "rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3",
    ]
    commented = "# saved by hand\n\n" + text.replace("rank 1:", "# next rank\nrank 1:")
    assert Schedule.from_text(commented) == get_schedule("1f1b", 2, 4)


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "first line must be 'pipecut schedule v1'"),
        ("pipecut schedule v2\n", "not a pipecut schedule"),
        (
            "pipecut schedule v1\nmicrobatches: 2\nstage_to_rank: 0\nrank 0: 0F0 0Q1\n",
            r"line 4: cannot parse '0Q1'",
        ),
        (
            "pipecut schedule v1\nmicrobatches: 2\nstage_to_rank: 0 1\nrank 1: 1F0\n",
            "next expected: 'rank 0:'",
        ),
        (
            "pipecut schedule v1\nmicrobatches: 2\nstage_to_rank: 0\nrank 0: 0F0\nname: late\n",
            "line 5: unexpected 'name'",
        ),
        ("pipecut schedule v1\nmicrobatches: 2\nmicrobatches: 3\n", "'microbatches' given twice"),
        (
            "pipecut schedule v1\nmicrobatches: two\nstage_to_rank: 0\n",
            "needs 'microbatches: <int>'",
        ),
        ("pipecut schedule v1\nstage_to_rank: 0\n", "needs 'microbatches: <int>'"),
        (
            "pipecut schedule v1\nmicrobatches: 1\nstage_to_rank: 0\nforward_only: true\n",
            "'yes' or 'no'",
        ),
        ("pipecut schedule v1\nmicrobatches 1\n", "expected 'key: value'"),
    ],
)
def test_from_text_says_what_is_wrong(text: str, match: str) -> None:
    with pytest.raises(ScheduleFormatError, match=match):
        Schedule.from_text(text)


def test_to_text_refuses_a_name_it_cannot_read_back() -> None:
    for name in ("two\nlines", " padded"):
        with pytest.raises(ScheduleFormatError, match="cannot be written as text"):
            Schedule((), (), 1, name=name).to_text()


# -- generators and the registry -------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "forward"])
def test_generators_are_valid_on_the_whole_grid(name: str) -> None:
    for p, m in GRID:
        schedule = get_schedule(name, p, m)
        validate(schedule)
        assert schedule.stage_to_rank == tuple(range(p)) and schedule.num_microbatches == m
        assert schedule.name == name and schedule.forward_only == (name == "forward")
        per_rank = m if name == "forward" else 2 * m
        assert [len(row) for row in schedule.actions] == [per_rank] * p
        assert "[" not in format_grid(schedule)  # nothing was forced to run


def test_gpipe_holds_every_micro_batch_on_every_stage() -> None:
    for p, m in GRID:
        assert peak_inflight(gpipe(p, m)) == (m,) * p


def test_1f1b_holds_at_most_p_minus_s_micro_batches() -> None:
    for p, m in GRID:
        peak = peak_inflight(one_f_one_b(p, m))
        assert all(peak[s] <= min(m, p - s) for s in range(p)), (p, m, peak)
        assert peak == tuple(min(m, p - s) for s in range(p))  # and the bound is reached


def test_1f1b_shape_warm_up_steady_cool_down() -> None:
    for p, m in GRID:
        for s, row in enumerate(one_f_one_b(p, m).actions):
            kinds = "".join(a.kind.value for a in row)
            warmup = min(p - 1 - s, m)
            assert kinds == "F" * warmup + "FB" * (m - warmup) + "B" * warmup
            assert [a.mb for a in row if a.kind is Kind.FORWARD] == list(range(m))
            assert [a.mb for a in row if a.kind is Kind.BACKWARD] == list(range(m))


def test_split_backward_holds_the_micro_batch_until_w() -> None:
    assert peak_inflight(sched("0F0 0I0 0F1 0W0 0I1 0W1")) == (2,)
    assert peak_inflight(sched("0F0 0I0 0W0 0F1 0I1 0W1")) == (1,)
    two_stages = sched("0F0 0F1 0I0 0I1 0W0 0W1", "1F0 1B0 1F1 1B1")
    assert peak_inflight(two_stages) == (2, 1)


def test_forward_only_holds_nothing_and_runs_only_forwards() -> None:
    for p, m in GRID:
        schedule = forward_only(p, m)
        assert peak_inflight(schedule) == (0,) * p
        assert {a.kind for row in schedule.actions for a in row} == {Kind.FORWARD}


def test_registry_names_and_errors() -> None:
    assert schedule_names() == ("gpipe", "1f1b", "forward")
    assert get_schedule("1F1B", 3, 5) == one_f_one_b(3, 5)
    with pytest.raises(UnknownScheduleError) as info:
        get_schedule("gpip", 2, 2)
    assert isinstance(info.value, ValueError)
    assert (
        str(info.value)
        == "unknown schedule 'gpip' (known: 'gpipe', '1f1b', 'forward'); did you mean 'gpipe'?"
    )
    for p, m in ((0, 4), (2, 0), (2.0, 4), (True, 4)):
        with pytest.raises(ScheduleError, match="must be an int >= 1"):
            get_schedule("1f1b", p, m)  # type: ignore[arg-type]


# -- the grid ----------------------------------------------------------------------------------


def test_grid_of_1f1b_p2_m4() -> None:
    assert format_grid(one_f_one_b(2, 4)) == (
        "step    0   1   2   3   4   5   6   7   8   9\n"
        "rank 0  0F0 0F1     0B0 0F2 0B1 0F3 0B2     0B3\n"
        "rank 1      1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"
    )
    assert str(one_f_one_b(2, 4)) == format_grid(one_f_one_b(2, 4))


def test_grid_of_gpipe_p3_m2_and_wide_labels() -> None:
    assert format_grid(gpipe(3, 2)) == (
        "step    0   1   2   3   4   5   6   7\n"
        "rank 0  0F0 0F1                 0B0 0B1\n"
        "rank 1      1F0 1F1         1B0 1B1\n"
        "rank 2          2F0 2F1 2B0 2B1"
    )
    assert format_grid(forward_only(1, 12)).splitlines() == [
        "step    0    1    2    3    4    5    6    7    8    9    10   11",
        "rank 0  0F0  0F1  0F2  0F3  0F4  0F5  0F6  0F7  0F8  0F9  0F10 0F11",
    ]


def test_docs_show_the_generated_grids() -> None:
    docs = DOCS.read_text()
    assert docs.startswith("# Runtime\n") and "\n## Schedules\n" in docs
    for name in TRAINING:
        assert format_grid(get_schedule(name, 4, 8)) in docs, (
            f"docs/runtime.md has a stale {name} grid"
        )


# -- validate catches ------------------------------------------------------------------------


def test_validate_catches_a_missing_backward() -> None:
    schedule = one_f_one_b(3, 4)
    broken = Schedule((schedule.actions[0][:-1],) + schedule.actions[1:], (0, 1, 2), 4, name="1f1b")
    err = error_of(broken)
    message = str(err)
    assert message.startswith(
        "schedule '1f1b' (3 ranks, 3 stages, 4 micro-batches): never runs the backward"
    )
    assert "rank 0  0F0 0F1 0F2" in message and "<- missing 0B3" in message
    assert "Add 0B3 (or 0I3 then 0W3) to rank 0's list after 0F3." in message


def test_validate_catches_a_missing_backward_that_others_wait_for() -> None:
    rows = [" ".join(map(str, row)) for row in one_f_one_b(2, 4).actions]
    message = str(error_of(sched(rows[0], rows[1].replace(" 1B2", ""), name="1f1b")))
    assert (
        "never runs the backward of stage 1, micro-batch 2" in message
        and "<- missing 1B2" in message
    )


def test_validate_catches_a_backward_before_its_forward() -> None:
    err = error_of(sched("0F0 0F1 0B0 0B1", "1B0 1F0 1F1 1B1"))
    message = str(err)
    assert "deadlocks at step 2" in message
    assert (
        "rank 1 waits at 1B0 (position 0) for 1F0, which comes later in its own list (position 1); move 1F0 before 1B0."
        in message
    )
    assert (
        "rank 0 waits at 0B0 (position 2) for 1B0, rank 1's next action, which waits too."
        in message
    )
    assert (
        "rank 0   0F0  0F1 [0B0]                0B1\nrank 1            [1B0] 1F0  1F1  1B1\n"
        in message
    )
    assert (err.rank, err.step, err.action) == (0, 2, A("0B0"))


def test_validate_catches_an_action_on_the_wrong_rank() -> None:
    err = error_of(sched("0F0 1F0 0B0", "1B0"))
    assert (err.rank, err.action, err.step) == (0, A("1F0"), 1)
    message = str(err)
    assert (
        "rank 0 runs 1F0 (position 1 in its list), but stage 1 is on rank 1 (stage_to_rank=(0, 1))"
        in message
    )
    assert "rank 0   0F0 [1F0]      0B0" in message
    assert "Move 1F0 to rank 1's list" in message


def test_validate_catches_a_deadlocking_swap_with_grid_and_marker() -> None:
    swapped = sched("0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1", name="gpipe")
    err = error_of(swapped)
    assert (err.step, err.rank, err.action) == (2, 0, A("0B0"))
    assert str(err) == (
        "schedule 'gpipe' (2 ranks, 2 stages, 2 micro-batches): deadlocks at step 2: no rank can run its next action.\n"
        "  rank 0 waits at 0B0 (position 1) for 1B0, which rank 1 runs later (position 2), behind its own waiting 1F1.\n"
        "  rank 1 waits at 1F1 (position 1) for 0F1, which rank 0 runs later (position 2), behind its own waiting 0B0.\n"
        "\n"
        "step     0    1    2    3    4    5\n"
        "rank 0   0F0      [0B0] 0F1       0B1\n"
        "rank 1        1F0 [1F1] 1B0  1B1\n"
        "\n"
        "Cells in [brackets] wait for an input that is never ready; the grid runs them anyway to draw "
        "the rest. Reorder the lists so that every action's inputs come first (an F after the previous "
        "stage's F, a B or I after the next stage's backward), e.g. start from get_schedule('1f1b', p, m)."
    )
    assert "[0B0]" in format_grid(swapped)  # the grid alone marks it too


@pytest.mark.parametrize(
    "schedule, match",
    [
        (
            sched("0F0 0B0", "1F0 1B0 1F0"),
            r"rank 1 runs 1F0 \(position 2 in its list\) a second time \(first at position 0\)",
        ),
        (sched("0F0 0B0", "1F0 1B0", m=1, placement=(0, 1)), None),
        (sched("0F0 0F1 0B0", "1F0 1B0", m=1), "there are only micro-batches 0..0"),
        (sched("0F0 0B0 2F0", "1F0 1B0"), r"2F0 .*there are only stages 0..1"),
        (
            sched("0F0 0B0", "1F0", forward_only=True),
            r"rank 0 runs 0B0 \(position 1 in its list\) in a forward-only schedule",
        ),
        (sched("0F0 0B0 0I0 0W0"), "runs both 0B0 and a split backward"),
        (sched("0F0 0I0"), "runs 0I0 but never 0W0"),
        (sched("0F0 0W0"), "runs 0W0 but never 0I0"),
        (
            sched("0F0 0W0 0I0"),
            r"waits at 0W0 \(position 1\) for 0I0, which comes later in its own list",
        ),
        (sched("0B0", m=2), "never runs 0F0"),
        (
            sched("0F0 0B0", "1F0 1B0", placement=(0, 2)),
            r"places stage 1 on rank 2, but there are ranks 0..1",
        ),
        (sched("0F0 0B0", "", placement=(0,)), "places no stage on rank 1"),
        (Schedule(((A("0F0"),),), (0,), 0), "has num_microbatches=0"),
        (Schedule((), (), 1), "is empty"),
    ],
)
def test_validate_catches(schedule: Schedule, match: str | None) -> None:
    if match is None:
        validate(schedule)
        return
    with pytest.raises(ScheduleError, match=match) as info:
        validate(schedule)
    assert isinstance(info.value, ValueError) and "step" in str(info.value)


@quick
@given(valid_schedules(), st.randoms(use_true_random=False))
def test_validate_agrees_with_an_independent_deadlock_check(
    schedule: Schedule, rnd: random.Random
) -> None:
    validate(schedule)
    rows = [list(row) for row in schedule.actions]
    rnd.shuffle(rows[rnd.randrange(len(rows))])
    shuffled = Schedule(
        _tuples(rows), schedule.stage_to_rank, schedule.num_microbatches, schedule.forward_only
    )
    if _deadlocks(shuffled):
        message = str(error_of(shuffled))
        assert "deadlocks at step" in message and "[" in message
    else:
        validate(shuffled)
        _run_buffered(shuffled, comm_plan(shuffled), _chain(shuffled.num_stages))


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
                _run_buffered(schedule, plans, edges or _chain(p))
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
            assert _run_rendezvous(comm_plan(get_schedule(name, p, m)), batched=True), (name, p, m)
    # Without batching, 1F1B's crossing send-act / send-grad would hang on NCCL (large tensors).
    assert not _run_rendezvous(comm_plan(one_f_one_b(2, 4)), batched=False)
    assert _run_rendezvous(comm_plan(gpipe(2, 4)), batched=False)


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
    _run_buffered(schedule, comm_plan(schedule), _chain(2))


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


@quick
@given(valid_schedules(), st.randoms(use_true_random=False))
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
    _run_buffered(schedule, comm_plan(schedule, edges=edges), edges)
    peak = peak_inflight(schedule)
    if schedule.forward_only:
        assert peak == (0,) * S
    else:
        assert all(1 <= peak[s] <= schedule.num_microbatches for s in range(S))
