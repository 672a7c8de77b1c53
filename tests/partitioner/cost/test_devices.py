"""Device descriptions: the memory reserve each kind keeps, the reserve's text form, this machine's
default device, and what a cluster's estimates rest on."""

from __future__ import annotations

import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from partitioner.cost.devices import (
    DEVICE_PRESETS,
    GPU_MEMORY_RESERVE,
    HOST_MEMORY_RESERVE,
    Cluster,
    DeviceSpec,
    default_device,
    parse_reserve,
    reserve_bytes,
)
from partitioner.errors import ClusterError

GIB = 2**30


def test_gpu_presets_keep_2_gib_and_5_percent() -> None:
    assert (GPU_MEMORY_RESERVE.fixed, GPU_MEMORY_RESERVE.fraction) == (2 * GIB, 0.05)
    expected = {"V100-32GB": 3.6, "A100-40GB": 4.0, "A100-80GB": 6.0, "H100-80GB": 6.0, "H200-141GB": 9.05,
                "L4-24GB": 3.2}
    for name, reserve in expected.items():
        dev = DeviceSpec.preset(name)
        assert dev.memory_reserve / GIB == pytest.approx(reserve), name
        assert dev.usable_memory == dev.memory - dev.memory_reserve
    cpu = DEVICE_PRESETS["cpu"]
    assert cpu.memory_reserve == pytest.approx(0.5 * GIB + 0.10 * cpu.memory)
    assert HOST_MEMORY_RESERVE.of(float("inf")) == 0.0  # an unlimited device keeps nothing back


def test_a_device_described_by_hand_keeps_nothing_back_unless_told() -> None:
    dev = DeviceSpec("toy", 1e12, 1e12, 1e9, memory=8 * GIB)
    assert dev.memory_reserve == 0.0 and dev.usable_memory == 8 * GIB
    with pytest.raises(ClusterError, match="memory_reserve 9 GiB must be at least 0 and at most its memory"):
        replace(dev, memory_reserve=9 * GIB)
    # A preset's reserve is kept by replace(): the message says to give one with the new memory.
    with pytest.raises(ClusterError, match=r"pass memory_reserve=\.\.\. with it"):
        replace(DeviceSpec.preset("H100-80GB"), memory=GIB)


@pytest.mark.parametrize(
    ("text", "value"),
    [("2GiB", 2 * GIB), ("512MiB", 512 * 2**20), ("1.5GB", 1.5e9), ("0", 0.0), (" 3 gib ", 3 * GIB), ("10%", 8 * GIB)],
)
def test_a_reserve_is_a_size_with_its_unit_or_a_share(text: str, value: float) -> None:
    assert reserve_bytes(text, 80 * GIB) == pytest.approx(value)


@pytest.mark.parametrize(
    ("text", "message"),
    [("2", "is not a size: give it with its unit"), ("lots", "is not a size"), ("150%", "0% to 99%"),
     ("x%", "0% to 99%"), ("90GiB", "leaves nothing of a device's 80 GiB")],
)
def test_a_reserve_that_is_not_one_says_what_is(text: str, message: str) -> None:
    with pytest.raises(ClusterError, match=message):
        reserve_bytes(text, 80 * GIB)


def test_a_cluster_takes_a_reserve_for_every_device() -> None:
    assert parse_reserve("25%") == (0.25, True)
    c = Cluster.uniform(3, "A100-80GB", memory_reserve="25%")
    assert [d.usable_memory / GIB for d in c.devices] == [60.0] * 3
    again = c.with_memory_reserve("1GiB")
    assert [d.memory_reserve for d in again.devices] == [GIB] * 3 and again.link_bandwidth == c.link_bandwidth
    assert Cluster.from_dict(again.to_dict()) == again  # the reserve travels with a plan's cluster


def _gpu(monkeypatch: pytest.MonkeyPatch, name: str, memory: float = 80 * GIB) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: SimpleNamespace(total_memory=memory))


@pytest.mark.parametrize(
    ("name", "memory", "preset"),
    [
        ("NVIDIA H100 80GB HBM3", 79.2 * GIB, "H100-80GB"),
        ("NVIDIA H200", 139.8 * GIB, "H200-141GB"),
        ("NVIDIA A100-SXM4-80GB", 79.2 * GIB, "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", 39.4 * GIB, "A100-40GB"),
        ("Tesla V100-SXM2-32GB", 31.7 * GIB, "V100-32GB"),
        ("NVIDIA L4", 22.2 * GIB, "L4-24GB"),
    ],
)
def test_this_machines_gpu_picks_its_preset(monkeypatch: pytest.MonkeyPatch, name: str, memory: float,
                                            preset: str) -> None:
    _gpu(monkeypatch, name, memory)
    assert default_device() == preset


def test_a_gpu_no_preset_describes_falls_back_to_cpu_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _gpu(monkeypatch, "NVIDIA L40S", 44 * GIB)  # not an L4
    with caplog.at_level(logging.WARNING, logger="partitioner.cost.devices"):
        assert default_device() == "cpu"
    assert "'NVIDIA L40S'" in caplog.text and "--device" in caplog.text


def test_without_a_gpu_the_default_is_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device() == "cpu"


def test_a_cluster_says_what_its_estimates_rest_on(tmp_path: object) -> None:
    assert Cluster.uniform(2, "H100-80GB").estimate_basis == "estimated from the H100-80GB preset (roofline)"
    toy = DeviceSpec("toy", 1e12, 1e12, 1e9, memory=GIB)
    assert Cluster.uniform(2, toy).estimate_basis == "estimated from the device 'toy' as described (roofline)"
    measured = replace(Cluster.uniform(2, "cpu"), calibrated="this host (2 processes)")
    assert measured.estimate_basis == "calibrated on this host (2 processes)"
