"""runtime.calibration: the loss and batches a model is fitted with, and the refusals (in one process;
the fit over gloo processes is tested through the CLI in tests/pipecut/test_calibrate_cli.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner import Cluster
from partitioner.errors import CalibrationError
from partitioner.zoo import load_model
from runtime.calibration import _loss_and_batch, fit_model, next_token_loss, output_loss


def _lm() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Token ids (b, 8) -> logits (b, 8, 64)."""
    return nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64)), (torch.zeros(2, 8, dtype=torch.long),)


def _huge() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """160 GB of fp32 weights, on meta."""
    return nn.Linear(200_000, 200_000, device="meta"), (torch.zeros(1, 200_000, device="meta"),)


def test_a_causal_lm_is_fitted_on_next_token_cross_entropy() -> None:
    model, (ids,) = _lm()
    loss_fn, batch, name = _loss_and_batch(model, (ids,), global_batch=3, seed=0)
    x, y = batch(5)  # more rows than the global batch: they cycle
    assert name == "next-token cross-entropy" and loss_fn is next_token_loss
    assert x.shape == y.shape == (5, 8) and int(x.max()) < 64
    torch.testing.assert_close(x[3], x[0])
    torch.testing.assert_close(x[0, 1:], y[0, :-1])  # the targets are the inputs shifted by one
    want = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    torch.testing.assert_close(loss_fn(model(x), y), want)


def test_another_model_is_fitted_on_its_mean_squared_output() -> None:
    model, (x0,) = load_model("mlp")
    loss_fn, batch, name = _loss_and_batch(model, (x0,), global_batch=4, seed=0)
    x, y = batch(2)
    assert name == "mean squared output" and loss_fn is output_loss
    torch.testing.assert_close(x, x0[:2])
    torch.testing.assert_close(loss_fn(model(x), y), model(x).pow(2).mean())


def test_meta_inputs_are_made_real() -> None:
    model, (ids,) = _lm()
    _, batch, name = _loss_and_batch(model, (ids.to("meta"),), global_batch=2, seed=0)
    assert name == "next-token cross-entropy" and not batch(1)[0].is_meta


@pytest.mark.parametrize(
    ("model", "inputs", "says"),
    [
        (nn.Bilinear(4, 4, 2), (torch.randn(2, 4), torch.randn(2, 4)), "one input tensor"),
        (nn.Embedding(8, 4), (torch.zeros(2, dtype=torch.long),), None),  # one tensor out: fitted
    ],
)
def test_models_outside_the_two_losses_are_refused_with_a_fix(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], says: str | None
) -> None:
    if says is None:
        assert _loss_and_batch(model, inputs, global_batch=2, seed=0)[2] == "mean squared output"
        return
    with pytest.raises(CalibrationError, match=says) as e:
        _loss_and_batch(model, inputs, global_batch=2, seed=0)
    assert "calibrate_job(search, loss_fn, batch)" in str(e.value)


class _Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


def test_a_model_returning_a_tuple_is_refused() -> None:
    with pytest.raises(CalibrationError, match="returns tuple"):
        _loss_and_batch(_Pair(), (torch.randn(2, 3),), global_batch=2, seed=0)


def test_a_model_too_large_for_the_host_is_refused_before_any_process_starts() -> None:
    with pytest.raises(CalibrationError, match=r"fitting huge runs it in 4 processes at once, about .* GiB"):
        fit_model(_huge, Cluster.uniform(4, "cpu"), model="huge")
