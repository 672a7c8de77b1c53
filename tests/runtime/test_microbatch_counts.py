"""Impossible micro-batch counts are refused at the door, in well under a second, with the values and the fix.

Each case once ran silently (``microbatches=0`` meant the plan's count), or hung building a
schedule of billions of actions (``microbatches=10**7``).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

from parity import case, make_trainer
from partitioner import Cluster, Plan, partition
from partitioner.errors import PartitionOptionError
from partitioner.schedule.errors import ScheduleSizeError
from partitioner.schedule.generators import MAX_ACTIONS, check_size
from partitioner.schedule.registry import get_schedule, stage_schedule
from pipecut.cli import main
from runtime.execute.microbatch import MicrobatchError, split_microbatches
from runtime.trainer import PipelineTrainer


@pytest.fixture(scope="module")
def plan() -> Plan:
    c = case("mlp", 2)
    return partition(c["model"], c["example"], 2, microbatches=4, schedule="1f1b")


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4"])
def test_trainer_refuses_a_count_that_is_not_an_int_of_at_least_one(plan: Plan, bad: object) -> None:
    with pytest.raises(MicrobatchError, match=r"Execution\(microbatches=\.\.\.\) must be an int >= 1") as info:
        PipelineTrainer(plan, nn.functional.mse_loss, None, microbatches=bad)
    assert repr(bad) in str(info.value) and "None to use the plan's count" in str(info.value)


def test_trainer_refuses_a_schedule_too_large_to_build_at_once(plan: Plan) -> None:
    t0 = time.perf_counter()
    with pytest.raises(ScheduleSizeError, match="10000000 micro-batches") as info:
        PipelineTrainer(plan, nn.functional.mse_loss, None, microbatches=10**7)
    assert time.perf_counter() - t0 < 1.0
    assert isinstance(info.value, ValueError)
    most = MAX_ACTIONS // (2 * 2)
    assert f"use at most {most} micro-batches" in str(info.value)


def test_more_micro_batches_than_rows_fails_at_the_first_step_with_the_fix() -> None:
    trainer = make_trainer(case("mlp", 2), 2, "gpipe", microbatches=16)
    with pytest.raises(MicrobatchError, match="a batch of 8 rows cannot be cut into 16 micro-batches") as info:
        trainer.forward_backward(torch.randn(8, 16), torch.randn(8, 8))
    assert "microbatches <= 8" in str(info.value)
    with pytest.raises(MicrobatchError, match="a batch of 0 rows"):
        split_microbatches(torch.zeros(0, 3), 2)


def test_partition_refuses_bool_and_oversize_counts_before_tracing() -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    with pytest.raises(PartitionOptionError, match="got True"):
        partition(model, (torch.randn(2, 4),), 2, microbatches=True)
    t0 = time.perf_counter()
    with pytest.raises(ScheduleSizeError, match="MAX_ACTIONS"):
        partition(model, (torch.randn(2, 4),), 2, cluster=Cluster.uniform(2, "cpu"), microbatches=10**7)
    assert time.perf_counter() - t0 < 1.0


def test_generators_refuse_past_the_cap_and_build_up_to_it() -> None:
    check_size("zbh1", 64, 4096, 3)  # the documented size fits
    check_size("gpipe", 1, MAX_ACTIONS // 2, 2)  # exactly the cap
    with pytest.raises(ScheduleSizeError, match="use at most 1048576 micro-batches"):
        check_size("gpipe", 1, MAX_ACTIONS // 2 + 1, 2)
    for build in (lambda: get_schedule("zbv", 32, 10**7), lambda: stage_schedule("interleaved", 64, 10**7),
                  lambda: get_schedule("forward", 64, 10**7)):
        t0 = time.perf_counter()
        with pytest.raises(ScheduleSizeError):
            build()
        assert time.perf_counter() - t0 < 1.0


def test_cli_simulate_refuses_zero_and_oversize_counts(
    plan: Plan, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    js = tmp_path / "plan.json"
    plan.save(js)
    with pytest.raises(SystemExit):  # argparse's usage error, not the plan's count
        main(["simulate", str(js), "--microbatches", "0"])
    assert "expected a positive integer, got 0" in capsys.readouterr().err
    t0 = time.perf_counter()
    assert main(["simulate", str(js), "--microbatches", str(10**7)]) == 2
    assert time.perf_counter() - t0 < 1.0
    assert "MAX_ACTIONS" in capsys.readouterr().err
