"""Mixed precision (runtime.precision): pipelined bf16/fp16 training against the plain model under autocast.

The reference is the unpartitioned model with the same policy and the same micro-batches:
``m`` forwards under ``torch.autocast`` (the loss too), each loss divided by ``m``, gradients
accumulated in fp32 -- what a torch user's gradient accumulation computes. One forward over the
whole batch would round differently (a bf16 matmul over 8 rows is not the sum of four over 2),
and that difference is autocast's, not the pipeline's.

Tolerances (measured on these cases, CPU, torch 2.13; the max over all parameters of
``max|g - g_ref| / max|g_ref|``):

* values kept in their autocast dtype on the wire (``cast_activations=False``): MLP bitwise
  equal, GPT-2 4.5e-8 -- checked at ``TIGHT`` (fp32 round-off of the order of summation);
* every floating value cast to bf16 on the wire (the default): MLP bitwise equal (its cuts fall
  on linear outputs, bf16 anyway), GPT-2 9.8e-3 on gradients and 1.0e-4 on the loss (its cut
  values include fp32 ones, rounded to bf16's 8 bits of mantissa) -- checked at ``CAST``,
  about 2x the measured error. For scale: autocast itself moves the same gradients 8.1e-3
  from the fp32 model's.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from parity import case, make_trainer, plan_once
from partitioner.search import LayoutSearch
from rank_pool import Cases
from runtime.precision import LossScaler, MixedPrecision, PrecisionError, wire_dtypes
from runtime.transport.p2p import LocalTransport, TensorMeta

# Relative to the largest reference gradient (see the module docstring for the measurements).
TIGHT = 1e-6
CAST = 2e-2
CAST_LOSS = 3e-4

# GPT-2 traced once by this test process per stage count and planned from that trace for each test
# (``parity.plan_once``; tracing is most of a test's time): each test's trainer is the only one alive.
_SEARCHES: dict[tuple[str, int], LayoutSearch] = {}


def _planned(name: str, stages: int, schedule: str) -> dict[str, Any]:
    """Parity's case ``name`` on ``stages``; GPT-2's plan for ``schedule`` from this process's trace."""
    c = case(name, stages)
    plan_once(c, name, stages, schedule, _SEARCHES)
    return c


def _accumulated(
    model: nn.Module, loss_fn: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor, m: int,
    dtype: torch.dtype, loss_scale: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The plain model's loss and gradients over ``m`` micro-batches under autocast."""
    model.zero_grad()
    total = torch.zeros(())
    for xc, yc in zip(x.chunk(m), y.chunk(m)):
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(model(xc), yc) / m
        (loss * loss_scale).backward()
        total += loss.detach().float()
    grads = {n: p.grad / loss_scale for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
    return total, grads


def _rel_err(trainer: Any, want: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name, prm in trainer.named_parameters():
        assert prm.grad is not None and prm.grad.dtype == torch.float32, name  # fp32 master gradients
        worst = max(worst, float((prm.grad.detach() - want[name]).abs().max() / want[name].abs().max()))
    return worst


@pytest.mark.parametrize("name", ["mlp", "gpt2"])
@pytest.mark.parametrize("schedule", ["1f1b", "zbh1", "gpipe"])
def test_bf16_uncast_wire_equals_plain_autocast(name: str, schedule: str) -> None:
    c = _planned(name, 2, schedule)
    ref = copy.deepcopy(c["model"])
    trainer = make_trainer(c, 2, schedule, precision=MixedPrecision("bf16", cast_activations=False))
    loss = trainer.forward_backward(c["x"], c["y"])
    want_loss, want = _accumulated(ref, c["loss"], c["x"], c["y"], trainer.m, torch.bfloat16)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-7)
    assert _rel_err(trainer, want) < TIGHT
    assert all(p.dtype == torch.float32 for p in trainer.parameters())  # parameters stay fp32


@pytest.mark.parametrize(("schedule", "precision"), [("interleaved", "bf16"), ("zbv", "fp16")])
def test_two_stages_per_rank_under_autocast(schedule: str, precision: str) -> None:
    # Interleaved and ZB-V hand values between two stages of one rank in process: the wire dtype
    # applies there too, and GPT-2's tied embedding (stages 0 and 3) sums fp32 gradients.
    c = _planned("gpt2", 4, schedule)
    ref = copy.deepcopy(c["model"])
    trainer = make_trainer(c, 4, schedule, precision=MixedPrecision(precision, cast_activations=False))
    loss = trainer.forward_backward(c["x"], c["y"])
    scale = trainer.scaler.scale if trainer.scaler is not None else 1.0
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    want_loss, want = _accumulated(ref, c["loss"], c["x"], c["y"], trainer.m, dtype, scale)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-7)
    assert _rel_err(trainer, want) < TIGHT


@pytest.mark.parametrize("name", ["mlp", "gpt2"])
@pytest.mark.parametrize("schedule", ["1f1b", "zbh1", "gpipe"])
def test_bf16_cast_wire_within_stated_tolerance(name: str, schedule: str) -> None:
    c = _planned(name, 2, schedule)
    ref = copy.deepcopy(c["model"])
    trainer = make_trainer(c, 2, schedule, precision="bf16")
    loss = trainer.forward_backward(c["x"], c["y"])
    want_loss, want = _accumulated(ref, c["loss"], c["x"], c["y"], trainer.m, torch.bfloat16)
    assert abs(float(loss - want_loss)) <= CAST_LOSS * abs(float(want_loss))
    assert _rel_err(trainer, want) < CAST


def test_gpt2_cast_wire_is_not_the_uncast_one() -> None:
    """GPT-2's cut carries fp32 values (the residual stream): casting them is visible, so the
    tight test above would catch a wire that silently ignored the policy."""
    c = _planned("gpt2", 2, "1f1b")
    ref = copy.deepcopy(c["model"])
    trainer = make_trainer(c, 2, "1f1b", precision="bf16")
    trainer.forward_backward(c["x"], c["y"])
    _, want = _accumulated(ref, c["loss"], c["x"], c["y"], trainer.m, torch.bfloat16)
    assert _rel_err(trainer, want) > 10 * TIGHT


class _Recording(LocalTransport):
    sent: ClassVar[list[tuple[str, torch.dtype]]] = []

    def send(self, key: Any, tensors: Any) -> None:
        _Recording.sent += [(key.kind, t.dtype) for t in tensors]
        super().send(key, tensors)


def test_floating_values_cross_stages_in_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "LocalTransport", _Recording)
    _Recording.sent = []
    c = _planned("gpt2", 2, "1f1b")
    trainer = make_trainer(c, 2, "1f1b", precision="bf16")
    trainer.forward_backward(c["x"], c["y"])
    floating = {dt for _, dt in _Recording.sent if dt.is_floating_point}
    assert floating == {torch.bfloat16}
    assert {k for k, _ in _Recording.sent} == {"act", "grad"}  # both directions
    assert torch.bool in {dt for _, dt in _Recording.sent}  # the attention mask is left alone


def test_wire_dtypes_follow_autocast_when_not_casting() -> None:
    c = _planned("gpt2", 2, "1f1b")
    plan = make_trainer(c, 2, "1f1b").plan
    keep = wire_dtypes(MixedPrecision("bf16", cast_activations=False), plan.io, plan.traced.gm,
                       plan.traced.example_inputs, "cpu")
    cast = wire_dtypes(MixedPrecision("bf16"), plan.io, plan.traced.gm, plan.traced.example_inputs, "cpu")
    assert set(keep) == set(cast) and set(cast.values()) == {torch.bfloat16}
    assert torch.float32 in keep.values() and torch.bfloat16 in keep.values()  # residual fp32, MLP bf16
    assert wire_dtypes(MixedPrecision("fp32"), plan.io, plan.traced.gm, plan.traced.example_inputs, "cpu") == {}


def test_wire_dtypes_run_the_graph_on_the_stages_device_whatever_the_trace_recorded() -> None:
    """The fake run under autocast happens on the stages' device; export's device constants
    (GPT-2's position ids) follow it there and are put back after (on a GPU it once mixed a CPU
    ``arange`` with CUDA weights and failed). Emulated on the CPU with a trace that recorded ``meta``
    (a trace of its own: the shared one's constants are not to be moved)."""
    from partitioner.tracing.trace import retarget_device

    plan = make_trainer(case("gpt2", 2), 2, "1f1b").plan
    policy = MixedPrecision("bf16", cast_activations=False)
    want = wire_dtypes(policy, plan.io, plan.traced.gm, plan.traced.example_inputs, "cpu")
    assert retarget_device(plan.traced.gm, "meta") > 0
    code = plan.traced.gm.code
    assert wire_dtypes(policy, plan.io, plan.traced.gm, plan.traced.example_inputs, "cpu") == want
    assert plan.traced.gm.code == code


def test_fp16_with_loss_scaling_matches_scaled_reference() -> None:
    c = case("mlp", 2)
    ref = copy.deepcopy(c["model"])
    trainer = make_trainer(c, 2, "1f1b", precision="fp16")
    assert trainer.scaler is not None and trainer.scaler.scale == 2.0**16
    loss = trainer.forward_backward(c["x"], c["y"])
    want_loss, want = _accumulated(ref, c["loss"], c["x"], c["y"], trainer.m, torch.float16, 2.0**16)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-7)
    assert _rel_err(trainer, want) < TIGHT and not trainer.last_found_inf


def test_fp16_skips_the_step_on_inf_and_backs_off() -> None:
    c = case("mlp", 2)
    trainer = make_trainer(c, 2, "gpipe", precision="fp16", optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert trainer.scaler is not None
    before = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    x = c["x"].clone()
    x[0, 0] = math.inf  # an inf in one micro-batch: every gradient of stage 0 and beyond
    trainer.step(x, c["y"])
    assert trainer.last_found_inf and trainer.scaler.scale == 2.0**15 and trainer.step_count == 1
    for n, p in trainer.named_parameters():
        assert torch.equal(p.detach(), before[n]), f"{n} changed on a skipped step"
    trainer.step(c["x"], c["y"])
    assert not trainer.last_found_inf and trainer.scaler.scale == 2.0**15
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.named_parameters())


def test_fp16_accumulating_calls_unscale_only_their_own() -> None:
    c = case("mlp", 2)
    ref = copy.deepcopy(c["model"])
    trainer = make_trainer(c, 2, "1f1b", precision="fp16")
    trainer.forward_backward(c["x"], c["y"])
    trainer.forward_backward(c["x"], c["y"])  # gradients add up, each call's unscaled once
    _, want = _accumulated(ref, c["loss"], c["x"], c["y"], trainer.m, torch.float16, 2.0**16)
    assert _rel_err(trainer, {n: 2 * g for n, g in want.items()}) < TIGHT


def test_loss_scaler_growth_and_backoff() -> None:
    s = LossScaler(init_scale=4.0, growth_interval=3)
    for _ in range(2):
        s.update(False)
    assert s.scale == 4.0
    s.update(False)
    assert s.scale == 8.0 and s.good_steps == 0
    s.update(False)
    s.update(True)
    assert s.scale == 4.0 and s.good_steps == 0
    w = nn.Parameter(torch.zeros(3))
    w.grad = torch.tensor([4.0, 8.0, -2.0])
    assert s.unscale_([w]) is False and w.grad.tolist() == [1.0, 2.0, -0.5]
    w.grad = torch.tensor([float("nan"), 0.0, 0.0])
    assert s.unscale_([w]) is True
    s2 = LossScaler()
    s2.load_state_dict(s.state_dict())
    assert (s2.scale, s2.good_steps) == (s.scale, s.good_steps)


def test_policy_errors_and_defaults() -> None:
    with pytest.raises(PrecisionError, match=r"unknown precision 'fp8'.*fp32, bf16, fp16"):
        MixedPrecision("fp8")
    with pytest.raises(PrecisionError, match="growth_factor > 1"):
        LossScaler(growth_factor=1.0)
    mp = MixedPrecision("bf16")
    assert mp.wire_dtype(torch.int64) == torch.int64 and not mp.scales_loss
    assert TensorMeta((2,), mp.wire_dtype(torch.float32)).dtype == torch.bfloat16
    trainer = make_trainer(case("mlp", 2), 2, "1f1b")
    assert trainer.precision.name == "fp32" and trainer.scaler is None  # the plan's (fp32) by default


def test_autocast_state_left_as_found() -> None:
    c = case("mlp", 2)
    trainer = make_trainer(c, 2, "1f1b", precision="bf16", transport="sequential")
    trainer.forward_backward(c["x"], c["y"])
    assert not torch.is_autocast_enabled("cpu") and torch.is_grad_enabled()
    out = trainer.predict(c["x"])
    assert out.dtype == torch.bfloat16 and not torch.is_autocast_enabled("cpu")


def _fp16_rank(rank: int, world: int, precision: str) -> dict[str, Any]:
    """On one gloo rank: a bf16/fp16 step's gradients equal the plain model's, and an inf on
    the first stage makes the last stage skip its step too (the found-inf flag is reduced)."""
    c = case("gpt2", world)
    ref = copy.deepcopy(c["model"])
    trainer = make_trainer(c, world, "1f1b", transport="dist", precision=MixedPrecision(precision, False),
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    dtype = trainer.precision.dtype
    assert dtype is not None
    trainer.forward_backward(c["x"], c["y"])
    scale = trainer.scaler.scale if trainer.scaler is not None else 1.0
    _, want = _accumulated(ref, c["loss"], c["x"], c["y"], trainer.m, dtype, scale)
    err = _rel_err(trainer, want)
    trainer.zero_grad()
    before = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    inf_skipped = None
    if trainer.scaler is not None:
        # An inf in the gradient of rank 0's position embedding only: rank 1's own gradients
        # are finite, and it must skip its step because rank 0 found one.
        wpe = [p for n, p in trainer.named_parameters() if "wpe" in n]
        assert bool(wpe) == (rank == 0)
        for p in wpe:
            p.register_hook(lambda g: g + math.inf)
        trainer.step(c["x"], c["y"])
        inf_skipped = trainer.last_found_inf and all(
            torch.equal(p.detach(), before[n]) for n, p in trainer.named_parameters()
        ) and trainer.scaler.scale == 2.0**15
    return {"err": err, "inf_skipped": inf_skipped}


GLOO_PRECISIONS = ["bf16", "fp16"]


@pytest.fixture(scope="module")
def over_gloo() -> Cases:
    """Each precision of ``GLOO_PRECISIONS`` on 2 ranks of the pool, run when its test asks for it."""
    return Cases(_fp16_rank, 2, timeout=300)


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision", GLOO_PRECISIONS)
def test_mixed_precision_over_gloo_ranks(precision: str, over_gloo: Cases) -> None:
    results = over_gloo(precision)
    assert all(r["err"] < TIGHT for r in results), results
    if precision == "fp16":
        assert all(r["inf_skipped"] for r in results), results


def test_fp16_checkpoint_keeps_the_loss_scale(tmp_path: Path) -> None:
    c = case("mlp", 2)
    opt = lambda ps: torch.optim.SGD(ps, lr=0.01)  # noqa: E731
    trainer = make_trainer(c, 2, "1f1b", optimizer=opt, precision="fp16")
    trainer.step(c["x"], c["y"])
    assert trainer.scaler is not None
    trainer.scaler.scale, trainer.scaler.good_steps = 1024.0, 7  # as after some backoffs
    trainer.save(tmp_path / "ckpt")
    resumed = make_trainer(case("mlp", 2), 2, "1f1b", optimizer=opt, precision="fp16")
    resumed.load(tmp_path / "ckpt")
    assert resumed.scaler is not None and resumed.scaler.state_dict() == {"scale": 1024.0, "good_steps": 7}
    plain = make_trainer(case("mlp", 2), 2, "1f1b", optimizer=opt)
    plain.save(tmp_path / "fp32")
    resumed.load(tmp_path / "fp32")  # saved without a scaler: the scale is kept as it is
    assert resumed.scaler.scale == 1024.0
