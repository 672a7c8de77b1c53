"""Fitting the roofline to the model's own step: the algebra, and a real small model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from partitioner import Cluster, LayoutSearch
from partitioner.cost.probes import fit_or_overhead_only, fit_speed_and_overhead, rows_like
from partitioner.errors import CalibrationError
from partitioner.search import with_fit


@given(st.floats(0.01, 10), st.floats(0.1, 10), st.floats(0, 1e-3), st.integers(1, 1000))
def test_the_fit_recovers_speed_and_overhead(r1: float, grow: float, overhead: float, ops: int) -> None:
    r2, speed = r1 * (1 + grow), 0.7
    t1, t2 = r1 / speed + ops * overhead, r2 / speed + ops * overhead
    s, oh = fit_speed_and_overhead((r1, r2), (t1, t2), ops)
    assert s == pytest.approx(speed, rel=1e-6) and oh == pytest.approx(overhead, rel=1e-6, abs=1e-12)


def test_timings_that_do_not_grow_are_refused() -> None:
    with pytest.raises(CalibrationError, match="larger micro-batch must take longer"):
        fit_speed_and_overhead((1.0, 2.0), (0.5, 0.4), 10)


def test_timings_that_do_not_grow_keep_the_speed_and_fit_the_overhead_alone() -> None:
    # The tiny model on 4 processes of 2 busy cores: the larger size timed faster.
    s, overhead, grew = fit_or_overhead_only((1e-4, 6e-4), (0.0143, 0.0129), 227)
    assert (s, grew) == (1.0, False) and overhead == pytest.approx((0.0142 + 0.0123) / (2 * 227))
    assert fit_or_overhead_only((1.0, 4.0), (0.6, 2.1), 100) == (*fit_speed_and_overhead((1.0, 4.0), (0.6, 2.1), 100),
                                                                 True)
    with pytest.raises(CalibrationError, match="cannot fit the per-op overhead"):
        fit_or_overhead_only((1.0, 2.0), (0.5, 0.0), 10)


def test_rows_repeat_and_fitted_devices_keep_their_memory() -> None:
    x = torch.arange(6).reshape(2, 3)
    assert torch.equal(rows_like(x, 3), torch.tensor([[0, 1, 2], [3, 4, 5], [0, 1, 2]]))
    assert rows_like(7, 3) == 7
    c = with_fit(Cluster.uniform(2, "cpu"), 2.0, 1e-5)
    assert c.devices[0].memory == Cluster.uniform(1, "cpu").devices[0].memory and len(c) == 2


def test_a_small_model_is_fitted_from_its_own_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4)])
    search = LayoutSearch(model, (torch.randn(1, 256),), cluster=Cluster.uniform(2, "cpu"), global_batch=64)
    fitted = search.fit_to_model(sizes=(8, 64), repeat=5)
    dev = fitted.devices[0]
    assert dev.name.endswith("(fitted to the model)") and dev.peak_flops_fp32 > 0 and dev.op_overhead >= 0
    assert all(p.grad is None for p in model.parameters())  # the timing leaves no gradients
    search.use_cluster(fitted)
    assert search.cluster == fitted
    with pytest.raises(Exception, match="2 devices"):
        search.use_cluster(Cluster.uniform(3, "cpu"))
