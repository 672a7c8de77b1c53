"""One plan trains any batch: whole-batch or micro-batch examples, other batch and sequence sizes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from partitioner import InputShapeError, Plan, TraceError, partition
from partitioner.errors import PartitionOptionError
from partitioner.zoo import gpt2
from rotary_case import RotaryNet
from runtime import PipelineTrainer


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _assert_exact(trainer: PipelineTrainer, ref: nn.Module, loss_fn: object, x: torch.Tensor, y: torch.Tensor) -> None:
    trainer.zero_grad()
    ref.zero_grad()
    loss = trainer.forward_backward(x, y)
    want = loss_fn(ref(x), y)  # type: ignore[operator]
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=2e-5, atol=2e-6)
    grads = {n: prm.grad for n, prm in ref.named_parameters(remove_duplicate=False)}
    for name, prm in trainer.named_parameters():
        torch.testing.assert_close(prm.grad, grads[name], rtol=2e-5, atol=2e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture(scope="module")
def lm() -> tuple[nn.Module, nn.Module]:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, _ = gpt2(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    return model, copy.deepcopy(model)


def test_a_whole_batch_example_is_costed_per_microbatch(lm: tuple[nn.Module, nn.Module]) -> None:
    model, _ = lm
    ids = torch.randint(0, 64, (8, 16))
    whole = partition(model, (ids,), 2, microbatches=4, example_is="batch")
    micro = partition(model, (ids[:2],), 2, microbatches=4)
    assert whole.fingerprint == micro.fingerprint
    assert [st.fwd_flops for st in whole.stages] == [st.fwd_flops for st in micro.stages]
    assert whole.microbatch_shapes == {"input_ids": (2, 16)}
    assert "4 micro-batches of 2," in str(whole)


@pytest.mark.parametrize("batch,seq", [(8, 16), (16, 16), (4, 16), (8, 24), (12, 9)])
def test_one_plan_trains_any_batch_and_sequence_length(lm: tuple[nn.Module, nn.Module], batch: int, seq: int) -> None:
    model, ref = lm
    # The example is the whole batch of the usual size, as a trainer user would pass it.
    plan = partition(model, (torch.randint(0, 64, (8, 16)),), 2, microbatches=4, schedule="1f1b", example_is="batch")
    assert plan.traced.example_inputs[0].dynamic == (0, 1)
    trainer = PipelineTrainer(plan, _lm_loss, transport="sequential")
    gen = torch.Generator().manual_seed(batch * 100 + seq)
    x, y = (torch.randint(0, 64, (batch, seq), generator=gen) for _ in range(2))
    _assert_exact(trainer, ref, _lm_loss, x, y)


def test_a_microbatch_of_one_traces_and_trains_any_size(lm: tuple[nn.Module, nn.Module]) -> None:
    model, ref = lm
    plan = partition(model, (torch.randint(0, 64, (1, 16)),), 2, microbatches=2)
    assert plan.microbatch_size == 1
    assert plan.traced.example_inputs[0].dynamic == (0, 1)  # traced at 2 rows, so batch 1 is not fixed
    trainer = PipelineTrainer(plan, _lm_loss, transport="sequential")
    for batch in (2, 6):
        x, y = torch.randint(0, 64, (batch, 16)), torch.randint(0, 64, (batch, 16))
        _assert_exact(trainer, ref, _lm_loss, x, y)


def test_a_fixed_dimension_is_a_typed_error_before_the_step() -> None:
    model = RotaryNet()  # float input (B, T, C): only the batch is left free
    plan = partition(model, (torch.randn(2, 6, 8),), 2, microbatches=2)
    assert plan.trace_method == "export" and plan.traced.example_inputs[0].dynamic == (0,)
    trainer = PipelineTrainer(plan, nn.functional.mse_loss, transport="sequential")
    _assert_exact(trainer, copy.deepcopy(model), nn.functional.mse_loss, torch.randn(6, 6, 8), torch.randn(6, 6, 8))
    with pytest.raises(InputShapeError) as err:
        trainer.forward_backward(torch.randn(4, 7, 8), torch.randn(4, 7, 8))
    msg = str(err.value)
    assert "(2, 6, 8)" in msg and "dimension 1 fixed at 6" in msg and "(2, 7, 8)" in msg and "Re-plan" in msg


def test_bind_takes_a_whole_batch_example(tmp_path: Path, lm: tuple[nn.Module, nn.Module]) -> None:
    model, _ = lm
    ids = torch.randint(0, 64, (8, 16))
    partition(model, (ids[:2],), 2, microbatches=4).save(tmp_path / "plan.json")
    for example in (ids[:2], ids):  # one micro-batch, or the whole batch of 4
        plan = Plan.load(tmp_path / "plan.json", model, (example,))
        assert plan.traced.example_inputs[0].shape == (2, 16)


def test_whole_batch_examples_must_divide() -> None:
    with pytest.raises(TraceError, match="cannot be cut into 4 equal micro-batches"):
        partition(RotaryNet(), (torch.randn(6, 6, 8),), 2, microbatches=4, example_is="batch")
    with pytest.raises(ValueError, match="needs microbatches as an int"):
        partition(RotaryNet(), (torch.randn(8, 6, 8),), 2, microbatches="auto", example_is="batch")
    with pytest.raises(ValueError, match="'microbatch' or 'batch'") as info:
        partition(RotaryNet(), (torch.randn(8, 6, 8),), 2, example_is="everything")
    assert isinstance(info.value, PartitionOptionError)
