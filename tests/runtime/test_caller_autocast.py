"""The caller's torch.autocast around step / forward_backward / predict reaches the stages (CallerAutocast).

autocast is thread-local and the in-process transport runs each rank on a thread of its own, so
without this a ``with torch.autocast(...)`` around ``step`` trained in fp32. The reference is the
plain model under the same autocast: over the trainer's micro-batches (gradient accumulation,
what the pipeline computes: checked tight, as in test_mixed_precision), and over the whole batch
(one bf16 matmul over all rows rounds differently: checked at bf16's tolerance).
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn

from parity import case, make_trainer
from runtime.precision import AutocastConflictError, MixedPrecision, PrecisionError

BF16 = {"rtol": 2e-2, "atol": 2e-3}  # relative to bf16's 8 bits of mantissa, on fp32 gradients
TIGHT = {"rtol": 1e-5, "atol": 1e-7}


def _accumulated(model: nn.Module, c: dict[str, Any], m: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The plain model's loss and gradients over ``m`` micro-batches under the caller's autocast."""
    model.zero_grad()
    total = torch.zeros(())
    for xc, yc in zip(c["x"].chunk(m), c["y"].chunk(m)):
        loss = c["loss"](model(xc), yc) / m
        loss.backward()
        total += loss.detach().float()
    return total, _by_every_name(model)


def _by_every_name(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient under every name of its parameter (GPT-2's tied embedding under both)."""
    return {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}


def _whole(model: nn.Module, c: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = c["loss"](model(c["x"]), c["y"])
    loss.backward()
    return loss.detach().float(), _by_every_name(model)


def _grads(trainer: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in trainer.named_parameters()}


def _autocast_state() -> tuple[bool, torch.dtype, bool]:
    return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled()


@pytest.mark.parametrize("transport", ["local", "sequential"])
@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_forward_backward_under_the_callers_autocast(name: str, transport: str) -> None:
    c = case(name, 2)
    ref = copy.deepcopy(c["model"])
    trainer = make_trainer(c, 2, "1f1b", transport=transport)
    before = _autocast_state()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = _autocast_state()
        loss = trainer.forward_backward(c["x"], c["y"])
        assert _autocast_state() == inside  # the caller's autocast is still on, as it was
        want_loss, want = _accumulated(ref, c, trainer.m)
        whole_loss, whole = _whole(copy.deepcopy(c["model"]), c)
    assert _autocast_state() == before
    got = _grads(trainer)
    assert set(got) <= set(want)
    want, whole = {n: want[n] for n in got}, {n: whole[n] for n in got}
    torch.testing.assert_close(loss, want_loss, **TIGHT)
    torch.testing.assert_close(got, want, **TIGHT)
    assert all(g.dtype == torch.float32 for g in got.values())  # fp32 master gradients, as the plain model's
    torch.testing.assert_close(loss, whole_loss, **BF16)
    torch.testing.assert_close(got, whole, **BF16)


def test_step_trains_under_the_callers_autocast() -> None:
    c = case("gpt2", 2)
    ref = copy.deepcopy(c["model"])
    trainer = make_trainer(c, 2, "1f1b", optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = trainer.step(c["x"], c["y"])
        want_loss, _ = _accumulated(ref, c, trainer.m)
    opt.step()
    torch.testing.assert_close(loss, want_loss, **TIGHT)
    plain = dict(ref.named_parameters(remove_duplicate=False))
    torch.testing.assert_close(dict(trainer.named_parameters()), {n: plain[n] for n, _ in trainer.named_parameters()},
                               **TIGHT)
    # Outside the autocast, the next step is fp32 again: the same as the plain model's.
    loss = trainer.step(c["x"], c["y"])
    opt.zero_grad()
    with torch.no_grad():
        want_loss = c["loss"](ref(c["x"]), c["y"])
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transport", ["local", "sequential"])
def test_predict_returns_the_plain_models_dtype(transport: str) -> None:
    c = case("gpt2", 2)
    ref = copy.deepcopy(c["model"])
    trainer = make_trainer(c, 2, "1f1b", transport=transport)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        got = trainer.predict(c["x"])
        want = ref(c["x"])
    assert want.dtype == torch.bfloat16
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want)  # bf16's own tolerance
    with torch.no_grad():
        assert trainer.predict(c["x"]).dtype == torch.float32


def test_stage_threads_are_left_without_autocast() -> None:
    c = case("mlp", 2)
    trainer = make_trainer(c, 2, "1f1b")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trainer.forward_backward(c["x"], c["y"])
    seen: dict[int, tuple[bool, torch.dtype, bool]] = {}
    lock = threading.Lock()

    def look(r: int) -> None:
        with lock:
            seen[r] = _autocast_state()

    threads = trainer._threads
    assert threads is not None
    threads.run({r: (lambda r=r: look(r)) for r in threads.ranks})
    assert set(seen) == set(threads.ranks)
    assert all(state[0] is False for state in seen.values())


def test_a_trainer_in_the_same_precision_runs_as_built() -> None:
    c = case("gpt2", 2)
    plain = make_trainer(c, 2, "1f1b", precision="bf16")
    loss = plain.forward_backward(c["x"], c["y"])
    grads = {n: g.clone() for n, g in _grads(plain).items()}
    under = make_trainer(case("gpt2", 2), 2, "1f1b", precision="bf16")  # its own model (same seed)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss2 = under.forward_backward(c["x"], c["y"])
    torch.testing.assert_close(loss2, loss, rtol=0, atol=0)
    torch.testing.assert_close(_grads(under), grads, rtol=0, atol=0)


def test_another_precision_is_refused_before_anything_runs() -> None:
    c = case("mlp", 2)
    trainer = make_trainer(c, 2, "1f1b", precision="fp16", optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    trainer.forward_backward(c["x"], c["y"])
    grads = {n: g.clone() for n, g in _grads(trainer).items()}
    weights = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    for call in (lambda: trainer.step(c["x"], c["y"]), lambda: trainer.forward_backward(c["x"], c["y"]),
                 lambda: trainer.predict(c["x"])):
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(AutocastConflictError) as e:
            call()
        assert "precision='fp16'" in str(e.value) and "precision='bf16'" in str(e.value)
        assert isinstance(e.value, PrecisionError) and isinstance(e.value, ValueError)
    torch.testing.assert_close(_grads(trainer), grads, rtol=0, atol=0)  # step refused before zero_grad
    torch.testing.assert_close(dict(trainer.named_parameters()), weights, rtol=0, atol=0)
    assert not torch.is_autocast_enabled("cpu")


def test_the_callers_cache_flag_is_carried() -> None:
    from runtime.precision import caller_policy

    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        mp = caller_policy(MixedPrecision("fp32"), ["cpu"])
    assert (mp.name, mp.cast_activations, mp.cache_enabled) == ("bf16", False, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert caller_policy(mp, ["cpu"]).cache_enabled is True
