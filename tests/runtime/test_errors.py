"""Errors in a pipelined step say where they happened and what to do (issue 9).

One test per row of the issue's table (bad inputs to a trained 2-stage MLP), then the parts:
the failing node named for forward errors, the action for backward ones, the loss contract,
the opt-in finite check, and over 2 gloo processes the failing rank's error first with its
peer saying it stopped because of it.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import InputError, InputShapeError, partition
from partitioner.zoo import MLPChain
from rank_pool import spawn as pool_spawn
from runtime import LossError, PipelineTrainer, StageError
from runtime.errors import failing_node
from runtime.transport.launch import LaunchError, spawn  # the tests of spawn itself

CPU = torch.device("cpu")


def _mlp_trainer(**kw: Any) -> PipelineTrainer:
    """A trained 2-stage MLP: 16 features in, 16 out, 4 micro-batches of 2."""
    model = MLPChain((16, 32, 32, 16))
    plan = partition(model, (torch.randn(2, 16),), 2, microbatches=4)
    trainer = PipelineTrainer(plan, nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1), **kw)
    trainer.step(torch.randn(8, 16), torch.randn(8, 16))
    return trainer


@pytest.fixture(scope="module")
def mlp() -> PipelineTrainer:
    return _mlp_trainer()


def _unchanged(trainer: PipelineTrainer) -> Any:
    return {n: p.detach().clone() for n, p in trainer.named_parameters()}


# -- the table, row by row ---------------------------------------------------------------


def test_inputs_with_the_wrong_feature_count_are_refused_before_the_step(mlp: PipelineTrainer) -> None:
    before = _unchanged(mlp)
    with pytest.raises(InputShapeError, match=r"input 'x': traced \(2, 16\), got \(2, 8\)") as err:
        mlp.step(torch.randn(8, 8), torch.randn(8, 16))
    assert "re-plan" in str(err.value) and "mat1 and mat2" not in str(err.value)
    assert all(torch.equal(p, before[n]) for n, p in mlp.named_parameters())


def test_float64_inputs_to_a_float32_model_name_the_dtype_and_the_fix(mlp: PipelineTrainer) -> None:
    want = r"input 'x' is float64 but the plan was traced with float32.*x\.to\(torch\.float32\)"
    with pytest.raises(InputError, match=want):
        mlp.step(torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16))


def test_targets_of_the_wrong_shape_name_the_loss_call(mlp: PipelineTrainer) -> None:
    with pytest.warns(UserWarning), pytest.raises(StageError) as err:  # mse_loss warns about broadcasting
        mlp.step(torch.randn(8, 16), torch.randn(8, 3))
    e = err.value
    assert (e.rank, e.stage, e.action, e.kind, e.mb) == (1, 1, "1F0", "loss", 0)
    assert "loss_fn(output=tensor (2, 16) float32, target=tensor (2, 3) float32)" in str(e)
    assert "The size of tensor a (16) must match the size of tensor b (3)" in str(e)
    assert isinstance(e.__cause__, RuntimeError)


def test_targets_with_other_rows_than_the_inputs_are_refused(mlp: PipelineTrainer) -> None:
    with pytest.raises(InputError, match=r"targets have 4 rows \(shape \(4, 16\)\) but the inputs have 8"):
        mlp.step(torch.randn(8, 16), torch.randn(4, 16))


def test_a_loss_that_is_not_a_scalar_shows_what_came_and_the_signature() -> None:
    trainer = _mlp_trainer()
    trainer.loss_fn = lambda out, y: (out - y) ** 2
    with pytest.raises(LossError, match=r"rank 1, stage 1, micro-batch 0: loss_fn returned tensor \(2, 16\) float32, "
                                        r"but it must return a scalar tensor.*def loss_fn\(output, target\)"):
        trainer.step(torch.randn(8, 16), torch.randn(8, 16))
    trainer.loss_fn = lambda out, y: nn.functional.mse_loss(out, y).item()
    with pytest.raises(LossError, match="loss_fn returned float"):
        trainer.step(torch.randn(8, 16), torch.randn(8, 16))
    trainer.loss_fn = lambda out, y: nn.functional.mse_loss(out.detach(), y)
    with pytest.raises(LossError, match=r"does not require grad.*detach"):
        trainer.step(torch.randn(8, 16), torch.randn(8, 16))


def test_a_binary_plan_file_is_a_plan_format_error(tmp_path: Any) -> None:
    from partitioner import Plan, PlanFormatError

    (tmp_path / "plan.json").write_bytes(bytes(range(256)))
    with pytest.raises(PlanFormatError, match="not a text file"):
        Plan.load(tmp_path / "plan.json")


# -- part 2: the other input checks ---------------------------------------------------------------


def test_the_number_and_kind_of_inputs_are_checked(mlp: PipelineTrainer) -> None:
    want = r"the model takes 1 input\(s\) \['x'\], but the step got 2; pass it as trainer.step\(x, targets\)"
    with pytest.raises(InputError, match=want):
        mlp.step((torch.randn(8, 16), torch.randn(8, 16)), torch.randn(8, 16))
    want = r"input 'x' is a float, but the plan was traced with a tensor of shape \(2, 16\)"
    with pytest.raises(InputError, match=want):
        mlp.step(3.0, torch.randn(8, 16))


def test_export_graph_fixed_dimension_is_checked_before_any_stage_runs() -> None:
    from rotary_case import RotaryNet

    plan = partition(RotaryNet(), (torch.randn(2, 6, 8),), 2, microbatches=2)
    trainer = PipelineTrainer(plan, nn.functional.mse_loss, transport="local")
    with pytest.raises(InputShapeError, match=r"keeps dimension 2 fixed at 8, but got \(2, 6, 4\)"):
        trainer.forward_backward(torch.randn(4, 6, 4), torch.randn(4, 6, 8))


# -- part 1: errors inside a stage ----------------------------------------------------------------


def test_a_forward_error_names_rank_stage_action_module_and_source_line() -> None:
    from parity import case, make_trainer

    c = case("gpt2", 2)
    trainer = make_trainer(c, 2, "1f1b")
    x = c["x"].clone()
    x[5, 3] = 500  # a token id beyond the vocabulary (64): row 5 is in micro-batch 2
    with pytest.raises(StageError) as err:
        trainer.forward_backward(x, c["y"])
    e = err.value
    assert (e.rank, e.stage, e.action, e.kind, e.mb) == (0, 0, "0F2", "F", 2)
    assert e.node is not None and e.node.module == "model.transformer.wte"
    assert e.node.source is not None and re.search(r"modeling_gpt2\.py:\d+ in forward: .*self\.wte\(", e.node.source)
    assert str(e).startswith(
        "rank 0, stage 0, action 0F2 (forward of micro-batch 2) failed in module 'model.transformer.wte'"
    )
    assert "IndexError: index out of range" in str(e) and isinstance(e.__cause__, IndexError)


class _Picky(nn.Module):
    """Once armed, raises on large values: an error mid-model that only data triggers."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and bool((x.abs() > 100).any()):
            raise ValueError("values above 100 are not allowed")
        return x


class _PickyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.picky = _Picky()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(self.picky(h * 1000))


def test_an_fx_graph_error_names_the_leaf_module_and_the_line_in_the_model() -> None:
    model = _PickyNet()
    plan = partition(model, (torch.randn(2, 4),), 2, microbatches=2, leaf_modules=[_Picky],
                     split_points=["picky"])
    assert plan.trace_method == "fx"
    trainer = PipelineTrainer(plan, nn.functional.mse_loss, transport="local")
    model.picky.armed = True
    with pytest.raises(StageError) as err:
        trainer.forward_backward(torch.randn(4, 4) + 1, torch.randn(4, 4))
    e = err.value
    assert (e.stage, e.kind) == (1, "F") and e.node is not None and e.node.module == "picky"
    assert e.node.source is not None and "test_errors.py" in e.node.source
    assert "self.picky(h * 1000)" in e.node.source
    assert "ValueError: values above 100 are not allowed" in str(e)


class _BadBackward(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        if _BadBackward.armed:
            raise RuntimeError("this backward always fails")
        return g


class _BadGrad(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _BadBackward.apply(x)  # type: ignore[no-any-return]


class _BadBackwardNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bad, self.b = nn.Linear(4, 4), _BadGrad(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.bad(self.a(x)))


@pytest.mark.parametrize(
    ("schedule", "split", "stage", "kind"),
    # Stage 1 receives an input that needs a gradient, so its I runs the failing backward; on
    # stage 0 (no such input) the whole backward is W's.
    [("1f1b", "bad", 1, "B"), ("zbh1", "bad", 1, "I"), ("zbh1", "b", 0, "W")],
)
def test_a_backward_error_names_the_action_and_how_to_find_the_node(
    schedule: str, split: str, stage: int, kind: str
) -> None:
    plan = partition(_BadBackwardNet(), (torch.randn(2, 4),), 2, microbatches=2, leaf_modules=[_BadGrad],
                     split_points=[split])
    trainer = PipelineTrainer(plan, nn.functional.mse_loss, schedule=schedule, transport="local")
    _BadBackward.armed = True
    try:
        with pytest.raises(StageError) as err:
            trainer.forward_backward(torch.randn(4, 4), torch.randn(4, 4))
    finally:
        _BadBackward.armed = False
    e = err.value
    assert (e.rank, e.stage, e.kind, e.action) == (stage, stage, kind, f"{stage}{kind}{e.mb}") and e.node is None
    assert "this backward always fails" in str(e) and "set_detect_anomaly(True)" in str(e)


def test_a_failed_step_leaves_grad_mode_and_the_trainer_usable(mlp: PipelineTrainer) -> None:
    with pytest.raises(InputError):
        mlp.step(torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16))
    assert torch.is_grad_enabled()
    loss = mlp.step(torch.randn(8, 16), torch.randn(8, 16))
    assert torch.isfinite(loss)


def test_failing_node_is_none_for_errors_from_outside_the_graph() -> None:
    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    try:
        raise RuntimeError("elsewhere")
    except RuntimeError as e:
        assert failing_node(e, gm) is None


# -- part 3: the opt-in finite check --------------------------------------------------------------


def test_nan_loss_is_returned_by_default_and_refused_with_check_finite() -> None:
    trainer = _mlp_trainer()
    x = torch.randn(8, 16)
    x[6] = float("nan")  # micro-batch 3
    assert torch.isnan(trainer.forward_backward(x, torch.randn(8, 16)))
    checked = _mlp_trainer(check_finite=True)
    before = _unchanged(checked)
    with pytest.raises(LossError, match=r"rank 1, stage 1, micro-batch 3: the loss is nan \(check_finite=True\)"):
        checked.step(x, torch.randn(8, 16))
    assert all(torch.equal(p, before[n]) for n, p in checked.named_parameters())


# -- over 2 gloo processes ------------------------------------------------------------------------


def _failing_rank(rank: int, world: int, where: str) -> dict[str, str]:
    """Rank ``rank`` of a 2-stage step that fails in rank 1's loss (an MLP given targets of the
    wrong width) or in rank 0's forward (a GPT-2 given a token id beyond its vocabulary)."""
    from parity import case, make_trainer, step_failure

    c = case("gpt2" if where == "forward" else "mlp", world)
    trainer = make_trainer(c, world, "1f1b", transport="dist", timeout=60)
    x, y = c["x"].clone(), c["y"].clone()
    if where == "forward":
        x[5, 3] = 500
    else:
        y = y[:, :3]
    return step_failure(trainer, x, y)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("where", "culprit"), [("loss", 1), ("forward", 0)])
def test_over_gloo_the_failing_rank_is_named_by_its_peer(where: str, culprit: int) -> None:
    results = pool_spawn(_failing_rank, 2, where, timeout=120)
    own, peer = results[culprit], results[1 - culprit]
    assert own["type"] == "StageError", own
    assert own["message"].startswith(f"rank {culprit}, stage {culprit}, action {culprit}F")
    assert peer["type"] == "PeerFailed", peer
    quoted = f"The first rank to fail reported: rank {culprit} failed: StageError: rank {culprit}, stage {culprit}"
    assert quoted in peer["message"]


def _raise_on_rank1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 gives up")
    torch.distributed.barrier()  # fails once rank 1's group is gone


@pytest.mark.multiprocess
def test_spawn_reports_the_failing_rank_before_its_peers() -> None:
    with pytest.raises(LaunchError, match=r"rank 1 failed first:[\s\S]*ValueError: rank 1 gives up"):
        spawn(_raise_on_rank1, 2, timeout=120)


def _exit_quietly_on_rank1(rank: int, world: int) -> int:
    if rank == 1:
        import os

        os._exit(0)  # ends the process without reporting a result or an error
    return rank


@pytest.mark.multiprocess
def test_spawn_notices_a_rank_that_exits_without_a_result() -> None:
    with pytest.raises(LaunchError, match=r"rank\(s\) \[1\] of 2 failed; rank 1 failed first:\n"
                                          r"process exited \(code 0\) without reporting a result"):
        spawn(_exit_quietly_on_rank1, 2, timeout=60)
