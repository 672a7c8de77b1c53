"""Tests of the calibration: the fits (pure, hypothesis), GEMM shapes of a model, cluster files, and
real measurements of this host (one process, then two gloo processes), each a few seconds at most."""

from __future__ import annotations

import json
import math
import multiprocessing
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from partitioner.cost.calibrate import Calibration, measure
from partitioner.cost.costs import cost_graph
from partitioner.cost.devices import Cluster, DeviceSpec
from partitioner.cost.gemms import model_gemms
from partitioner.cost.probes import (
    ComputeSpeed,
    GemmShape,
    LinearFit,
    Probe,
    fit_allreduce,
    fit_linear,
    measure_compute,
)
from partitioner.errors import CalibrationError, ClusterError, ClusterFormatError
from partitioner.tracing.trace import trace

_sizes = st.lists(st.integers(1, 2**26), min_size=2, max_size=8, unique=True)
_latency = st.floats(0.0, 1e-2)
_bandwidth = st.floats(1e6, 1e11)


# --- fits (pure) ---------------------------------------------------------------------------------


@given(_sizes, _latency, _bandwidth)
def test_fit_linear_recovers_latency_and_bandwidth_of_exact_timings(sizes: list[int], lat: float, bw: float) -> None:
    fit = fit_linear(sizes, [lat + s / bw for s in sizes])
    assert fit.bandwidth == pytest.approx(bw, rel=1e-6)
    assert fit.latency == pytest.approx(lat, rel=1e-6, abs=1e-12)


@given(_sizes, _latency, _bandwidth, st.integers(0, 2**32 - 1))
def test_fit_linear_is_the_least_squares_line_of_noisy_timings(
    sizes: list[int], lat: float, bw: float, seed: int
) -> None:
    # Noise up to a tenth of the span's transfer time keeps the fitted slope positive (the slope
    # moves by at most max|noise| * sqrt(2 n) / span), so every case here must fit.
    rng = torch.Generator().manual_seed(seed)
    amplitude = (max(sizes) - min(sizes)) / bw / 10
    times = [lat + s / bw + amplitude * float(torch.rand((), generator=rng)) for s in sizes]
    fit = fit_linear(sizes, times)
    assert fit.bandwidth > 0
    # Least squares: the residuals sum to zero and are orthogonal to the sizes (when the
    # intercept is not clipped at zero).
    if fit.latency > 0:
        residuals = [t - fit.seconds(s) for s, t in zip(sizes, times)]
        scale = sum(abs(t) for t in times)
        assert sum(residuals) == pytest.approx(0.0, abs=1e-9 * scale)
        assert sum(r * s for r, s in zip(residuals, sizes)) == pytest.approx(0.0, abs=1e-9 * scale * max(sizes))


@given(st.integers(2, 64), _sizes, _latency, _bandwidth)
def test_fit_allreduce_reads_bus_bandwidth_and_ring_step_latency(
    n: int, sizes: list[int], lat: float, bw: float
) -> None:
    times = [2 * (n - 1) * lat + 2 * (n - 1) / n * s / bw for s in sizes]
    fit = fit_allreduce(n, sizes, times)
    assert fit.bandwidth == pytest.approx(bw, rel=1e-6)
    assert fit.latency == pytest.approx(lat, rel=1e-6, abs=1e-12)


def test_a_negative_intercept_from_noise_reads_as_zero_latency() -> None:
    assert fit_linear([1e3, 1e6], [0.0, 1e-3]).latency == 0.0
    assert fit_linear([1e3, 1e6], [-1e-6, 1e-3]).latency == 0.0


@pytest.mark.parametrize(
    ("sizes", "seconds", "says"),
    [
        ([1e3], [1e-3], "two or more distinct sizes"),
        ([1e3, 1e3], [1e-3, 2e-3], "two or more distinct sizes"),
        ([1e3, 1e6], [1e-3], "2 sizes but 1 timings"),
        ([1e3, 1e6], [2e-3, 1e-3], "do not grow with size"),
        ([1e3, 1e6], [1e-3, math.nan], "finite"),
    ],
)
def test_fits_refuse_what_they_cannot_fit_and_say_why(sizes: list[float], seconds: list[float], says: str) -> None:
    with pytest.raises(CalibrationError, match=says):
        fit_linear(sizes, seconds)


def test_fit_allreduce_needs_two_ranks() -> None:
    with pytest.raises(CalibrationError, match="at least 2 ranks to measure, got 1"):
        fit_allreduce(1, [1, 2], [1, 2])


@given(st.integers(1, 4096), st.integers(1, 4096), st.integers(1, 4096), st.integers(1, 64), st.floats(1e3, 1e10))
def test_capped_gemm_fits_the_cap_and_keeps_its_proportions(
    rows: int, inner: int, cols: int, batch: int, cap: float
) -> None:
    shape = GemmShape(rows, inner, cols, batch)
    small = shape.capped(cap)
    sides, small_sides = (rows, inner, cols, batch), (small.rows, small.inner, small.cols, small.batch)
    assert all(1 <= s <= o for s, o in zip(small_sides, sides))
    assert small.flops <= cap or 1 in (small.rows, small.inner, small.cols)
    if shape.flops <= cap:
        assert small == shape
    elif small.batch == 1 and min(small.rows, small.inner, small.cols) > 1:
        # one factor for the three sides (up to rounding each side down)
        ratios = [s / o for s, o in zip(small_sides[:3], sides[:3])]
        assert max(ratios) - min(ratios) <= max(1 / o for o in sides[:3]) + 1e-9


# --- the model's GEMMs ---------------------------------------------------------------------------


def test_model_gemms_count_every_product_forward_and_backward() -> None:
    # Three identical middle layers: one distinct call, counted three times.
    model = nn.Sequential(nn.Linear(16, 32), *[nn.Linear(32, 32) for _ in range(3)], nn.Linear(32, 8))
    t = trace(model, (torch.randn(4, 16),))
    gemms = model_gemms(t)
    assert gemms[GemmShape(4, 32, 32)] == 3 + 3  # forward of the middle layers, and their input grads
    assert sum(s.flops * c for s, c in gemms.items()) == sum(c.fwd_flops + c.bwd_flops for c in cost_graph(t).values())
    # The first layer's input needs no gradient: only its forward and weight-gradient products.
    assert GemmShape(4, 32, 16) not in gemms


def test_model_gemms_of_gpt2_see_the_blocks_and_the_head(gpt2: tuple[nn.Module, object]) -> None:
    _, traced = gpt2
    gemms = model_gemms(traced)  # type: ignore[arg-type]
    assert gemms and all(c >= 1 for c in gemms.values())
    width = 64  # gpt2_case's n_embd
    assert any(s.inner == width and s.cols == 3 * width for s in gemms)  # the attention input projection


# --- probes and calibrations ---------------------------------------------------------------------


def test_probe_refuses_options_it_cannot_measure() -> None:
    with pytest.raises(ClusterError, match="dtypes must be"):
        Probe(dtypes=("float16",))
    with pytest.raises(ClusterError, match="two or more elementwise"):
        Probe(messages=(1024,))
    with pytest.raises(ClusterError, match="no GEMM shapes"):
        Probe().with_gemms({})


def test_measure_compute_of_this_process_is_quick_and_plausible() -> None:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    speed = measure_compute(Probe.tiny())
    assert time.perf_counter() - t0 < 5
    for flops in speed.flops.values():
        assert 1e8 < flops < 1e13  # one CPU thread: between 0.1 GFLOP/s and 10 TFLOP/s
    assert 1e8 < speed.memory.bandwidth < 1e13
    assert 1e-8 < speed.op_overhead < 1e-2


def _calibration(devices: int, p2p: LinearFit | None, allreduce: LinearFit | None) -> Calibration:
    speed = ComputeSpeed({"float32": 8e10, "bfloat16": 4e10}, LinearFit(1e-6, 2e10), 5e-6)
    return Calibration(devices, 4, "gloo", speed, p2p, allreduce, wall_s=1.0)


def test_a_calibration_becomes_a_uniform_cluster_of_the_measured_device() -> None:
    cal = _calibration(3, LinearFit(1e-4, 2e9), LinearFit(3e-5, 1e9))
    c = Cluster.from_calibration(cal)
    d = c.devices[0]
    assert len(c) == 3 and set(c.devices) == {d}
    assert (d.name, d.peak_flops_fp32, d.peak_flops, d.mem_bandwidth, d.op_overhead) == (
        "cpu (measured)", 8e10, 4e10, 2e10, 5e-6
    )
    assert d.memory == DeviceSpec.preset("cpu").memory / 4  # the host's memory shared by 4 processes
    assert c.link_bandwidth == (2e9, 2e9) and c.link_latency == (1e-4, 1e-4)
    assert (c.collective_bandwidth, c.collective_latency) == (1e9, 3e-5)
    one = Cluster.from_calibration(_calibration(1, None, None))
    assert one.collective_bandwidth is None and len(one) == 1


# --- cluster files -------------------------------------------------------------------------------


def test_cluster_file_round_trips_measured_fields(tmp_path: Path) -> None:
    c = Cluster.from_calibration(_calibration(2, LinearFit(1e-4, 2e9), LinearFit(3e-5, 1e9)))
    path = c.save(tmp_path / "c.json", details={"note": "test"})
    assert Cluster.load(path) == c
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"], doc["details"]) == ("pipecut.cluster", 1, {"note": "test"})


def test_a_measured_cluster_says_where_it_was_measured_and_keeps_a_hosts_reserve(tmp_path: Path) -> None:
    c = Cluster.from_calibration(_calibration(2, LinearFit(1e-4, 2e9), None))
    assert c.estimate_basis == "calibrated on this host (4 processes)"
    dev = c.devices[0]
    assert dev.memory_reserve == pytest.approx(0.5 * 2**30 + 0.1 * dev.memory)  # HOST_MEMORY_RESERVE
    path = c.save(tmp_path / "c.json")
    assert Cluster.load(path).estimate_basis == f"calibrated on {path}"
    old = json.loads(path.read_text())  # a file written before clusters said where they were measured
    del old["cluster"]["calibrated"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert Cluster.load(tmp_path / "old.json").estimate_basis == f"calibrated on {tmp_path / 'old.json'}"
    assert Cluster.load(Cluster.uniform(2, "cpu").save(tmp_path / "p.json")).calibrated is None  # a preset's


_HEAD = '{"format": "pipecut.cluster", "version": '


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{not json", "is not JSON"),
        ('{"format": "pipecut.plan", "version": 1}', "is not a cluster file .format 'pipecut.plan'"),
        ("[1, 2]", "is not a cluster file"),
        (_HEAD + '99, "cluster": {}}', "version 99; this pipecut reads versions 1 to 1"),
        (_HEAD + '1, "cluster": {"devices": [], "link_bandwidth": [], "link_latency": []}}', "at least one device"),
        (_HEAD + '1, "cluster": {"devices": []}}', "cannot be read .KeyError: 'link_bandwidth'"),
        (_HEAD + '1, "cluster": {"devices": [{"name": "x"}], "link_bandwidth": [], "link_latency": []}}',
         "cannot be read .TypeError"),
    ],
)
def test_a_bad_cluster_file_names_itself_and_the_fix(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ClusterFormatError, match=says) as info:
        Cluster.load(path)
    assert str(path) in str(info.value)


def test_a_missing_cluster_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Cluster.load(tmp_path / "absent.json")


# --- several processes ---------------------------------------------------------------------------


def test_two_gloo_processes_measure_links_and_collectives() -> None:
    before = set(multiprocessing.active_children())  # the test process's own (its rank pool's, say)
    t0 = time.perf_counter()
    cluster = Cluster.measure(2, probe=Probe.tiny(), timeout=60)
    assert time.perf_counter() - t0 < 30
    assert len(cluster) == 2 and cluster.devices[0].name == "cpu (measured)"
    assert cluster.link_bandwidth[0] > 1e6 and cluster.link_latency[0] >= 0
    assert cluster.collective_bandwidth is not None and cluster.collective_bandwidth > 1e6
    assert cluster.collective_latency is not None and cluster.collective_latency >= 0
    assert set(multiprocessing.active_children()) <= before


def test_a_measurement_past_its_timeout_is_stopped_and_says_so() -> None:
    before = set(multiprocessing.active_children())  # the test process's own (its rank pool's, say)
    with pytest.raises(CalibrationError, match="did not finish within 1 s"):
        measure(2, probe=Probe(), timeout=1.0)
    assert set(multiprocessing.active_children()) <= before  # every process it started was killed and reaped


def test_measure_refuses_what_it_cannot_measure() -> None:
    with pytest.raises(ClusterError, match="at least 1, got 0"):
        measure(0)
    with pytest.raises(ClusterError, match="backend 'nccl'"):
        measure(2, backend="nccl")
