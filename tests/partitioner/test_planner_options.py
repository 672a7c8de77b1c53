"""The planner's option objects and the table of its old keywords (``partitioner.options``).

Every keyword ``partition`` (20 parameters) and ``plan_layout`` (21) took before the objects keeps
working for one release through ``SHORTCUTS``, and plans the same as the object form.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import (
    Capture,
    Cluster,
    Costing,
    Cut,
    LayoutSearch,
    LayoutSpace,
    PlannerKeywordError,
    partition,
    plan_layout,
)
from partitioner.errors import PartitionOptionError, SplitPointError
from partitioner.options import _SECTIONS, ENTRY_POINTS, SHORTCUTS, resolve_options

# The signatures before the option objects, word for word.
OLD_PARTITION = (
    "model", "example_inputs", "num_stages", "cluster", "microbatches", "schedule", "method", "refine",
    "split_points", "granularity", "module_depth", "leaf_modules", "state_bytes_per_param", "profile",
    "profile_device", "trace_method", "example_kwargs", "example_is", "precision", "recompute",
)
OLD_PLAN_LAYOUT = (
    "model", "example_inputs", "cluster", "global_batch", "schedules", "microbatch_sizes", "zero", "dp_sizes",
    "top", "prune", "precision", "recompute", "granularity", "module_depth", "leaf_modules",
    "state_bytes_per_param", "bucket_bytes", "profile", "profile_device", "trace_method", "example_kwargs",
)


class _Scaled(nn.Module):
    """Three linears and a keyword input, cheap to trace and cut."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        h = self.a(x) if scale is None else self.a(x) * scale
        return self.c(torch.relu(self.b(h)))  # type: ignore[no-any-return]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Scaled()


def _same(a: Any, b: Any) -> None:
    assert a.to_dict() == b.to_dict()


def test_every_old_keyword_has_a_field_in_an_object_its_entry_point_takes() -> None:
    assert len(OLD_PARTITION) == 20 and len(OLD_PLAN_LAYOUT) == 21
    for section, name in SHORTCUTS.values():
        assert name in {f.name for f in dataclasses.fields(_SECTIONS[section])}, (section, name)
    for where, old in (("partition", OLD_PARTITION), ("plan_layout", OLD_PLAN_LAYOUT)):
        for key in old:
            if key in ("model", "example_inputs") or key in ENTRY_POINTS[where]:
                continue  # still a parameter
            assert key in SHORTCUTS and SHORTCUTS[key][0] in ENTRY_POINTS[where], (where, key)
    # Nothing in the table that neither entry point took.
    assert set(SHORTCUTS) <= set(OLD_PARTITION) | set(OLD_PLAN_LAYOUT)


# Old keyword -> a value other than its default (profiling measures, so it is left to the next test).
PARTITION_VALUES: dict[str, Any] = {
    "microbatches": 4, "schedule": "gpipe", "method": "equal_count", "refine": False, "split_points": ["b"],
    "granularity": "module", "module_depth": 1, "leaf_modules": [nn.Linear], "trace_method": "fx",
    "example_kwargs": {"scale": torch.full((8, 8), 2.0)}, "example_is": "batch", "precision": "bf16",
    "recompute": True, "state_bytes_per_param": 12.0, "bucket_bytes": 1 << 20,
}


@pytest.mark.parametrize("key", sorted(PARTITION_VALUES))
def test_an_old_keyword_plans_as_its_object_does(key: str) -> None:
    section, name = SHORTCUTS[key]
    value = PARTITION_VALUES[key]
    x = (torch.randn(8, 8),)  # one micro-batch, or 8 of a row each (example_is='batch')
    old = partition(_model(), x, 2, **{key: value})
    new = partition(_model(), x, 2, **{section: _SECTIONS[section](**{name: value})})
    _same(old, new)
    assert old.to_dict() != partition(_model(), x, 2).to_dict() or key in ("leaf_modules", "trace_method",
                                                                          "module_depth", "bucket_bytes", "refine")


def test_the_profiling_keywords_land_in_costing() -> None:
    opts = resolve_options("partition", {}, {"profile": True, "profile_device": "cpu"})
    assert opts.costing == Costing(profile=True, profile_device="cpu")


def test_plan_layouts_old_keywords_plan_as_the_objects_do() -> None:
    cluster, x = Cluster.uniform(2, "cpu"), (torch.randn(1, 8),)
    old_keywords: dict[str, Any] = {
        "schedules": ["1f1b", "zbh1"], "microbatch_sizes": [1, 2], "zero": ["none", "zero1", "fsdp"],
        "dp_sizes": [1, 2], "top": 2, "prune": False, "precision": "bf16", "recompute": False,
        "granularity": "node", "leaf_modules": [nn.Linear], "state_bytes_per_param": 12.0, "bucket_bytes": 1 << 20,
        "trace_method": "fx", "example_kwargs": {"scale": torch.ones(1, 8)}, "module_depth": 1,
    }
    assert set(old_keywords) | {"profile", "profile_device"} == set(OLD_PLAN_LAYOUT) - {
        "model", "example_inputs", "cluster", "global_batch"}
    old = plan_layout(_model(), x, cluster=cluster, global_batch=4, **old_keywords)
    objects: dict[str, dict[str, Any]] = {"space": {}, "capture": {}, "costing": {}}
    for key, value in old_keywords.items():
        section, name = SHORTCUTS[key]
        objects[section][name] = value
    new = plan_layout(_model(), x, cluster=cluster, global_batch=4,
                      **{s: _SECTIONS[s](**fields) for s, fields in objects.items()})
    _same(old, new)
    assert new.layout is not None and len(new.layouts) > 1


def test_an_unknown_keyword_is_refused_with_the_closest_name() -> None:
    x = (torch.randn(4, 8),)
    with pytest.raises(PlannerKeywordError, match=r"partition\(\) got an unexpected keyword argument 'microbatch'; "
                                                  "did you mean 'microbatches'") as info:
        partition(_model(), x, 2, microbatch=4)
    assert isinstance(info.value, TypeError)
    with pytest.raises(PlannerKeywordError, match="did you mean 'zero'"):
        plan_layout(_model(), x, cluster=Cluster.uniform(2, "cpu"), global_batch=4, zeros=("none",))
    # An old keyword of an object the entry point does not take says who takes it.
    with pytest.raises(PlannerKeywordError, match=r"'zero': it sets LayoutSpace, which partition\(\) does not take"):
        partition(_model(), x, 2, zero=("none",))
    with pytest.raises(PlannerKeywordError, match=r"'microbatches': it sets Cut, .* \(partition\(\) do\)"):
        plan_layout(_model(), x, cluster=Cluster.uniform(2, "cpu"), global_batch=4, microbatches=4)


def test_an_old_keyword_beside_its_object_is_refused() -> None:
    x = (torch.randn(4, 8),)
    with pytest.raises(PartitionOptionError, match=r"microbatches=4 is the old keyword for cut=Cut\(microbatches="):
        partition(_model(), x, 2, cut=Cut(schedule="gpipe"), microbatches=4)
    with pytest.raises(PartitionOptionError, match=r"precision='bf16' is the old keyword for costing=Costing"):
        LayoutSearch(_model(), (torch.randn(1, 8),), cluster=Cluster.uniform(2, "cpu"), global_batch=4,
                     costing=Costing(), precision="bf16")
    # Beside another object it is fine: each keyword goes to its own.
    plan = partition(_model(), x, 2, cut=Cut(schedule="gpipe"), precision="bf16")
    assert (plan.schedule, plan.precision) == ("gpipe", "bf16")


def test_an_object_of_the_wrong_kind_is_refused() -> None:
    with pytest.raises(PartitionOptionError, match=r"costing= takes a partitioner.Costing, got Cut"):
        partition(_model(), (torch.randn(4, 8),), 2, costing=Cut())  # type: ignore[arg-type]


@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda: Cut(method="magic"), PartitionOptionError, "unknown method 'magic'"),
    (lambda: Cut(method="manual"), SplitPointError, "method='manual' needs split_points"),
    (lambda: Cut(schedule="nope"), PartitionOptionError, "unknown schedule 'nope'"),
    (lambda: Cut(microbatches=0), PartitionOptionError, "microbatches must be a positive int or 'auto', got 0"),
    (lambda: Cut(microbatches=True), PartitionOptionError, "microbatches must be a positive int"),
    (lambda: Costing(precision="fp8"), PartitionOptionError, "unknown precision 'fp8'"),
    (lambda: Costing(recompute="sometimes"), PartitionOptionError, "recompute='sometimes'"),
    (lambda: Capture(example_is="rows"), PartitionOptionError, "example_is must be 'microbatch' or 'batch'"),
    (lambda: LayoutSpace(zero=["zero3"]), PartitionOptionError, r"zero must list some of .*got \['zero3'\]"),
    (lambda: LayoutSpace(top=0), PartitionOptionError, "top must be a positive int"),
    (lambda: LayoutSpace(microbatch_sizes=[0]), PartitionOptionError, r"microbatch_sizes must be .*, got \[0\]"),
    (lambda: LayoutSpace(schedules=["nope"]), PartitionOptionError, "unknown schedules"),
])
def test_each_object_checks_its_fields_when_made(make: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make()


def test_objects_are_frozen_and_hold_no_lists() -> None:
    cut = Cut(split_points=["a", "b"], method="exact")
    assert cut.split_points == ("a", "b") and cut.method == "manual"  # split points are a manual cut
    assert Capture(leaf_modules=[nn.Linear]).leaf_modules == (nn.Linear,)
    assert LayoutSpace(dp_sizes=[1, 2]) == LayoutSpace(dp_sizes=(1, 2))
    assert hash(cut) == hash(Cut(split_points=("a", "b")))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cut.schedule = "gpipe"  # type: ignore[misc]


def test_a_whole_batch_example_is_partitions_alone() -> None:
    with pytest.raises(PartitionOptionError, match="takes one micro-batch as the example"):
        plan_layout(_model(), (torch.randn(4, 8),), cluster=Cluster.uniform(2, "cpu"), global_batch=4,
                    capture=Capture(example_is="batch"))


# -- docs/partitioning.md, "The planner's inputs"; docs/reference/planner-options.md, the old keywords --

PAGE = Path(__file__).resolve().parents[2] / "docs" / "partitioning.md"
KEYWORDS_PAGE = PAGE.parent / "reference" / "planner-options.md"
MARKER = "<!-- example: the planner inputs (run by tests/partitioner/test_planner_options.py) -->"


def test_the_docs_example_runs() -> None:
    text = PAGE.read_text()
    block = text.split(MARKER, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(block, f"{PAGE}:planner inputs", "exec"), {})  # its asserts are the checks


def test_the_docs_table_of_old_keywords_is_the_table() -> None:
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)\.(\w+)` \|$", KEYWORDS_PAGE.read_text(), flags=re.M)
    table = {key: (cls, name) for key, cls, name in rows}
    assert table == {key: (_SECTIONS[section].__name__, name) for key, (section, name) in SHORTCUTS.items()}
