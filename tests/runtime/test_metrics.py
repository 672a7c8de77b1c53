"""Step metrics (a dict per step) and the rank-0 progress bar."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from parity import case, make_trainer
from runtime.metrics import TrainingProgress, batch_counts, describe, step_metrics


def test_metrics_of_a_step_count_tokens_time_and_the_bubble() -> None:
    c = case("gpt2", 2)
    opt = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    sched = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda i: 0.5 ** i)  # noqa: E731
    trainer = make_trainer(c, 2, "1f1b", optimizer=opt, lr_scheduler=sched)
    assert trainer.last_metrics == {}
    loss = trainer.step(c["x"], c["y"], max_norm=1.0)
    m = trainer.last_metrics
    assert m["step"] == 1 and m["loss"] == pytest.approx(float(loss))
    assert m["lr"] == pytest.approx(0.05)  # the scheduler stepped after the optimizer
    assert m["grad_norm"] == pytest.approx(float(trainer.last_grad_norm))
    assert m["step_time_s"] > 0
    assert m["samples_per_s"] == pytest.approx(8 / m["step_time_s"])
    assert m["tokens_per_s"] == pytest.approx(8 * 8 / m["step_time_s"])
    # 2 ranks, 4 micro-batches of 1F1B: each rank waits at least for the other's fill and drain.
    assert 0.0 < m["bubble"] < 1.0
    trainer.step(c["x"], c["y"])
    assert trainer.last_metrics["step"] == 2 and trainer.last_metrics["grad_norm"] is None


def test_step_metrics_and_batch_counts_by_hand() -> None:
    assert batch_counts([torch.zeros(3, 5)]) == (3, None)  # float inputs: samples only
    assert batch_counts([torch.zeros(2, 7, dtype=torch.long)], replicas=4) == (8, 56)
    m = step_metrics(step=1, loss=torch.tensor(2.0), seconds=2.0, busy=[1.0, 1.5], inputs=[torch.zeros(4, 2)])
    assert m["samples_per_s"] == 2.0 and m["bubble"] == pytest.approx(0.375) and m["lr"] is None


def test_the_progress_bar_draws_on_rank_0_only() -> None:
    out = io.StringIO()
    metrics = {"step": 3, "loss": 1.25, "tokens_per_s": 2500.0, "step_time_s": 0.02, "bubble": 0.3,
               "grad_norm": 0.5}
    with TrainingProgress(total=5, console=Console(file=out, width=150, force_terminal=False)) as bar:
        bar.update(metrics)
    text = out.getvalue()
    assert "3/5" in text and describe(metrics) in text
    assert describe(metrics) == "loss 1.2500  2.5k tok/s  20.0 ms/step  bubble 30%  |g| 0.5"
    quiet = io.StringIO()
    with TrainingProgress(total=5, console=Console(file=quiet), enabled=False) as bar:
        bar.update(metrics)
    assert quiet.getvalue() == ""
