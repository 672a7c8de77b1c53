"""schedules.py: the IR (actions, schedules), its text form and the registry; the pure modules stay pure.

Legend: ``p`` ranks, ``m`` micro-batches, ``v`` stages per rank, ``S`` stages, ``s`` a stage,
``r`` a rank, ``mb`` a micro-batch.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from partitioner.schedule.actions import Action, Kind, dependencies
from partitioner.schedule.errors import ScheduleError, ScheduleFormatError, UnknownScheduleError
from partitioner.schedule.generators import interleaved, one_f_one_b
from partitioner.schedule.ir import Schedule
from partitioner.schedule.registry import get_schedule, schedule_names
from partitioner.schedule.zero_bubble import zbh1, zbv
from schedule_cases import A, actions, quick, tuples, valid_schedules

# The pure modules: plain data in, plain data out; no torch, no third-party imports.
PURE = (
    "actions", "ir", "grid", "registry", "errors", "generators", "zero_bubble", "validation", "comm", "simulate",
    "timeline",
)
STDLIB = set(sys.stdlib_module_names)


# -- purity and examples ---------------------------------------------------------------------


@pytest.mark.parametrize("name", PURE)
def test_pure_modules_import_only_the_standard_library_and_each_other(name: str) -> None:
    module = importlib.import_module(f"partitioner.schedule.{name}")
    tree = ast.parse(Path(module.__file__ or "").read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    siblings: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("partitioner.schedule."):
                siblings.add(node.module.removeprefix("partitioner.schedule."))
            else:
                imported.add(node.module.split(".")[0])
    if name == "timeline":  # matplotlib, optional, is imported inside save_gantt_png only
        imported.discard("matplotlib")
    assert imported <= STDLIB, imported
    assert siblings <= set(PURE), siblings


@pytest.mark.parametrize("name", [name for name in PURE if name != "errors"])  # errors: classes only
def test_docstring_examples_run(name: str) -> None:
    result = doctest.testmod(importlib.import_module(f"partitioner.schedule.{name}"))
    assert result.attempted >= 2 and result.failed == 0


# -- actions and dependencies ------------------------------------------------------------------


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


def test_dependencies_follow_the_chain() -> None:
    present = {A("0F0"), A("1F0"), A("2F0"), A("1I0"), A("1W0"), A("2B0")}
    assert dependencies(A("0F0"), present, 3) == ()
    assert dependencies(A("2F0"), present, 3) == (A("1F0"),)
    assert dependencies(A("2B0"), present, 3) == (A("2F0"),)  # the last stage has its loss
    assert dependencies(A("1I0"), present, 3) == (A("1F0"), A("2B0"))  # fused B upstream
    assert dependencies(A("0B0"), present, 3) == (A("0F0"), A("1I0"))  # split I upstream
    assert dependencies(A("1W0"), present, 3) == (A("1I0"),)


# -- the registry ------------------------------------------------------------------------------


def test_registry_names_aliases_and_errors() -> None:
    assert schedule_names() == ("gpipe", "1f1b", "forward", "interleaved", "zbh1", "zbv")
    assert get_schedule("1F1B", 3, 5) == one_f_one_b(3, 5)
    assert get_schedule("interleaved", 3, 6) == interleaved(3, 6, 2)
    assert get_schedule("Interleaved-1F1B", 3, 6, v=3) == interleaved(3, 6, v=3)
    assert get_schedule("zbh1", 4, 8) == zbh1(4, 8)
    assert get_schedule("zbv", 4, 8) == zbv(4, 8)
    with pytest.raises(UnknownScheduleError) as info:
        get_schedule("gpip", 2, 2)
    assert isinstance(info.value, ValueError)
    assert str(info.value) == (
        "unknown schedule 'gpip' (known: 'gpipe', '1f1b', 'forward', 'interleaved', 'zbh1', "
        "'zbv', 'interleaved-1f1b'); did you mean 'gpipe'?"
    )
    for name in schedule_names():
        for p, m in ((0, 4), (2, 0), (2.0, 4), (True, 4)):
            with pytest.raises(ScheduleError, match=f"{name}: . .* must be an int >= 1"):
                get_schedule(name, p, m)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match=r"interleaved: v \(stages per rank\) must be an int"):
        get_schedule("interleaved", 2, 4, v=0)
    with pytest.raises(TypeError):
        get_schedule("zbv", 2, 4, v=2)  # ZB-V has exactly two chunks per rank


# -- the text form -----------------------------------------------------------------------------


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
    schedule = Schedule(tuples(rows), tuple(placement), 3, name="x y")
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
