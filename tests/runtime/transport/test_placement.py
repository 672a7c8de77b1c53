"""placement.py: the schedule for a plan's stage count, per-stage devices, and the NCCL guard."""

from __future__ import annotations

import pytest
import torch

from partitioner.plan.split import StageIO, ValueSpec
from runtime.transport import placement
from runtime.transport.placement import PlacementError, check_backend, placed_schedule, stage_devices


def test_placed_schedule_puts_v_stages_on_each_rank() -> None:
    for name, S, ranks in [("1f1b", 3, 3), ("zbh1", 4, 4), ("interleaved", 6, 3), ("zbv", 6, 3), ("gpipe", 1, 1)]:
        sched = placed_schedule(name, S, 4, None)
        assert (sched.num_stages, sched.num_ranks) == (S, ranks), name
    assert placed_schedule("interleaved-1f1b", 6, 4, 3).num_ranks == 2
    with pytest.raises(PlacementError, match="partition into 4 or 6 stages"):
        placed_schedule("interleaved", 5, 4, None)
    with pytest.raises(PlacementError, match="partition into 2 stages"):
        placed_schedule("zbv", 1, 4, None)
    with pytest.raises(PlacementError, match="int >= 1"):
        placed_schedule("interleaved", 4, 4, 0)


def test_stage_devices_default_and_length() -> None:
    sched = placed_schedule("zbv", 4, 4, None)
    assert stage_devices(None, 4, sched) == {s: torch.device("cpu") for s in range(4)}
    assert set(stage_devices("cpu:0", 4, sched).values()) == {torch.device("cpu:0")}
    with pytest.raises(PlacementError, match="4 stages, 2 devices"):
        stage_devices(["cpu", "cpu"], 4, sched)


def _chain_ios(S: int) -> list[StageIO]:
    def val(s: int) -> ValueSpec:
        return ValueSpec(f"h{s}", s, (s + 1,), "tensor", (2, 4), "torch.float32")

    return [StageIO(s, (val(s - 1),) if s else (), (val(s),) if s < S - 1 else ()) for s in range(S)]


def test_nccl_refuses_schedules_that_read_a_peer_out_of_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement.dist, "get_backend", lambda: "nccl")
    check_backend(placed_schedule("zbh1", 4, 8, None), _chain_ios(4))  # in order: fine
    with pytest.raises(PlacementError, match=r"'zbv' with 2 ranks and 4 micro-batches.*NCCL"):
        check_backend(placed_schedule("zbv", 4, 4, None), _chain_ios(4))
    monkeypatch.setattr(placement.dist, "get_backend", lambda: "gloo")
    check_backend(placed_schedule("zbv", 4, 4, None), _chain_ios(4))  # gloo matches by tag


def test_nccl_refuses_skip_connections_that_can_deadlock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 0 feeding stage 3 directly: 1F1B's grouped sends could wait in a circle on NCCL."""
    ios = _chain_ios(4)
    skip = ValueSpec("stem", 0, (3,), "tensor", (2, 4), "torch.float32")
    ios[0] = StageIO(0, (), (ios[0].outputs[0], skip))
    ios[3] = StageIO(3, (ios[3].inputs[0], skip), ())
    monkeypatch.setattr(placement.dist, "get_backend", lambda: "nccl")
    with pytest.raises(PlacementError, match=r"'1f1b' on 4 ranks .*\[\(0, 3\)\].*deadlock on NCCL"):
        check_backend(placed_schedule("1f1b", 4, 4, None), ios)
    check_backend(placed_schedule("gpipe", 4, 4, None), ios)  # GPipe's program finishes
    check_backend(placed_schedule("1f1b", 4, 4, None), _chain_ios(4))
    monkeypatch.setattr(placement.dist, "get_backend", lambda: "gloo")
    check_backend(placed_schedule("1f1b", 4, 4, None), ios)  # gloo sends do not wait
