"""The memory a plan may fill (capacity less the reserve), and a refused job's bound and options, by hand."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from partitioner import Cluster, partition, plan_layout
from partitioner.cost.devices import DeviceSpec
from partitioner.errors import InfeasibleMemoryError
from partitioner.plan.capacity import StateBound, explain
from partitioner.plan.units import fmt_bytes, fmt_count

GIB = 2**30


def _mlp(width: int = 64, layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_the_floor_is_the_least_state_any_allowed_layout_puts_on_a_rank() -> None:
    b = StateBound(params=1e9, state_bytes_per_param=16, devices=8, device="H100-80GB", memory=80 * GIB,
                   reserve=4 * GIB, dp_sizes=(1, 2, 4, 8), zero=("none", "zero1"))
    assert b.usable == 76 * GIB and b.needed == 16e9
    assert b.floor() == (2e9, "dp1 x pp8")  # one pipeline over all 8: 16 bytes / 8
    # At most two ranks per pipeline: ZeRO-1 over 4 replicas, 8 + 8 / 4 bytes over 2 ranks.
    shallow = replace(b, max_pp=2)
    assert shallow.floor() == (1e9 * (8 + 8 / 4) / 2, "dp4 x pp2 zero1")
    # FSDP: the weight's 4 bytes and the optimizer's 8 over dp, the gradient's 4 whole, plus the gathered blocks.
    fsdp = replace(shallow, gathered=1e8)
    assert fsdp.floor(zero=("fsdp",)) == (1e9 * (4 / 4 + 4 + 8 / 4) / 2 + 1e8, "dp4 x pp2 fsdp")
    assert replace(b, params=70e9).devices_needed() == math.ceil(70e9 * 16 / (76 * GIB)) == 14


def test_the_explanation_carries_the_numbers() -> None:
    b = StateBound(params=70e9, state_bytes_per_param=16, devices=8, device="H100-80GB", memory=80 * GIB,
                   reserve=4 * GIB, dp_sizes=(1, 2, 4, 8), zero=("none", "zero1"), max_pp=80)
    text = explain(b)
    assert (f"needs {fmt_bytes(70e9 * 16)} (70.0B parameters x 16 bytes) and the 8 x H100-80GB hold "
            f"{fmt_bytes(8 * 76 * GIB)} usable (76.0 GiB each: 80.0 GiB less a 4.0 GiB reserve): no layout holds it"
            ) in text
    fsdp = min(70e9 * (4 / dp + 4 + 8 / dp) / (8 // dp) for dp in (2, 4, 8))
    assert (f"with --zero fsdp (weights and optimizer state over the replicas; gradients stay whole): "
            f"{fmt_bytes(fsdp)} per device of 76.0 GiB") in text
    assert (f"with --state-bytes 8 (bf16 weights, gradients and Adam moments, or fp32 SGD without momentum): "
            f"{fmt_bytes(70e9 * 8 / 8)} per device of 76.0 GiB (dp1 x pp8: fits the state)") in text
    assert f"with --state-bytes 10 (an 8-bit Adam over fp32 weights and gradients): {fmt_bytes(70e9 * 10 / 8)}" in text
    assert (f"at least 14 x H100-80GB hold the state alone, spread over all of them ({fmt_bytes(70e9 * 16 / 14)} "
            "per device") in text
    # Asked for FSDP already: it is not offered again; no smaller state than 8 bytes is offered below 8.
    small = explain(replace(b, params=100e9, zero=("none", "zero1", "fsdp"), state_bytes_per_param=8))
    assert "--zero fsdp" not in small and "--state-bytes" not in small
    assert math.ceil(100e9 * 8 / (76 * GIB)) == 10 and "at least 10 x H100-80GB hold the state alone" in small
    # A state that fits the devices spread evenly: what overflows is the activations on top.
    fits = explain(replace(b, state_bytes_per_param=8))
    assert f"put at least {fmt_bytes(70e9 * 8 / 8)} of it on a device (dp1 x pp8), which fits: the activations" in fits
    assert "more devices" not in fits


def test_a_cut_that_does_not_fit_says_the_state_against_all_devices_and_what_would_fit() -> None:
    model = _mlp()
    tiny = DeviceSpec("tiny", 1e12, 1e12, 1e11, memory=64 * 1024, memory_reserve=4 * 1024)  # 60 KiB usable
    with pytest.raises(InfeasibleMemoryError) as info:
        partition(model, (torch.randn(2, 64),), 2, cluster=Cluster.uniform(2, tiny))
    p, text = _params(model), str(info.value)
    assert text.startswith("no partition into 2 stages fits device memory")  # the cut's own numbers first
    assert info.value.available == [60 * 1024] * 2  # what the cut was given: usable memory
    assert (f"The training state alone needs {fmt_bytes(p * 16)} ({fmt_count(p)} parameters x 16 bytes) and the "
            "2 x tiny hold 120.0 KiB usable (60.0 KiB each: 64.0 KiB less a 4.0 KiB reserve): no layout holds it"
            ) in text
    assert (f"with --state-bytes 8 (bf16 weights, gradients and Adam moments, or fp32 SGD without momentum): "
            f"{fmt_bytes(p * 8 / 2)} per device of 60.0 KiB (dp1 x pp2: still too much)") in text
    k = math.ceil(p * 16 / (60 * 1024))
    assert f"with more devices: at least {k} x tiny hold the state alone" in text
    assert "--zero fsdp" not in text  # one pipeline: no replicas to shard over


def test_a_layout_search_that_finds_nothing_says_so_without_a_one_stage_cut() -> None:
    model = _mlp()
    tiny = DeviceSpec("tiny", 1e12, 1e12, 1e11, memory=64 * 1024)
    with pytest.raises(InfeasibleMemoryError) as info:
        plan_layout(model, (torch.randn(1, 64),), cluster=Cluster.uniform(2, tiny), global_batch=4)
    p, text = _params(model), str(info.value)
    assert text.startswith("No layout fits 2 x tiny (tried ") and "no partition into 1 stages" not in text
    assert f"needs {fmt_bytes(p * 16)} ({fmt_count(p)} parameters x 16 bytes)" in text
    assert "hold 128.0 KiB usable (64.0 KiB each, no reserve)" in text
    assert "with --zero fsdp" in text and f"{fmt_bytes(p * 8 / 2)} per device of 64.0 KiB (dp1 x pp2" in text


def test_no_plan_fills_the_reserve() -> None:
    model, x = _mlp(), torch.randn(2, 64)
    whole = partition(model, (x,), 1, cluster=Cluster.uniform(1, "cpu"), microbatches=1)
    need = whole.stages[0].memory
    exact = DeviceSpec("exact", 1e12, 1e12, 1e11, memory=need * 1.01)  # the job fits its capacity, just
    assert partition(model, (x,), 1, cluster=Cluster.uniform(1, exact), microbatches=1).stages[0].memory == need
    reserved = Cluster.uniform(1, exact, memory_reserve="5%")  # but not what the reserve leaves
    with pytest.raises(InfeasibleMemoryError):
        partition(model, (x,), 1, cluster=reserved, microbatches=1, recompute=False)
    # The layout search prices against the usable memory too: every row's capacity, and the choice under it.
    cluster = Cluster.uniform(2, "H100-80GB", memory_reserve="10%")
    plan = plan_layout(model, (torch.randn(1, 64),), cluster=cluster, global_batch=4)
    assert {r.capacity for r in plan.layouts} == {72 * GIB} and plan.layout is not None
    assert plan.layout.memory <= 72 * GIB and {st.capacity for st in plan.stages} == {72 * GIB}
