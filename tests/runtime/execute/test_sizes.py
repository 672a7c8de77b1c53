"""Sizes a plan is valid for: a micro-batch size the model's code treats differently is refused, never run.

Each model here reads its input's sizes (a branch, a reshape, positions built with ``arange``...).
A pipelined step either equals the plain model run on the same micro-batches, loss and every
gradient, or raises ``InputShapeError`` before anything runs; it never computes something else.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from partitioner import InputShapeError, partition
from runtime import Execution, PipelineTrainer

TOL = {"rtol": 2e-5, "atol": 2e-6}


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)


class Branchy(_TwoLayers):
    """Doubles its hidden state when the batch has more than 4 rows (torch.export's guard: >= 5)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if x.shape[0] > 4:
            h = h * 2
        return self.b(h)


class Halves(_TwoLayers):
    """Sums pairs of rows: only even batches are valid (the guard: the batch is a multiple of 2)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        pairs = h.view(x.shape[0] // 2, 2, 16).sum(1)
        return self.b(pairs).repeat_interleave(2, dim=0)


class ShapeArithmetic(nn.Module):
    """The shape arithmetic of attention code: positions from ``arange`` with the input's dtype and
    device, masks from ``arange``, ``zeros``/``full`` sized from the input, halves of the last
    dimension, ``view(x.shape[0], -1)`` and ``expand_as``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        pos = torch.arange(n, dtype=x.dtype, device=x.device).unsqueeze(1)
        h = torch.tanh(self.a(x)) + 0.01 * pos
        half = h.size(-1) // 2
        left, right = h[..., :half], h[..., half:]
        mask = torch.arange(half, device=x.device)[None, :] < (half // 2)
        bias = torch.zeros(n, half, dtype=x.dtype, device=x.device) + torch.full(
            (n, 1), 0.5, dtype=x.dtype, device=x.device
        )
        mixed = torch.where(mask.expand_as(left), left, right) + bias
        g = torch.tanh(self.b(x)).view(x.shape[0], -1)
        return self.c(torch.cat([mixed, mixed], dim=-1) * g)


def _reference(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, m: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The plain model on the same ``m`` micro-batches: the mean of their losses, and its gradients."""
    ref = copy.deepcopy(model)
    loss = sum(nn.functional.mse_loss(ref(xm), ym) for xm, ym in zip(x.chunk(m), y.chunk(m))) / m
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}


def _pipelined(model: nn.Module, example: torch.Tensor, x: torch.Tensor, y: torch.Tensor, m: int,
               schedule: str = "1f1b") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    plan = partition(model, (example,), num_stages=2)
    execution = Execution(schedule=schedule, microbatches=m)
    trainer = PipelineTrainer(plan, nn.functional.mse_loss, None, execution=execution)
    loss = trainer.forward_backward(x, y)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _equal(model_fn: Callable[[], nn.Module], example_rows: int, rows: int, m: int, schedule: str = "1f1b") -> None:
    torch.manual_seed(0)
    model = model_fn()
    x, y = torch.randn(rows, 8), torch.randn(rows, 1)
    want_loss, want = _reference(model, x, y, m)
    got_loss, got = _pipelined(model, torch.randn(example_rows, 8), x, y, m, schedule)
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=name)


def test_a_branch_on_the_batch_size_is_refused_at_a_size_it_does_not_hold_for() -> None:
    # Planned with 8 rows; micro-batches of 4 would take the other branch of the model's code.
    torch.manual_seed(0)
    model = Branchy()
    plan = partition(model, (torch.randn(8, 8),), num_stages=2)
    trainer = PipelineTrainer(plan, nn.functional.mse_loss, None, execution=Execution(microbatches=4))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(InputShapeError, match=r"guard `x\.size\(\)\[0\] >= 5`") as info:
        trainer.forward_backward(torch.randn(16, 8), torch.randn(16, 1))
    assert isinstance(info.value, ValueError)
    assert "traced (8, 8), got (4, 8)" in str(info.value) and "re-plan" in str(info.value)
    assert all(p.grad is None for p in model.parameters())  # nothing ran
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize(("rows", "m"), [(16, 2), (15, 3), (10, 2)])  # micro-batches of 8, 5, 5 rows
def test_a_branch_on_the_batch_size_runs_exactly_where_its_guard_holds(rows: int, m: int) -> None:
    _equal(Branchy, 8, rows, m)


def test_a_reshape_into_pairs_holds_for_even_sizes_only() -> None:
    _equal(Halves, 8, 12, 2)  # micro-batches of 6
    _equal(Halves, 8, 8, 4)  # of 2
    torch.manual_seed(0)
    plan = partition(Halves(), (torch.randn(8, 8),), num_stages=2)
    trainer = PipelineTrainer(plan, nn.functional.mse_loss, None, execution=Execution(microbatches=4))
    with pytest.raises(InputShapeError, match="got \\(3, 8\\)"):  # refused before any stage runs
        trainer.forward_backward(torch.randn(12, 8), torch.randn(12, 1))
    exported = partition(Halves(), (torch.randn(8, 8),), num_stages=2, trace_method="export")
    trainer = PipelineTrainer(exported, nn.functional.mse_loss, None, execution=Execution(microbatches=4))
    with pytest.raises(InputShapeError, match=r"guard `.*x\.size\(\)\[0\]"):
        trainer.forward_backward(torch.randn(12, 8), torch.randn(12, 1))


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
@pytest.mark.parametrize(("example_rows", "rows", "m"), [(4, 8, 2), (4, 12, 4), (4, 4, 4), (6, 10, 2)])
def test_shape_arithmetic_runs_at_any_micro_batch_size(schedule: str, example_rows: int, rows: int, m: int) -> None:
    # Micro-batches of the traced size and of others, one row included.
    _equal(ShapeArithmetic, example_rows, rows, m, schedule)


def test_shape_arithmetic_under_torch_export_too() -> None:
    torch.manual_seed(0)
    model = ShapeArithmetic()
    x, y = torch.randn(12, 8), torch.randn(12, 1)
    want_loss, want = _reference(model, x, y, 3)
    plan = partition(model, (torch.randn(6, 8),), num_stages=2, trace_method="export")
    assert plan.trace_method == "export"
    trainer = PipelineTrainer(plan, nn.functional.mse_loss, None, execution=Execution(microbatches=3))
    torch.testing.assert_close(trainer.forward_backward(x, y).detach(), want_loss, **TOL)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], **TOL, msg=name)


def test_an_example_that_is_a_view_gives_guards_on_sizes_only() -> None:
    # Found by the demo: an example sliced from a longer one (x[:, :-1], a view) got export guards
    # on its base tensor, which a micro-batch's sizes alone could not satisfy.
    torch.manual_seed(0)
    model = Halves()
    x, y = torch.randn(8, 9), torch.randn(8, 1)
    example = torch.randn(4, 9)[:, :-1]
    assert example._base is not None and not example.is_contiguous()
    plan = partition(model, (example,), num_stages=2, trace_method="export")
    want_loss, want = _reference(model, x[:, :-1], y, 2)
    trainer = PipelineTrainer(plan, nn.functional.mse_loss, None, execution=Execution(microbatches=2))
    torch.testing.assert_close(trainer.forward_backward(x[:, :-1], y).detach(), want_loss, **TOL)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], **TOL, msg=name)
