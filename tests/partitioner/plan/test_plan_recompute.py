"""Activation recomputation in the plan: when the planner turns it on, and what it costs in the model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from partitioner import Cluster, DeviceSpec, InfeasibleMemoryError, Plan, partition
from partitioner.algorithms import Partition, Problem, Tensor, exact
from partitioner.cost.recompute import choose_recompute, cut_recomputing, stage_input_bytes
from partitioner.errors import PartitionOptionError
from partitioner.plan.plan import _checksum
from partitioner.plan.predict import predict
from partitioner.zoo import MLPChain


def _chain(n: int = 6, act: float = 10.0, state: float = 5.0, boundary: float = 1.0) -> Problem:
    """``n`` equal units in a chain, each reading the previous one's ``boundary``-byte output."""
    tensors = (Tensor(-1, (0,), boundary), *(Tensor(i, (i + 1,), boundary) for i in range(n - 1)))
    return Problem(
        compute=((3.0,) * n,) * 2, state_bytes=(state,) * n, act_bytes=(act,) * n, tensors=tensors,
        capacity=(60.0, 60.0), inflight=(4, 1), link_bandwidth=(1e12,), link_latency=(0.0,),
    )


def test_choose_recompute_turns_on_only_where_memory_binds_and_it_helps() -> None:
    # Stage 0 holds 4 micro-batches: 20 + 4 * 10 > 50; recomputing needs 20 + 4 * 1 + 10.
    assert choose_recompute([20, 20], [10, 10], [1, 1], [4, 1], [50, 50], "auto") == (True, False)
    # Inputs as large as the activations: recomputing would not lower the need, so it stays off.
    assert choose_recompute([20, 20], [10, 10], [10, 10], [4, 1], [50, 50], "auto") == (False, False)
    assert choose_recompute([20, 20], [10, 10], [1, 1], [4, 1], [1e9, 1e9], True) == (True, True)


def test_stage_input_bytes_counts_what_crosses_into_each_stage() -> None:
    pb = _chain()
    assert stage_input_bytes(pb, (0, 0, 0, 1, 1, 1)) == [1.0, 1.0]  # the graph input; unit 2's output
    skip = dataclasses.replace(pb, tensors=(*pb.tensors, Tensor(0, (5,), 7.0)))
    assert stage_input_bytes(skip, (0, 0, 0, 1, 1, 1)) == [1.0, 8.0]


def test_cut_recomputing_fits_where_no_plain_cut_does() -> None:
    pb = _chain()
    with pytest.raises(InfeasibleMemoryError):
        exact(pb)  # stage 0 would hold 4 x its activations
    part = cut_recomputing(pb, ((1.0,) * 6,) * 2, exact)
    assert isinstance(part, Partition) and sorted(set(part.assignment)) == [0, 1]
    ins = stage_input_bytes(pb, part.assignment)
    for s in range(2):
        units = [i for i, a in enumerate(part.assignment) if a == s]
        need = 5.0 * len(units) + pb.inflight[s] * ins[s] + 10.0 * len(units)
        assert need <= pb.capacity[s]


def test_cut_recomputing_makes_room_for_the_inputs_in_flight() -> None:
    # Inputs of 4 bytes held 4 times (16) do not fit beside 3 units (45) in 60 on stage 0:
    # the first cut (which ignores them) overflows, the next one leaves the room.
    pb = dataclasses.replace(_chain(boundary=4.0), capacity=(60.0, 90.0))
    part = cut_recomputing(pb, ((1.0,) * 6,) * 2, exact)
    ins = stage_input_bytes(pb, part.assignment)
    n0 = part.assignment.count(0)
    assert 15.0 * n0 + 4 * ins[0] <= 60.0


def test_cut_recomputing_says_when_even_recomputation_does_not_fit() -> None:
    pb = dataclasses.replace(_chain(), capacity=(20.0, 20.0))
    with pytest.raises(InfeasibleMemoryError, match="Even with activation recomputation"):
        cut_recomputing(pb, ((1.0,) * 6,) * 2, exact)


def _model() -> tuple[MLPChain, torch.Tensor]:
    return MLPChain((128,) * 9), torch.randn(64, 128)


def _tight(model: MLPChain, x: torch.Tensor, m: int = 8) -> DeviceSpec:
    """A device where GPipe's m micro-batches do not fit, one micro-batch's activations do."""
    free = partition(model, (x,), 2, microbatches=m, schedule="gpipe")
    st = free.stages[0]
    return DeviceSpec("tight", 312e12, 19.5e12, 2e12, st.state_bytes + 3 * st.act_bytes)


def test_plan_recomputes_only_when_memory_binds() -> None:
    model, x = _model()
    free = partition(model, (x,), 2, microbatches=8, schedule="gpipe")
    assert not any(st.recompute for st in free.stages)
    off = partition(model, (x,), 2, microbatches=8, schedule="gpipe", recompute=False)
    assert free.stages == off.stages and free.predictions == off.predictions

    dev = _tight(model, x)
    with pytest.raises(InfeasibleMemoryError):
        partition(model, (x,), 2, cluster=Cluster.uniform(2, dev), microbatches=8, schedule="gpipe",
                  recompute=False)
    plan = partition(model, (x,), 2, cluster=Cluster.uniform(2, dev), microbatches=8, schedule="gpipe")
    assert any(st.recompute for st in plan.stages)
    for st in plan.stages:
        assert st.memory <= st.capacity
        if st.recompute:
            assert st.memory == pytest.approx(st.state_bytes + 8 * st.in_bytes + st.act_bytes)
            assert st.time == pytest.approx(2 * st.fwd_time + st.bwd_time + st.comm_in_time + st.comm_out_time)
    assert plan.prediction("gpipe").memory <= dev.memory
    text = str(plan)
    assert "recompute" in text and "activation recomputation on" in text


def test_recomputation_in_the_prediction_costs_a_forward_and_saves_activations() -> None:
    model, x = _model()
    plan = partition(model, (x,), 2, microbatches=8, schedule="gpipe")
    on = tuple(dataclasses.replace(st, recompute=True) for st in plan.stages)
    for sched in ("gpipe", "1f1b", "zbh1"):
        base, rc = predict(plan.stages, plan.cluster, sched, 8), predict(on, plan.cluster, sched, 8)
        assert rc.step_time > base.step_time
        # GPipe: the backward phase's m + p - 1 slots each grow by a forward of the slowest stage at most.
        if sched == "gpipe":
            assert rc.step_time <= base.step_time + (8 + 1) * max(st.fwd_time for st in plan.stages) * (1 + 1e-9)
        # ZB-H1 keeps a replayed micro-batch's activations from its I to its W: not always less.
        assert rc.memory < base.memory if sched != "zbh1" else rc.memory <= base.memory
        state = max(st.state_bytes for st in plan.stages)
        assert rc.memory >= state + max(st.act_bytes for st in plan.stages) * 0.999


def test_auto_microbatches_take_more_with_recomputation() -> None:
    model, x = _model()
    dev = _tight(model, x, m=4)
    kw = dict(cluster=Cluster.uniform(2, dev), schedule="gpipe", microbatches="auto")
    without = partition(model, (x,), recompute=False, **kw)  # type: ignore[arg-type]
    plan = partition(model, (x,), **kw)  # type: ignore[arg-type]
    fits_without = {c.microbatches for c in without.candidates if c.fits}
    fits_with = {c.microbatches for c in plan.candidates if c.fits}
    assert fits_without < fits_with
    assert any("recomputes" in c.note for c in plan.candidates if c.fits)


def test_recompute_flags_round_trip_and_old_files_load(tmp_path: Path) -> None:
    model, x = _model()
    dev = _tight(model, x)
    plan = partition(model, (x,), 2, cluster=Cluster.uniform(2, dev), microbatches=8, schedule="gpipe")
    path = tmp_path / "plan.json"
    plan.save(path)
    back = Plan.load(path)
    assert back == plan and [st.recompute for st in back.stages] == [st.recompute for st in plan.stages]
    # A file written before these fields existed: without them, and with its checksum.
    data = json.loads(path.read_text())
    for st in data["stages"]:
        del st["recompute"], st["in_bytes"]
    data["checksum"] = _checksum(data)
    path.write_text(json.dumps(data))
    old = Plan.load(path)
    assert not any(st.recompute for st in old.stages) and all(st.in_bytes == 0.0 for st in old.stages)


def test_bad_recompute_option_says_what_is_accepted() -> None:
    model, x = _model()
    with pytest.raises(ValueError, match=r"'auto'.*True.*False") as info:
        partition(model, (x,), 2, recompute="yes")
    assert isinstance(info.value, PartitionOptionError)
