"""Following a `pipecut train` run: the start-up block, the plain progress lines, OUT/train.log,
--tensorboard (issue 32, "A run you can follow")."""

from __future__ import annotations

import dataclasses
import re
import sys
import types
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch import nn

from partitioner import Cluster, partition
from partitioner.errors import MissingDependencyError
from partitioner.plan.layout import Layout
from partitioner.plan.plan import Plan
from partitioner.plan.units import fmt_bytes, fmt_time
from pipecut.cli import main
from pipecut.train import resolve
from pipecut.train.report import Journal, RunFacts, StepLog, count_parameters, start_report

REQUIRED = {"model": "m", "data": "d.bin", "out": "o"}
_STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d "


def _args(folder: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(folder), "--data", str(data), "--out", str(out), "--seq-len", "16",
            "--global-batch", "4", "--micro-batch-size", "2", "--pp", "2", "--checkpoint-every", "5", *extra]


def _small_plan(schedule: str = "1f1b", stages: int = 2) -> tuple[Plan, nn.Module]:
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8), nn.ReLU())
    plan = partition(model, (torch.randn(2, 8),), stages, cluster=Cluster.uniform(stages, "cpu"), microbatches=4,
                     schedule=schedule)
    return plan, model


def _facts(model: nn.Module, resumed_from: int = 0) -> RunFacts:
    params, trainable = count_parameters(model)
    return RunFacts(model_class=type(model).__name__, params=params, trainable=trainable, dp=1, pp=2, world=1,
                    resumed_from=resumed_from)


class _FakeWriter:
    """What --tensorboard calls of torch.utils.tensorboard.SummaryWriter, recorded."""

    made: ClassVar[list[_FakeWriter]] = []

    def __init__(self, log_dir: str, purge_step: int | None = None) -> None:
        self.log_dir, self.purge_step = log_dir, purge_step
        self.scalars: list[tuple[str, float, int]] = []
        self.texts: list[tuple[str, str, int]] = []
        self.closed = False
        _FakeWriter.made.append(self)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def add_text(self, tag: str, text: str, step: int) -> None:
        self.texts.append((tag, text, step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_tensorboard(monkeypatch: pytest.MonkeyPatch) -> type[_FakeWriter]:
    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = _FakeWriter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    _FakeWriter.made = []
    return _FakeWriter


# -- the pure parts ----------------------------------------------------------------------------------


def test_the_start_report_holds_the_plans_predictions_per_rank() -> None:
    plan, model = _small_plan()
    cfg = resolve({**REQUIRED, "global_batch": 8, "micro_batch_size": 2, "steps": 40}, {})
    report = start_report(cfg, plan, _facts(model))
    pred = plan.prediction("1f1b")
    assert report.params == sum(p.numel() for p in model.parameters()) == sum(st.params for st in plan.stages)
    assert [r.stages for r in report.ranks] == [(0,), (1,)]
    assert max(r.memory for r in report.ranks) == pytest.approx(pred.memory) == report.memory
    assert report.step_time == pytest.approx(pred.step_time) and not report.whole_step
    assert (report.microbatches, report.microbatch_size, report.global_batch, report.log_every) == (4, 2, 8, 2)
    text = "\n".join(report.lines())
    assert f"{report.params:,} parameters" in text and "Sequential" in text
    assert "1 replica(s) x 2-rank pipeline" in text and "schedule 1f1b" in text
    assert "8 sequences per step = 1 replica(s) x 4 micro-batches x 2 rows" in text
    assert f"predicted: step {fmt_time(pred.step_time)}" in text and f"fullest rank {fmt_bytes(pred.memory)}" in text
    assert "starting afresh" in text and f"log {Path('o') / 'train.log'}" in text and "tensorboard" not in text


def test_a_layout_plan_gives_its_own_whole_step_and_two_stage_ranks_show_both() -> None:
    plan, model = _small_plan("zbv", stages=4)  # two stages on each of two ranks
    lay = Layout(1, 2, 4, "zbv", 2, 4, 8, "zero1", step_time=2.5, pipeline_time=2.0, exchange_time=0.3,
                 optimizer_time=0.2, bubble=0.125, memory=3e6, capacity=8e9, exchange_bytes=0.0, recompute=0,
                 fits=True, priced=True)
    cfg = resolve({**REQUIRED, "global_batch": 8, "micro_batch_size": 2, "schedule": "zbv", "tensorboard": True}, {})
    report = start_report(cfg, dataclasses.replace(plan, layout=lay, choice="the fastest that fits"),
                          _facts(model, resumed_from=7))
    assert (report.step_time, report.memory, report.bubble, report.whole_step) == (2.5, 3e6, 0.125, True)
    assert sorted(s for r in report.ranks for s in r.stages) == [0, 1, 2, 3]
    assert all(len(r.stages) == 2 for r in report.ranks)
    text = "\n".join(report.lines())
    assert "step 2.50 s (the whole step" in text and "the layout search chose: the fastest that fits" in text
    assert f"resumed from {Path('o') / 'checkpoints' / 'step-7'}" in text
    assert f"tensorboard {Path('o') / 'tensorboard'}" in text


def test_progress_lines_come_at_the_first_every_nth_and_last_step_with_the_time_left() -> None:
    ticks = iter([100.0, 102.0, 104.0, 110.0])
    log = StepLog(steps=25, every=10, clock=lambda: next(ticks))  # made at 100 s
    due = {n: log.text({"step": n, "loss": 1.0}) for n in range(13, 26)}  # a run resumed at step 12
    assert [n for n, text in due.items() if text is not None] == [13, 20, 25]
    assert due[13] == "step 13/25  loss 1.0000  eta 24 s"  # 2 s for 1 step, 12 to go
    assert due[20] is not None and due[20].endswith("eta 2 s")  # 4 s for 8 steps, 5 to go
    assert due[25] is not None and due[25].endswith("eta 0 s")


def test_log_every_defaults_to_about_twenty_lines() -> None:
    assert [resolve(REQUIRED, {"steps": n}).log_interval for n in (1, 20, 100, 1001)] == [1, 1, 5, 51]
    assert resolve(REQUIRED, {"steps": 100, "log_every": 3}).log_interval == 3
    with pytest.raises(ValueError, match="log_every must be at least 1, got 0"):
        resolve(REQUIRED, {"log_every": 0})


def test_the_journal_writes_train_log_and_tensorboard_on_rank_0_only(
    tmp_path: Path, fake_tensorboard: type[_FakeWriter]
) -> None:
    plan, model = _small_plan()
    cfg = resolve({**REQUIRED, "out": str(tmp_path), "steps": 6, "log_every": 4, "tensorboard": True}, {})
    report = start_report(cfg, plan, _facts(model, resumed_from=3))
    with Journal(cfg, leader=False) as other:  # another rank: nothing written, no writer
        other.start(report)
        other.step({"step": 4, "loss": 1.0})
    assert not (tmp_path / "train.log").exists() and fake_tensorboard.made == []
    with pytest.raises(RuntimeError, match="boom"), Journal(cfg, leader=True) as journal:
        journal.start(report)
        for n in (4, 5):
            journal.step({"step": n, "loss": 2.0 / n, "lr": 1e-3, "grad_norm": None, "eval_loss": 1.5})
        raise RuntimeError("boom")
    (writer,) = fake_tensorboard.made
    assert writer.log_dir == str(tmp_path / "tensorboard") and writer.purge_step == 4  # hides steps 4.. of before
    assert writer.scalars == [("train/loss", 0.5, 4), ("train/lr", 1e-3, 4), ("eval/loss", 1.5, 4),
                              ("train/loss", 0.4, 5), ("train/lr", 1e-3, 5), ("eval/loss", 1.5, 5)]
    assert writer.texts[0][0] == "pipecut/start" and "pipecut train: m (Sequential)" in writer.texts[0][1]
    assert writer.closed
    log = (tmp_path / "train.log").read_text().splitlines()
    assert all(re.match(_STAMP, line) for line in log)
    body = [line[20:] for line in log]
    assert body[:len(report.lines())] == report.lines()
    assert [line.split("  ")[0] for line in body[len(report.lines()):-1]] == ["step 4/6"]  # the first; 5 not due
    assert body[-1] == "run stopped after step 5 of 6: RuntimeError: boom"


def test_tensorboard_without_the_package_is_refused_before_out_is_touched(
    llama_folder: Path, token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails, installed or not
    cfg = resolve({**REQUIRED, "tensorboard": True}, {})
    with pytest.raises(MissingDependencyError, match="pip install tensorboard"):
        Journal(cfg, leader=True)
    out = tmp_path / "run"
    assert main(_args(llama_folder, token_file, out, "--steps", "1", "--tensorboard")) == 2
    err = capsys.readouterr().err
    assert "--tensorboard" in err and "pip install tensorboard" in err
    assert not out.exists()


# -- a run, its log, its resume ----------------------------------------------------------------------


def test_a_run_prints_its_start_block_and_plain_lines_and_appends_train_log_on_resume(
    llama_folder: Path, token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "run"
    assert main(_args(llama_folder, token_file, out, "--steps", "5", "--log-every", "2", "--eval-every", "4")) == 0
    printed = capsys.readouterr().out.splitlines()  # capsys: stdout is not a terminal
    plan = Plan.load(out / "plan.json")
    pred = plan.prediction(plan.schedule)
    head = printed[0]
    assert head.startswith(f"pipecut train: {llama_folder} (LlamaForCausalLM), ")
    params = int(re.search(r"([\d,]+) parameters", head).group(1).replace(",", ""))  # type: ignore[union-attr]
    assert params == sum(st.params for st in plan.stages)  # the tiny Llama ties no weights
    block = printed[:printed.index(next(s for s in printed if s.startswith("files: "))) + 1]
    text = "\n".join(block)
    assert "1 replica(s) x 2-rank pipeline" in text and "schedule 1f1b" in text
    assert f"predicted: step {fmt_time(pred.step_time)}" in text and f"fullest rank {fmt_bytes(pred.memory)}" in text
    assert "4 sequences per step = 1 replica(s) x 2 micro-batches x 2 rows, of 16 tokens (64 tokens" in text
    assert f"log {out / 'train.log'}" in text and "steps: 0 -> 5, starting afresh" in text
    steps = [s for s in printed if s.startswith("step ")]
    assert [s.split("  ")[0] for s in steps] == ["step 1/5", "step 2/5", "step 4/5", "step 5/5"]
    assert "eval_loss" in steps[2]
    assert all(k in steps[0] for k in ("loss", "lr", "grad_norm", "tok/s", "ms/step", "eta"))
    assert printed[-1].startswith("trained 5 steps")

    # The same command with more steps resumes, on a terminal now: the bar, no plain lines; train.log
    # is appended with the resumed run's block and its lines all the same.
    from rich.console import Console

    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    assert main(_args(llama_folder, token_file, out, "--steps", "7", "--log-every", "2")) == 0
    again = capsys.readouterr().out
    assert f"steps: 5 -> 7, resumed from {out / 'checkpoints' / 'step-5'}" in again
    assert not re.search(r"^step \d", again, re.M)

    log = [line[20:] for line in (out / "train.log").read_text().splitlines()]
    assert log[:len(block)] == block  # the first run's block and lines, as printed
    assert [s.split("  ")[0] for s in log if s.startswith("step ")] == [
        "step 1/5", "step 2/5", "step 4/5", "step 5/5", "step 6/7", "step 7/7"]
    assert [s for s in log if s.startswith("run ")] == ["run ended at step 5 of 5", "run ended at step 7 of 7"]
    assert sum(s.startswith("pipecut train: ") for s in log) == 2
