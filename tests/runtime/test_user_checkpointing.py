"""Activation checkpointing the user enabled becomes pipecut's recomputation (partitioner.tracing.hops).

Neither tracer keeps ``torch.utils.checkpoint``: without this, a checkpointed model was planned and
trained with every stage keeping its activations, and nothing said so. Each case checks which
stages recompute, and that the loss and every gradient still equal the plain model's.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from parity import TOL, check_grads, reference
from partitioner import partition
from partitioner.errors import ReentrantCheckpointError
from runtime import PipelineTrainer
from tiny_modules import ResidualMLP


class _Checkpointed(nn.Module):
    """Six blocks; ``blocks.2`` and ``blocks.3`` run inside torch.utils.checkpoint."""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResidualMLP(16, 32, torch.tanh) for _ in range(6))
        self.head = nn.Linear(16, 4)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=self.reentrant) if i in (2, 3) else block(x)
        return self.head(x)


SPLITS = ["blocks.2", "blocks.4"]  # stage 1 holds exactly the checkpointed blocks


def _check_exact(model: nn.Module, plan: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    ref = copy.deepcopy(model)
    trainer = PipelineTrainer(plan, nn.functional.mse_loss)
    loss = trainer.forward_backward(x, y)
    assert trainer.recompute == frozenset(s for s, st in enumerate(plan.stages) if st.recompute)
    ref.zero_grad()
    total = torch.zeros(())
    for xc, yc in zip(x.chunk(trainer.m), y.chunk(trainer.m)):
        part = nn.functional.mse_loss(ref(xc), yc) / trainer.m
        part.backward()
        total += part.detach()
    torch.testing.assert_close(loss, total, **TOL)
    check_grads(trainer, {n: p.grad for n, p in ref.named_parameters()})


@pytest.mark.parametrize("trace_method", ["fx", "export"])
def test_torch_checkpoint_regions_make_their_stage_recompute(
    trace_method: str, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = _Checkpointed()
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with caplog.at_level(logging.WARNING, logger="partitioner.api"):
        plan = partition(model, (x[:2],), microbatches=4, split_points=SPLITS, trace_method=trace_method)
    assert plan.traced.checkpointed == ("blocks.2", "blocks.3")
    assert [st.recompute for st in plan.stages] == [False, True, False]
    assert "the model checkpoints blocks.2, blocks.3" in caplog.text and "recompute" in caplog.text
    _check_exact(model, plan, x, y)


def test_recompute_off_keeps_activations_and_says_how_to_ask(caplog: pytest.LogCaptureFixture) -> None:
    model = _Checkpointed()
    x = torch.randn(2, 16)
    with caplog.at_level(logging.WARNING, logger="partitioner.api"):
        plan = partition(model, (x,), microbatches=4, split_points=SPLITS, recompute=False)
    assert not any(st.recompute for st in plan.stages)
    assert "recompute=False" in caplog.text and "--recompute auto|on" in caplog.text


def test_a_model_without_checkpoints_recomputes_nothing() -> None:
    model = nn.Sequential(*(ResidualMLP(16, 32, torch.tanh) for _ in range(3)))
    plan = partition(model, (torch.randn(2, 16),), 3, microbatches=4)
    assert plan.traced.checkpointed == ()
    assert not any(st.recompute for st in plan.stages)


def test_a_reentrant_checkpoint_is_refused() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's "none of the inputs require grad"
        with pytest.raises(ReentrantCheckpointError, match=r"blocks\.2, blocks\.3 .*use_reentrant=False"):
            partition(_Checkpointed(reentrant=True), (torch.randn(2, 16),), microbatches=4, split_points=SPLITS)
    assert torch.is_grad_enabled()


def test_hugging_face_gradient_checkpointing_enable() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renamed it activation_checkpointing_enable
        model.gradient_checkpointing_enable(every_n_layers=2)  # layers 0 and 2
        assert model.is_gradient_checkpointing
    gen = torch.Generator().manual_seed(5)
    ids, y = torch.randint(0, 64, (8, 8), generator=gen), torch.randint(0, 64, (8, 8), generator=gen)
    plan = partition(model, (ids[:2],), microbatches=4, split_points=["layers.1", "layers.2", "layers.3"])
    assert plan.traced.checkpointed == ("model.layers.0", "model.layers.2")
    assert [st.recompute for st in plan.stages] == [True, False, True, False]

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    want_loss, want = reference(copy.deepcopy(model), loss_fn, {"input_ids": ids}, y)
    trainer = PipelineTrainer(plan, loss_fn)
    assert trainer.recompute == frozenset({0, 2})
    torch.testing.assert_close(trainer.forward_backward(ids, y), want_loss, **TOL)
    check_grads(trainer, want)
    # An eval-mode model does not checkpoint when traced: its flags still say what training asks for.
    model.eval()
    assert partition(model, (ids[:2],), microbatches=4, split_points=["layers.1"]).traced.checkpointed == (
        "model.layers.0", "model.layers.2")
