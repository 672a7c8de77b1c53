"""plan_layout on real models: the brute-force best, the cut it prices, the plan it returns, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner import Cluster, Plan, partition, plan_layout
from partitioner.errors import PartitionOptionError
from partitioner.plan.layout import ZERO_OPTIONS, pick


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(96, 96), nn.ReLU()) for _ in range(6)])


@pytest.fixture(scope="module")
def searched() -> tuple[Plan, Plan]:
    """The same small search pruned and by brute force (every layout priced)."""
    model, cluster = _mlp(), Cluster.uniform(4, "cpu")
    kw = dict(cluster=cluster, global_batch=16, microbatch_sizes=(1, 2, 4, 8), zero=ZERO_OPTIONS)
    return (plan_layout(model, (torch.randn(1, 96),), **kw),  # type: ignore[arg-type]
            plan_layout(model, (torch.randn(1, 96),), prune=False, **kw))  # type: ignore[arg-type]


def test_the_search_returns_the_brute_force_best(searched: tuple[Plan, Plan]) -> None:
    pruned, brute = searched
    assert pruned.layout == brute.layout
    assert pick(brute.layouts)[0].option == brute.layout.option  # type: ignore[union-attr]
    assert sum(r.priced for r in pruned.layouts) <= sum(r.priced for r in brute.layouts)
    assert {r.zero for r in brute.layouts if r.priced} == {"none", "zero1", "fsdp"}  # every sharding compared
    fits = [r for r in brute.layouts if r.fits]
    assert fits and all(r.step_time >= brute.layout.step_time * 0.99 for r in fits)  # type: ignore[union-attr]


def test_a_priced_pipeline_is_partitions_own_prediction(searched: tuple[Plan, Plan]) -> None:
    # Costs scaled from a 1-row example equal costs traced at the micro-batch's rows: the search's
    # pipeline time of a single-replica layout is what partition() predicts for that cut.
    _, brute = searched
    for lay in [r for r in brute.layouts if r.priced and r.dp == 1 and r.zero == "none"][:6]:
        plan = partition(_mlp(), (torch.randn(lay.microbatch_size, 96),), lay.stages,
                         cluster=Cluster.uniform(lay.pp, "cpu"), schedule=lay.schedule, microbatches=lay.microbatches)
        assert lay.pipeline_time == pytest.approx(plan.prediction(lay.schedule).step_time, rel=1e-6)
        assert lay.memory == pytest.approx(plan.prediction(lay.schedule).memory, rel=1e-6)


def test_the_plan_is_the_chosen_layouts_and_round_trips(searched: tuple[Plan, Plan], tmp_path) -> None:
    plan, _ = searched
    lay = plan.layout
    assert lay is not None and lay.note == "chosen" and lay.fits
    assert (plan.num_stages, plan.schedule, plan.microbatches, plan.microbatch_size) == (
        lay.stages, lay.schedule, lay.microbatches, lay.microbatch_size)
    assert lay.dp * lay.microbatches * lay.microbatch_size == 16 and lay.dp * lay.pp == 4
    path = tmp_path / "plan.json"
    plan.save(path)
    back = Plan.load(path)
    assert back.layout == lay and back.layouts == plan.layouts and back.choice == plan.choice
    text = str(plan)
    assert text.startswith("pipecut layout: 4 devices") and "layouts ranked by predicted step time" in text
    assert "chosen" in text and "pipecut plan:" in text


def test_zero1_shards_the_optimizer_state_in_the_memory_it_predicts() -> None:
    model = _mlp()
    kw = dict(cluster=Cluster.uniform(2, "cpu"), global_batch=8, microbatch_sizes=(4,), schedules=("1f1b",),
              dp_sizes=(2,), prune=False)
    rows = {r.zero: r for r in plan_layout(model, (torch.randn(1, 96),), **kw).layouts}  # type: ignore[arg-type]
    params = sum(p.numel() for p in model.parameters())
    assert rows["none"].memory - rows["zero1"].memory == pytest.approx(params * 8 / 2)  # Adam's 8 bytes, halved
    assert rows["zero1"].exchange_bytes == pytest.approx(rows["none"].exchange_bytes)  # reduce + broadcast


def test_a_cluster_too_small_for_the_model_says_so() -> None:
    tiny = Cluster.uniform(2, Cluster.uniform(1, "cpu").devices[0].__class__(
        "tiny", 1e9, 1e9, 1e9, memory=1e5))
    with pytest.raises(Exception, match="No layout fits"):
        plan_layout(_mlp(), (torch.randn(1, 96),), cluster=tiny, global_batch=4)


@pytest.mark.parametrize("kw, match", [
    (dict(global_batch=0), "global_batch"),
    (dict(global_batch=3, dp_sizes=(2,)), "no layout"),
    (dict(global_batch=4, schedules=("nope",)), "unknown schedules"),
    (dict(global_batch=4, zero=("zero3",)), "zero"),
    (dict(global_batch=4, top=0), "top"),
    (dict(global_batch=4, microbatch_sizes=(0,)), "microbatch_sizes"),
])
def test_bad_arguments_are_refused(kw: dict, match: str) -> None:
    with pytest.raises(PartitionOptionError, match=match):
        plan_layout(_mlp(), (torch.randn(1, 96),), cluster=Cluster.uniform(2, "cpu"), **kw)


def test_the_model_and_global_state_are_left_as_found() -> None:
    model = _mlp().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(1, 96)
    grad, dtype, rng = torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_rng_state()
    plan_layout(model, (x,), cluster=Cluster.uniform(2, "cpu"), global_batch=4)
    assert model.training and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.is_grad_enabled() == grad and torch.get_default_dtype() == dtype
    assert torch.equal(torch.get_rng_state(), rng)
