"""Plan files are validated on load: a field of the wrong type, NaN, a negative size, an unknown
schedule or key is a PlanFieldError naming the field, even with the checksum recomputed."""

from __future__ import annotations

import copy
import functools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner import Plan, PlanFormatError, partition
from partitioner.errors import PlanFieldError
from partitioner.plan.plan import _checksum
from partitioner.zoo import MLPChain

# Checked before the schema, each with its own message (tests/partitioner/plan/test_plan.py).
_HEADER = {"format", "version", "checksum"}


@functools.cache
def _plan() -> Plan:
    model = MLPChain((16, 32, 16, 32, 8))
    # schedule and micro-batches 'auto': the file holds a candidate table too.
    return partition(model, (torch.randn(4, 16),), 2, microbatches="auto", schedule="auto")


@pytest.fixture
def plan() -> Plan:
    return _plan()


def _edited(plan: Plan, path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    data = copy.deepcopy(plan.to_dict())
    data = json.loads(json.dumps(data))  # as a file holds it: lists, not tuples
    holder = data
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value
    data["checksum"] = _checksum(data)  # a consistent checksum: only the schema can refuse it
    return data


def _name(path: tuple[Any, ...]) -> str:
    """``('stages', 1, 'memory')`` as the error names it: ``stages[1].memory``."""
    text = ""
    for key in path:
        text += f"[{key}]" if isinstance(key, int) else f".{key}" if text else key
    return text


def _leaves(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """Every scalar of a plan's JSON with its path (map keys of shared_params / param_aliases aside)."""
    if isinstance(node, dict):
        if path and path[-1] in ("shared_params", "param_aliases"):
            return []
        return [leaf for k, v in node.items() for leaf in _leaves(v, (*path, k))]
    if isinstance(node, list):
        return [leaf for i, v in enumerate(node) for leaf in _leaves(v, (*path, i))]
    return [] if path[0] in _HEADER else [(path, node)]


@pytest.mark.parametrize(
    ("path", "value", "allowed"),
    [
        (("stages", 1, "params"), "abc", "an integer >= 0"),
        (("stages", 1, "memory"), math.nan, "a finite number >= 0"),
        (("stages", 1, "memory"), -1.0, "a finite number >= 0"),
        (("stages", 0, "capacity"), -1, "a finite number >= 0, or null (unlimited)"),
        (("stages", 0, "fwd_time"), math.inf, "a finite number >= 0"),
        (("stages", 0, "recompute"), 0, "true or false"),
        (("stages", 0, "nodes", 0), 7, "a string"),
        (("microbatches",), True, "an integer >= 1"),
        (("microbatches",), 4.5, "an integer >= 1"),
        (("microbatches",), 4.0, "an integer >= 1"),
        (("schedule",), "bogus", "one of 'gpipe', '1f1b'"),
        (("predictions", 0, "bubble"), 1.5, "a finite number from 0 to 1"),
        (("cluster", "devices", 1, "memory"), -1.0, "a finite number >= 0, or null"),
        (("io", 0, "inputs", 0, "shape", 0), -3, "an integer >= 0"),
        (("candidates", 0, "schedule"), "bogus", "one of "),
        (("precision",), "fp8", "one of 'fp32', 'bf16', 'fp16'"),
    ],
    ids=lambda x: _name(x) if isinstance(x, tuple) else None,
)
def test_a_bad_field_is_refused_naming_it(plan: Plan, tmp_path: Path, path: tuple[Any, ...], value: Any,
                                          allowed: str) -> None:
    file = tmp_path / "p.json"
    file.write_text(json.dumps(_edited(plan, path, value)))
    with pytest.raises(PlanFieldError) as info:
        Plan.load(file)
    err = info.value
    assert isinstance(err, PlanFormatError) and isinstance(err, ValueError)
    assert err.field == _name(path)
    assert f"field {_name(path)} is {value!r}, expected {allowed}" in str(err)
    assert str(file) in str(err) and "re-create it" in str(err)


@pytest.mark.parametrize("where", [(), ("stages", 1), ("cluster", "devices", 0), ("predictions", 0)],
                         ids=["top", "stage", "device", "prediction"])
def test_an_unknown_key_is_refused(plan: Plan, where: tuple[Any, ...]) -> None:
    with pytest.raises(PlanFieldError, match=rf"field {re_name(_name((*where, 'extra')))} is not a field") as info:
        Plan.from_dict(_edited(plan, (*where, "extra"), 1))
    assert info.value.field == _name((*where, "extra"))


def re_name(name: str) -> str:
    return name.replace("[", r"\[").replace("]", r"\]")


def test_a_missing_key_is_refused(plan: Plan) -> None:
    data = _edited(plan, ("stages", 0, "memory"), 0.0)
    del data["stages"][0]["memory"]
    data["checksum"] = _checksum(data)
    with pytest.raises(PlanFieldError, match=r"field stages\[0\].memory is missing, expected a finite number"):
        Plan.from_dict(data)


def test_a_valid_plan_round_trips(plan: Plan, tmp_path: Path) -> None:
    assert plan.candidates  # the candidate table is checked too
    plan.save(tmp_path / "p.json")
    loaded = Plan.load(tmp_path / "p.json")
    assert loaded == plan and str(loaded) == str(plan)
    assert Plan.from_dict(plan.to_dict()) == plan  # the dict itself, tuples and all
    # An unlimited capacity is written as null and read back as infinity.
    assert Plan.from_dict(_edited(plan, ("stages", 0, "capacity"), None)).stages[0].capacity == math.inf


def _wrong_values(value: Any) -> list[Any]:
    """Values no field holding ``value`` takes."""
    if isinstance(value, bool):
        return [1, "true", None]
    if isinstance(value, int):  # integer fields: no bool, no float, nothing below -1 (a graph input)
        return [True, 4.5, float(value), "abc", math.nan, -5]
    if isinstance(value, float):
        return [True, "abc", math.nan, -math.inf, -5.0]
    if isinstance(value, str):
        return [123, True, math.nan, ["x"]]
    return [[1], {"a": 1}]  # null: an optional record (layout) or an unlimited number


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_field_mutated_to_a_wrong_value_is_named(data: st.DataObject) -> None:
    plan = _plan()
    path, value = data.draw(st.sampled_from(_leaves(json.loads(json.dumps(plan.to_dict())))), label="field")
    wrong = data.draw(st.sampled_from(_wrong_values(value)), label="wrong value")
    with pytest.raises(PlanFieldError) as info:
        Plan.from_dict(_edited(plan, path, wrong))
    assert info.value.field == _name(path)
    assert repr(info.value.value) == repr(wrong)
    assert f"field {_name(path)} is {wrong!r}" in str(info.value)
