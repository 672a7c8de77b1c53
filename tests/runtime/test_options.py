"""The trainer's option objects and the old keywords' shortcuts (runtime/options.py).

Pure tests of :func:`resolve_options` first, then in-process trainers built both ways.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import partition
from partitioner.errors import PipecutError
from partitioner.zoo import MLPChain
from runtime import DataParallel, Execution, Init, OptionKeywordError, PipelineTrainer, TrainerOptionError
from runtime.options import SHORTCUTS, TRAINER_KEYWORDS, TrainerOptions, resolve_options
from runtime.parallel.data_parallel import DEFAULT_BUCKET_BYTES
from runtime.state.materialize import empty_weights
from runtime.transport.placement import PlacementError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "reference" / "options.md"

# PipelineTrainer's keyword defaults before the option objects (its signature until this change).
OLD_DEFAULTS: dict[str, Any] = {
    "schedule": None, "microbatches": None, "chunks_per_rank": None, "transport": "auto", "devices": None,
    "timeout": 300.0, "record": False, "fuse_wgrad": True, "check_finite": False,
    "init_fn": None, "seed": 0, "weights": None,
    "data_parallel": None, "mesh": None, "overlap_grad_reduce": True, "grad_bucket_bytes": DEFAULT_BUCKET_BYTES,
    "shard_optimizer": False,
}


def _field(opts: TrainerOptions, key: str) -> Any:
    section, name = SHORTCUTS[key]
    return getattr(getattr(opts, section), name)


# -- resolve_options, pure ---------------------------------------------------------------------------


def test_the_shortcuts_are_the_old_keywords_each_in_its_object() -> None:
    assert set(SHORTCUTS) == set(OLD_DEFAULTS)
    assert SHORTCUTS["schedule"] == ("execution", "schedule")
    assert SHORTCUTS["weights"] == ("init", "weights")
    assert SHORTCUTS["data_parallel"] == ("data_parallel", "size")
    assert SHORTCUTS["shard_optimizer"] == ("data_parallel", "shard_optimizer")
    # Every field of every object that was a keyword before has exactly one shortcut; fields
    # added with the objects (the data-parallel engine) have none.
    newer = {("data_parallel", "engine"), ("data_parallel", "reshard_after_forward")}
    fields = {(section, f.name) for section, cls in [("execution", Execution), ("init", Init),
                                                     ("data_parallel", DataParallel)]
              for f in dataclasses.fields(cls)}
    assert sorted(SHORTCUTS.values()) == sorted(fields - newer)


def test_defaults_are_the_old_keywords_defaults() -> None:
    opts = resolve_options()
    assert opts == TrainerOptions(Execution(), Init(), DataParallel())
    for key, default in OLD_DEFAULTS.items():
        assert _field(opts, key) == default, key


@pytest.mark.parametrize("key", sorted(OLD_DEFAULTS))
def test_each_shortcut_lands_in_its_field(key: str) -> None:
    value = object()  # a value no default equals
    opts = resolve_options(**{key: value})
    assert _field(opts, key) is value
    others = {k for k in OLD_DEFAULTS if k != key}
    assert all(_field(opts, k) == OLD_DEFAULTS[k] for k in others)


def test_the_objects_pass_through_and_an_int_is_a_data_parallel_size() -> None:
    ex, init, dp = Execution(schedule="zbh1", microbatches=8), Init(seed=3), DataParallel(size=2)
    assert resolve_options(ex, init, dp) == TrainerOptions(ex, init, dp)
    assert resolve_options(data_parallel=2, shard_optimizer=True).data_parallel == DataParallel(
        size=2, shard_optimizer=True)
    # Shortcuts of one object combine with another object given whole.
    opts = resolve_options(ex, seed=5, data_parallel=4)
    assert opts.execution is ex and opts.init == Init(seed=5) and opts.data_parallel == DataParallel(size=4)


def test_options_are_frozen_keyword_only_and_a_device_list_becomes_a_tuple() -> None:
    ex = Execution(devices=["cpu", "cpu"])
    assert ex.devices == ("cpu", "cpu") and hash(ex) == hash(Execution(devices=("cpu", "cpu")))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ex.schedule = "gpipe"  # type: ignore[misc]
    with pytest.raises(TypeError):
        Execution("gpipe")  # type: ignore[misc]


def test_a_shortcut_beside_its_object_is_refused_with_where_to_put_it() -> None:
    with pytest.raises(TrainerOptionError, match=re.escape(
            "schedule='zbh1' is a shortcut for execution=Execution(schedule=...), and execution= was given too: "
            "set it there, e.g. execution=dataclasses.replace(execution, schedule='zbh1')")):
        resolve_options(Execution(schedule="gpipe"), schedule="zbh1")
    with pytest.raises(TrainerOptionError, match=r"shard_optimizer=True .* data_parallel=DataParallel"):
        resolve_options(data_parallel=DataParallel(size=2), shard_optimizer=True)
    with pytest.raises(TrainerOptionError, match=r"seed=1 .* init=Init\(seed=...\)"):
        resolve_options(init=Init(), seed=1)  # even when the object holds the default
    assert issubclass(TrainerOptionError, PipecutError) and issubclass(TrainerOptionError, ValueError)


def test_an_object_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(TrainerOptionError, match=r"execution= takes a runtime.Execution, got str 'zbh1'"):
        resolve_options(execution="zbh1")  # type: ignore[arg-type]
    with pytest.raises(TrainerOptionError, match=r"init= takes a runtime.Init, got Execution"):
        resolve_options(init=Execution())  # type: ignore[arg-type]


def test_an_unknown_keyword_names_the_closest_one() -> None:
    with pytest.raises(OptionKeywordError, match=r"unexpected keyword argument 'shedule'; did you mean 'schedule'"):
        resolve_options(shedule="zbh1")
    with pytest.raises(OptionKeywordError, match=r"'precison'; did you mean 'precision'"):
        resolve_options(precison="bf16")
    with pytest.raises(OptionKeywordError, match=r"'size': it is a field of DataParallel, pass "
                                                 r"data_parallel=DataParallel\(size=...\)"):
        resolve_options(size=2)
    with pytest.raises(OptionKeywordError, match=r"'frobnicate'\. It takes the keywords optimizer, .*shortcuts "
                                                 r"schedule, microbatches"):
        resolve_options(frobnicate=1)
    assert issubclass(OptionKeywordError, PipecutError) and issubclass(OptionKeywordError, TypeError)


def test_the_trainer_takes_at_most_12_parameters_and_no_old_keyword() -> None:
    params = [p for p in inspect.signature(PipelineTrainer.__init__).parameters.values() if p.name != "self"]
    assert len(params) <= 12, [p.name for p in params]
    assert params[-1].kind is inspect.Parameter.VAR_KEYWORD
    named = {p.name for p in params[:-1]}
    assert named - {"plan", "loss_fn"} == set(TRAINER_KEYWORDS)  # the suggestions know every keyword
    assert named & set(SHORTCUTS) == {"data_parallel"}  # the object's parameter, taking an int too
    for name in ("execution", "init", "data_parallel"):
        assert inspect.signature(PipelineTrainer.__init__).parameters[name].default is None


def test_the_docs_table_lists_every_shortcut() -> None:
    text = DOCS.read_text()
    section = text[text.index("## The old keywords"):]
    section = section.split("\n## ", 1)[0]  # to the next section, or the page's end
    for key, (where, name) in SHORTCUTS.items():
        cls = {"execution": "Execution", "init": "Init", "data_parallel": "DataParallel"}[where]
        assert f"| `{key}=` | `{cls}.{name}` |" in section, key


# -- trainers built both ways ------------------------------------------------------------------------


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def _meta_plan() -> Any:
    with empty_weights():
        model = MLPChain((16, 48, 24, 64, 32, 8))
    return partition(model, (torch.randn(2, 16),), 2, microbatches=2)


def test_a_trainer_from_objects_equals_one_from_the_old_keywords() -> None:
    """Loss, gradients and weights after a step are the same bits; both materialise the same
    meta model (Init's seed), run ZB-H1 with 4 micro-batches and record."""
    opt = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    new = PipelineTrainer(
        _meta_plan(), _mse, opt,
        execution=Execution(schedule="zbh1", microbatches=4, transport="local", record=True, check_finite=True),
        init=Init(seed=7),
    )
    old = PipelineTrainer(_meta_plan(), _mse, opt, schedule="zbh1", microbatches=4, transport="local",
                          record=True, check_finite=True, seed=7)
    assert new.options == old.options
    assert (new.m, new.schedule.name, new.mode, new.record) == (4, "zbh1", "local", True)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
    torch.testing.assert_close(new.forward_backward(x, y), old.forward_backward(x, y), rtol=0, atol=0)
    grads = {n: prm.grad for n, prm in old.named_parameters()}
    for name, prm in new.named_parameters():
        torch.testing.assert_close(prm.grad, grads[name], rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    new.step(x, y)
    old.step(x, y)
    weights = dict(old.named_parameters())
    for name, prm in new.named_parameters():
        torch.testing.assert_close(prm, weights[name], rtol=0, atol=0)
    assert len(new.timeline().spans) == len(old.timeline().spans) == 2 * 4 * 3  # F, I, W per stage and mb


def test_the_trainer_refuses_typos_and_doubled_options_before_building_anything() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    plan = partition(copy.deepcopy(model), (torch.randn(2, 4),), 2, microbatches=2)
    with pytest.raises(OptionKeywordError, match=r"'microbatch'; did you mean 'microbatches'"):
        PipelineTrainer(plan, _mse, microbatch=4)
    with pytest.raises(TrainerOptionError, match=r"record=True is a shortcut for execution=Execution"):
        PipelineTrainer(plan, _mse, execution=Execution(schedule="gpipe"), record=True)
    # The object and the old int refuse replicas in one process alike.
    with pytest.raises(PlacementError) as by_int:
        PipelineTrainer(plan, _mse, data_parallel=2)
    with pytest.raises(PlacementError) as by_object:
        PipelineTrainer(plan, _mse, data_parallel=DataParallel(size=2))
    assert str(by_int.value) == str(by_object.value)
    assert "microbatches=4" in str(by_object.value)
