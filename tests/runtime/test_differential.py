"""A differential harness: generated models, pipelined at random sizes, against the plain model.

Hypothesis draws a small model (a chain of linear blocks with skips across stages, a buffer,
in-place ops, a weight used at two depths, code that reads the batch size), an example size, a
batch, a micro-batch count, a schedule, a stage count and a transport. Each case must end one of
two ways: the pipelined loss and every gradient equal the plain model's on the same micro-batches,
or pipecut refuses the settings with a typed error before any stage runs. A different answer, an
untyped error, or a failure inside a stage where the plain model runs fine, fails the test. A
batch the plain model itself rejects has no reference: such a case ends "not comparable" (a graph
export captured keeps the ops, not a module's Python checks, so the pipeline may run it).

Profiles: the quick one runs in CI; ``PIPECUT_FUZZ=long`` runs many more cases
(``python -m pytest tests/runtime/test_differential.py --hypothesis-show-statistics`` prints how
the cases ended). A failure found here becomes a named regression test below the harness.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

from partitioner import partition
from partitioner.errors import PipecutError
from partitioner.schedule.registry import TRAINING_SCHEDULES, stages_per_rank
from profiles import LONG
from runtime import Execution, PipelineTrainer
from runtime.errors import LossError, StageError

TOL = {"rtol": 1e-4, "atol": 1e-5}
BLOCKS = ("linear", "skip", "buffer", "inplace", "tied", "batch_branch", "pairs", "batchnorm")


@dataclass(frozen=True)
class Spec:
    """A generated model: its blocks in order, and its width."""

    blocks: tuple[str, ...]
    width: int


class Generated(nn.Module):
    """The model a :class:`Spec` describes; every block keeps the width."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        w = spec.width
        self.spec = spec
        self.stem = nn.Linear(6, w)
        self.layers = nn.ModuleList(nn.Linear(w, w) for _ in spec.blocks)
        self.norms = nn.ModuleDict({str(i): nn.BatchNorm1d(w) for i, k in enumerate(spec.blocks) if k == "batchnorm"})
        self.register_buffer("offset", torch.linspace(-0.5, 0.5, w))
        self.head = nn.Linear(w, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        seen = [h]
        for i, (kind, layer) in enumerate(zip(self.spec.blocks, self.layers)):
            if kind == "linear":
                h = torch.tanh(layer(h))
            elif kind == "skip":  # a value read several blocks (and perhaps stages) later
                h = torch.tanh(layer(h)) + seen[max(0, i - 3)]
            elif kind == "buffer":
                h = torch.tanh(layer(h) + self.offset)
            elif kind == "inplace":
                h = layer(h)
                h = h.relu_().add_(0.1)
            elif kind == "tied":  # the stem's weight used again deep in the model
                h = torch.tanh(layer(h)) + 0.1 * nn.functional.linear(h[..., :6], self.stem.weight.t()[:6, :6]).sum(
                    -1, keepdim=True
                )
            elif kind == "batch_branch":  # code that reads the batch size
                h = torch.tanh(layer(h))
                if x.shape[0] > 2:
                    h = h * 1.5
            elif kind == "batchnorm":  # running statistics updated by every forward, in order
                h = torch.tanh(self.norms[str(i)](layer(h)))
            elif kind == "pairs":  # a reshape that needs an even batch
                h = torch.tanh(layer(h))
                h = h.view(x.shape[0] // 2, 2, -1).flip(1).reshape(x.shape[0], -1)
            seen.append(h)
        return self.head(h)


@st.composite
def cases(draw: st.DrawFn) -> dict[str, object]:
    blocks = tuple(draw(st.lists(st.sampled_from(BLOCKS), min_size=2, max_size=6)))
    schedule = draw(st.sampled_from(TRAINING_SCHEDULES))
    ranks = draw(st.integers(1, 3))
    m = draw(st.integers(1, 4))
    rows = m * draw(st.integers(1, 4))
    return {
        "spec": Spec(blocks, draw(st.sampled_from((4, 8)))),
        "example_rows": draw(st.integers(1, 6)),
        # Mostly batches that divide into the micro-batches; now and then one that does not.
        "rows": rows if draw(st.integers(0, 9)) else draw(st.integers(1, 12)),
        "m": m,
        "schedule": schedule,
        "stages": ranks * stages_per_rank(schedule),
        "transport": draw(st.sampled_from(("sequential", "local"))),
        "seed": draw(st.integers(0, 2**16)),
    }


def _plain(model: nn.Module, x: torch.Tensor, y: torch.Tensor, m: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The plain model (a copy) on ``m`` equal micro-batches in order: the mean of their losses, the
    gradients, and the buffers after (running statistics see the micro-batches one by one)."""
    ref = copy.deepcopy(model)
    losses = [nn.functional.mse_loss(ref(xm), ym) for xm, ym in zip(x.split(x.shape[0] // m), y.split(x.shape[0] // m))]
    loss = torch.stack(losses).mean()
    loss.backward()
    after = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    after.update({f"buffer {n}": b.clone() for n, b in ref.named_buffers()})
    return loss.detach(), after


def run_case(c: dict[str, object]) -> str:
    """Run one case; return how it ended (``'equal'``, ``'refused: <error>'`` or ``'not comparable: ...'``),
    or fail."""
    seed, spec, m = int(c["seed"]), c["spec"], int(c["m"])  # type: ignore[call-overload]
    assert isinstance(spec, Spec)
    torch.manual_seed(seed)
    model = Generated(spec)
    x, y = torch.randn(int(c["rows"]), 6), torch.randn(int(c["rows"]), 2)  # type: ignore[call-overload]
    example = torch.randn(int(c["example_rows"]), 6)  # type: ignore[call-overload]
    untouched = copy.deepcopy(model)  # the reference starts from the model as it was given
    try:
        plan = partition(model, (example,), num_stages=int(c["stages"]))  # type: ignore[call-overload]
        trainer = PipelineTrainer(
            plan, nn.functional.mse_loss, None,
            execution=Execution(schedule=str(c["schedule"]), microbatches=m, transport=str(c["transport"])),
        )
        got_loss = trainer.forward_backward(x, y)
    except (StageError, LossError):
        # A failure inside a stage is a refusal only where the plain model fails too.
        try:
            _plain(untouched, x, y, m)
        except Exception:
            return "refused: the model itself fails"
        raise
    except PipecutError as e:
        return f"refused: {type(e).__name__}"
    try:
        want_loss, want = _plain(untouched, x, y, m)
    except Exception:
        # The plain model's own Python checks reject the batch (BatchNorm's "more than 1 value per
        # channel"): an exported graph keeps the ops, not such checks, so there is nothing to compare.
        return "not comparable: the model itself fails"
    torch.testing.assert_close(got_loss.detach(), want_loss, **TOL)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    got.update({f"buffer {n}": b for n, b in model.named_buffers()})
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=name)
    return "equal"


@settings(
    max_examples=400 if LONG else 30,
    deadline=None,
    derandomize=not LONG,  # CI runs the same cases every time
    suppress_health_check=[HealthCheck.too_slow],
)
@given(cases())
def test_pipelined_equals_the_plain_model_or_refuses(c: dict[str, object]) -> None:
    event(run_case(c))


# -- regression tests for what the harness found ----------------------------------------------


def test_micro_batches_that_do_not_divide_the_batch_are_refused() -> None:
    c = {"spec": Spec(("linear", "skip"), 4), "example_rows": 2, "rows": 5, "m": 2, "schedule": "1f1b",
         "stages": 2, "transport": "sequential", "seed": 0}
    assert run_case(c) == "refused: MicrobatchError"


@pytest.mark.parametrize("rows", [4, 8])
def test_a_batch_branch_planned_at_one_row_is_refused_above_it(rows: int) -> None:
    # Traced at 1 row (export widens it to 2), trained at more: the branch would differ.
    c = {"spec": Spec(("batch_branch", "linear"), 4), "example_rows": 1, "rows": rows, "m": 1,
         "schedule": "1f1b", "stages": 2, "transport": "sequential", "seed": 0}
    assert run_case(c) in ("equal", "refused: InputShapeError")


def test_running_statistics_after_a_step_at_a_new_size_equal_the_plain_models() -> None:
    # Found by the harness: checking a new micro-batch size ran the graph on fake tensors, and
    # BatchNorm's leaf still counted that run in its real num_batches_tracked.
    c = {"spec": Spec(("linear", "batchnorm"), 4), "example_rows": 2, "rows": 3, "m": 1,
         "schedule": "1f1b", "stages": 1, "transport": "sequential", "seed": 0}
    assert run_case(c) == "equal"


def test_a_batch_the_plain_model_itself_rejects_is_not_compared() -> None:
    # Found by the long profile's harness: the batch branch sends the model to torch.export, whose
    # graph calls aten.batch_norm without BatchNorm1d's Python check, so one row per channel runs
    # in the pipeline where the plain model raises ValueError; the harness has no reference then.
    c = {"spec": Spec(("batch_branch", "batchnorm"), 4), "example_rows": 2, "rows": 1, "m": 1,
         "schedule": "1f1b", "stages": 1, "transport": "sequential", "seed": 0}
    assert run_case(c) in ("not comparable: the model itself fails", "refused: the model itself fails")


def test_guards_undefined_at_one_row_are_a_refusal() -> None:
    # Found by the harness: export's guard for a reshape into pairs divides by the size; at one
    # row evaluating it raised ZeroDivisionError instead of refusing the size.
    c = {"spec": Spec(("pairs", "batch_branch"), 4), "example_rows": 2, "rows": 1, "m": 1,
         "schedule": "1f1b", "stages": 1, "transport": "sequential", "seed": 0}
    assert run_case(c) in ("refused: InputShapeError", "refused: the model itself fails")
