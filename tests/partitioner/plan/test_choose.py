"""schedule='auto' / microbatches='auto' and simulator-backed predictions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from partitioner import Cluster, DeviceSpec, InfeasibleMemoryError, Plan, partition
from partitioner.errors import PartitionOptionError
from partitioner.plan.choose import TIE, pick
from partitioner.plan.plan import Candidate
from partitioner.plan.predict import stage_inflight
from partitioner.schedule.registry import TRAINING_SCHEDULES
from partitioner.zoo import MLPChain


def _model() -> tuple[MLPChain, torch.Tensor]:
    return MLPChain((128,) * 13), torch.randn(16, 128)


def test_auto_tries_every_schedule_and_count_and_keeps_the_fastest_that_fits(tmp_path: Path) -> None:
    model, x = _model()
    plan = partition(model, (x,), cluster=Cluster.uniform(4, "A100-80GB"), schedule="auto", microbatches="auto")
    tried = {(c.schedule, c.microbatches) for c in plan.candidates}
    assert tried == {(s, m) for s in TRAINING_SCHEDULES for m in (4, 8, 16, 32)}
    fit = [c for c in plan.candidates if c.fits]
    best = min(c.time_per_microbatch for c in fit)
    won = next(c for c in plan.candidates if (c.schedule, c.microbatches) == (plan.schedule, plan.microbatches))
    assert won.fits and won.time_per_microbatch <= best * (1 + TIE)
    assert plan.num_stages == 4 * (2 if plan.schedule in ("interleaved", "zbv") else 1)
    assert plan.choice.startswith(f"{plan.schedule} with {plan.microbatches} micro-batches")
    assert "schedule choice" in str(plan) and "<- chosen" in str(plan)
    plan.save(tmp_path / "auto.json")
    assert Plan.load(tmp_path / "auto.json") == plan
    staged = plan.build_stages()
    torch.testing.assert_close(staged(x)[0], model(x))


def test_auto_respects_memory() -> None:
    model, x = _model()
    free = partition(model, (x,), cluster=Cluster.uniform(2, "A100-80GB"), schedule="gpipe", microbatches=16)
    # Room for 1F1B's two micro-batches on stage 0, not for GPipe's sixteen.
    cap = free.stages[0].state_bytes + 3 * free.stages[0].act_bytes
    dev = DeviceSpec("small", 312e12, 19.5e12, 2e12, cap)
    # Without recomputation (with it, GPipe fits by recomputing: tests/partitioner/plan/test_plan_recompute.py).
    plan = partition(model, (x,), cluster=Cluster.uniform(2, dev), schedule="auto", microbatches=16,
                     recompute=False)
    gpipe = next(c for c in plan.candidates if c.schedule == "gpipe")
    assert not gpipe.fits and plan.schedule != "gpipe"
    won = next(c for c in plan.candidates if (c.schedule, c.microbatches) == (plan.schedule, plan.microbatches))
    assert won.fits and won.memory <= dev.memory


def test_pick_breaks_ties_towards_fewer_microbatches_and_explains() -> None:
    a = Candidate("1f1b", 16, 4, 16.0, 1.000, 0.1, 1.0, 2.0, True)
    b = Candidate("zbh1", 8, 4, 8.05, 1.006, 0.1, 1.0, 2.0, True)
    c = Candidate("gpipe", 32, 4, 30.0, 0.94, 0.1, 3.0, 2.0, False, "no cut fits memory")
    best, why = pick([a, b, c])
    assert best is b  # within 1% of a, and fewer micro-batches
    assert "ties" in why and "1 candidate(s) do not fit memory" in why
    with pytest.raises(InfeasibleMemoryError, match="No schedule and micro-batch count fits"):
        pick([c])


def test_stage_inflight_follows_each_schedule() -> None:
    assert stage_inflight("gpipe", 4, 8) == (8, 8, 8, 8)
    assert stage_inflight("1f1b", 4, 8) == (4, 3, 2, 1)
    assert max(stage_inflight("zbh1", 4, 8)) <= 4


def test_two_chunk_schedules_cut_two_stages_per_device() -> None:
    model, x = _model()
    plan = partition(model, (x,), cluster=Cluster.uniform(3, "A100-80GB"), schedule="zbv", microbatches=6)
    assert plan.num_stages == 6
    assert "on 3 x A100-80GB (2 stages per device)" in str(plan)
    assert [pr.schedule for pr in plan.predictions] == ["zbv"]
    with pytest.raises(ValueError, match="multiple of 2") as info:
        partition(model, (x,), 5, schedule="interleaved")
    assert isinstance(info.value, PartitionOptionError)


def test_unknown_schedule_lists_the_known_ones() -> None:
    model, x = _model()
    with pytest.raises(ValueError, match="choose one of 1f1b, zbh1, interleaved, zbv, gpipe or 'auto'") as info:
        partition(model, (x,), 2, schedule="zb-h2")
    assert isinstance(info.value, PartitionOptionError)


def test_stage_zero_backward_is_all_weight_work_in_split_schedules() -> None:
    from partitioner.plan.plan import StagePlan
    from partitioner.plan.predict import simulate_stages

    stages = [
        StagePlan(s, "cpu", ("n",), "", 0, 0.0, 0.0, 0.0, 1e9, 1, 1.0, 2.0, 0.0, 0.0, 0.0, wgrad_time=1.0)
        for s in range(3)
    ]
    _, sim = simulate_stages(stages, Cluster.uniform(3, "cpu", link_latency=0.0), "zbh1", 4)
    spans = {(sp.stage, str(sp.kind)): sp.end - sp.start for sp in sim.timeline.spans}
    assert spans[(0, "I")] == 0.0 and spans[(0, "W")] == 2.0  # nothing to send back from stage 0
    assert spans[(1, "I")] == 1.0 and spans[(1, "W")] == 1.0
