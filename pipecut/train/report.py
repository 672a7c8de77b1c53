"""What a ``pipecut train`` run tells whoever follows it: the start-up block, a plain line every few
steps, ``OUT/train.log``, and (``--tensorboard``) TensorBoard's event files.

Legend: ``pp`` pipeline ranks, ``dp`` replicas, ``m`` micro-batches per replica, ``b`` rows per
micro-batch, ``B = dp * m * b`` rows per step.

``metrics.jsonl`` stays the record of every step (``metrics_log``); what is here is read by people:
the start-up block (:func:`start_report`, a pure function of the settings, the plan and what the
trainer knows) says what is about to run and what the planner predicts for it, so that the step
lines that follow can be held against it.

Example:
    >>> log = StepLog(steps=30, every=10, clock=iter([0.0, 1.0, 2.0]).__next__)
    >>> log.text({"step": 1, "loss": 4.25, "lr": 3e-4, "tokens_per_s": 2000.0, "step_time_s": 0.5})
    'step 1/30  loss 4.2500  lr 3.00e-04  2.0K tok/s  500.0 ms/step  eta 29 s'
    >>> log.text({"step": 2, "loss": 4.0}) is None   # not due: every 10th, the first and the last
    True
"""

from __future__ import annotations

import datetime
import importlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from torch import nn

from partitioner.errors import MissingDependencyError
from partitioner.plan.plan import Plan
from partitioner.plan.predict import prediction, simulate_stages
from partitioner.plan.units import fmt_bytes, fmt_count, fmt_time
from pipecut.train import checkpoints
from pipecut.train.config import TrainConfig
from runtime.metrics import format_metrics

__all__ = [
    "LOG_FILE", "TENSORBOARD_DIR", "RunFacts", "RankPlan", "StartReport", "start_report", "count_parameters",
    "StepLog", "step_text", "Journal", "summary_writer",
]

log = logging.getLogger(__name__)

LOG_FILE = "train.log"
TENSORBOARD_DIR = "tensorboard"


@dataclass(frozen=True)
class RunFacts:
    """What the trainer knows that the settings and the plan do not."""

    model_class: str
    params: int
    """Parameter elements of the whole model (a tied parameter once)."""
    trainable: int
    """Those of them that train (``requires_grad``)."""
    dp: int
    pp: int
    world: int
    """Processes in the job (1: one process, a thread per pipeline rank)."""
    resumed_from: int
    """The step the run starts from (0 when it starts afresh)."""
    tp: int = 1
    """Processes per pipeline rank, each holding a ``1/tp`` share of its stages' split layers."""


@dataclass(frozen=True)
class RankPlan:
    """One pipeline rank as the plan sees it: its stages and its predicted peak memory."""

    rank: int
    stages: tuple[int, ...]
    modules: tuple[str, ...]
    """Each stage's module range, as the plan's table reads it."""
    memory: float
    """Predicted peak bytes: its stages' training state and the activations it holds."""
    capacity: float


@dataclass(frozen=True, kw_only=True)
class StartReport(RunFacts):
    """Everything the start-up block says, as data (``lines()`` writes it): the run's facts and these."""

    model: str
    ranks: tuple[RankPlan, ...]
    schedule: str
    """The schedule that runs (what ``auto`` resolved to)."""
    schedule_asked: str
    choice: str
    """Why the planner chose, when it chose (``schedule auto`` or a layout search); else ``''``."""
    microbatches: int
    microbatch_size: int
    global_batch: int
    seq_len: int
    precision: str
    recompute: tuple[int, ...]
    """Stages that recompute their activations."""
    device: str
    step_time: float
    """Predicted seconds per step: the pipeline alone, or a layout's whole step (``whole_step``)."""
    whole_step: bool
    """Whether ``step_time`` includes the gradient exchange and the optimizer (a layout plan's)."""
    bubble: float
    memory: float
    """The fullest rank's predicted peak bytes."""
    capacity: float
    steps: int
    log_every: int
    checkpoint_every: int
    keep: int
    paths: tuple[tuple[str, Path], ...]
    """Where the run's files go, by what they are: out, checkpoints, metrics, log, final, tensorboard."""

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second over the job, as predicted."""
        return self.tokens_per_step / self.step_time if self.step_time > 0 else 0.0

    def path(self, what: str) -> Path:
        """Where ``what`` goes (``'log'``, ``'metrics'``, ...)."""
        return dict(self.paths)[what]

    def lines(self) -> list[str]:
        """The start-up block, a line each."""
        where = f"{self.world} processes" if self.world > 1 else "one process, a thread per pipeline rank"
        chose = ""
        if self.choice:
            chose = f" ({'auto' if self.schedule_asked == 'auto' else 'the layout search'} chose: {self.choice})"
        lines = [
            (f"pipecut train: {self.model} ({self.model_class}), {self.params:,} parameters "
             f"({fmt_count(self.params)}; {self.trainable:,} trainable)"),
            (f"layout: {self.dp} replica(s) x {self.pp}-rank pipeline"
             f"{f' x tp {self.tp} (each stage split over {self.tp} processes)' if self.tp > 1 else ''} on {where}; "
             f"{sum(len(r.stages) for r in self.ranks)} stages, schedule {self.schedule}{chose}"),
        ]
        for r in self.ranks:
            held = "; ".join(f"{s} ({mods})" for s, mods in zip(r.stages, r.modules))
            lines.append(f"  pipeline rank {r.rank}: stage{'s' if len(r.stages) > 1 else ''} {held}; "
                         f"predicted peak {fmt_bytes(r.memory)} of {fmt_bytes(r.capacity)}")
        recompute = (f"recompute on stage(s) {', '.join(map(str, self.recompute))}" if self.recompute
                     else "no recomputation")
        step = ("the whole step" if self.whole_step
                else "the pipeline alone, without the gradient exchange and optimizer")
        lines += [
            (f"batch: {self.global_batch} sequences per step = {self.dp} replica(s) x {self.microbatches} "
             f"micro-batches x {self.microbatch_size} rows, of {self.seq_len} tokens ({self.tokens_per_step:,} "
             "tokens per step)"),
            f"precision {self.precision}, {recompute}; costed for {self.device}",
            (f"predicted: step {fmt_time(self.step_time)} ({step}; bubble {self.bubble:.1%}), "
             f"{fmt_count(self.tokens_per_s)} tokens/s; fullest rank {fmt_bytes(self.memory)} of "
             f"{fmt_bytes(self.capacity)}"),
            f"steps: {self.resumed_from} -> {self.steps}, {self._start()}; a progress line every {self.log_every}",
            "files: " + ", ".join(f"{what} {p}{self._note(what)}" for what, p in self.paths),
        ]
        return lines

    def _start(self) -> str:
        if not self.resumed_from:
            return "starting afresh"
        return f"resumed from {checkpoints.checkpoint_dir(self.path('checkpoints'), self.resumed_from)}"

    def _note(self, what: str) -> str:
        if what != "checkpoints":
            return ""
        every = f"every {self.checkpoint_every} steps and the last" if self.checkpoint_every else "at the last step"
        return f" ({every}, keep {self.keep})"


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """``(all, trainable)`` parameter elements of ``model``, a tied parameter counted once (works on ``meta``).

    Example:
        >>> m = nn.Linear(4, 2)
        >>> _ = m.bias.requires_grad_(False)
        >>> count_parameters(m)
        (10, 8)
    """
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def start_report(cfg: TrainConfig, plan: Plan, facts: RunFacts) -> StartReport:
    """The start-up block of the run ``cfg`` describes, with the plan's predictions.

    Per-rank memory is the plan's stages run through the event simulator under the plan's
    schedule (what ``pipecut simulate`` shows); a plan from the layout search (``plan.layout``)
    gives its own step (pipeline, exchange and optimizer) and memory.
    """
    sched, sim = simulate_stages(plan.stages, plan.cluster, plan.schedule, plan.microbatches)
    pred = prediction(plan.stages, plan.schedule, plan.microbatches, sched, sim)
    peaks = sim.peak_bytes or (0.0,) * sched.num_ranks
    ranks = []
    for r in range(sched.num_ranks):
        mine = tuple(sched.stages_of(r))
        ranks.append(RankPlan(
            rank=r, stages=mine, modules=tuple(plan.stages[s].modules for s in mine),
            memory=sum(plan.stages[s].state_bytes for s in mine) + peaks[r],
            capacity=min(plan.stages[s].capacity for s in mine),
        ))
    lay = plan.layout
    out = Path(cfg.out)
    paths = [("out", out), ("checkpoints", out / "checkpoints"), ("metrics", out / "metrics.jsonl"),
             ("log", out / LOG_FILE), ("final", out / "final")]
    if cfg.tensorboard:
        paths.append(("tensorboard", out / TENSORBOARD_DIR))
    return StartReport(
        **vars(facts), model=cfg.model, ranks=tuple(ranks), schedule=plan.schedule,
        schedule_asked=cfg.schedule or plan.schedule, choice=plan.choice, microbatches=plan.microbatches,
        microbatch_size=plan.microbatch_size or cfg.micro_batch_size or 1, global_batch=cfg.global_batch,
        seq_len=cfg.seq_len, precision=plan.precision,
        recompute=tuple(st.index for st in plan.stages if st.recompute), device=plan.stages[0].device,
        step_time=lay.step_time if lay is not None else pred.step_time, whole_step=lay is not None,
        bubble=lay.bubble if lay is not None else pred.bubble,
        memory=lay.memory if lay is not None else pred.memory,
        capacity=lay.capacity if lay is not None else min(r.capacity for r in ranks),
        steps=cfg.steps, log_every=cfg.log_interval, checkpoint_every=cfg.checkpoint_every, keep=cfg.keep,
        paths=tuple(paths),
    )


# -- the step lines -------------------------------------------------------------------------------

_STEP_LINE: tuple[tuple[str, Callable[[Any], str]], ...] = (
    ("loss", "loss {:.4f}".format),
    ("lr", "lr {:.2e}".format),
    ("grad_norm", "grad_norm {:.3g}".format),
    ("tokens_per_s", lambda v: f"{fmt_count(v)} tok/s"),
    ("step_time_s", lambda v: f"{1e3 * v:.1f} ms/step"),
    ("eval_loss", "eval_loss {:.4f}".format),
)


def step_text(line: Mapping[str, Any], *, steps: int, eta_s: float | None) -> str:
    """One step's metrics line (``metrics.jsonl``'s) as plain text; the values it lacks are left out.

    Example:
        >>> step_text({"step": 3, "loss": 4.1, "grad_norm": 0.75, "eval_loss": 4.2}, steps=10, eta_s=75)
        'step 3/10  loss 4.1000  grad_norm 0.75  eval_loss 4.2000  eta 1m15s'
    """
    parts = [f"step {line['step']}/{steps}", *format_metrics(line, _STEP_LINE)]
    if eta_s is not None:
        parts.append(f"eta {_duration(eta_s)}")
    return "  ".join(parts)


def _duration(seconds: float) -> str:
    """``75 -> '1m15s'``, ``4000 -> '1h06m'``, ``8 -> '8 s'``."""
    if not math.isfinite(seconds):
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class StepLog:
    """Which steps get a progress line, and their text with the time left.

    A line is due at the first step it sees, every ``every``-th step, and the last (``steps``).
    The time left is the steps to go times the mean wall time per step since the log was made
    (evaluations and checkpoints included): make it just before the first step.

    Args:
        steps: the run's last step.
        every: steps between lines.
        clock: seconds, monotonic (``time.monotonic``; a test passes its own).
    """

    def __init__(self, *, steps: int, every: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.steps, self.every, self._clock = steps, every, clock
        self._t0 = clock()
        self._first: int | None = None

    def text(self, line: Mapping[str, Any]) -> str | None:
        """The line for this step's metrics, or ``None`` when it is not due."""
        step = int(line["step"])
        if self._first is None:
            self._first = step
        if step != self._first and step != self.steps and step % self.every:
            return None
        done = step - self._first + 1
        eta = (self._clock() - self._t0) / done * (self.steps - step)
        return step_text(line, steps=self.steps, eta_s=eta)


# -- the run's own record: train.log and TensorBoard -----------------------------------------------


def summary_writer() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``, or the refusal saying what to install.

    Raises:
        MissingDependencyError: ``tensorboard`` is not installed (an ``ImportError``).
    """
    try:
        return importlib.import_module("torch.utils.tensorboard").SummaryWriter
    except ImportError as e:
        raise MissingDependencyError(
            f"--tensorboard writes TensorBoard event files and needs the tensorboard package ({e}): "
            "pip install tensorboard, or leave --tensorboard out (OUT/metrics.jsonl holds every step either way)"
        ) from e


class Journal:
    """Rank 0's record of a run as it goes: ``OUT/train.log`` (the start-up block, the progress
    lines, how the run ended; appended by every run of the folder, each line flushed as written)
    and, with ``cfg.tensorboard``, every step's metrics under ``OUT/tensorboard``.

    Made before the run folder is touched (so ``--tensorboard`` without the package is refused
    first), entered once the folder is this run's; on other ranks it does nothing.

    Args:
        cfg: the run's settings.
        leader: whether this process writes (global rank 0).
    """

    def __init__(self, cfg: TrainConfig, *, leader: bool) -> None:
        self.cfg, self.leader = cfg, leader
        self.path = Path(cfg.out) / LOG_FILE
        self._writer_class = summary_writer() if cfg.tensorboard else None
        self._writer: Any = None
        self._steps: StepLog | None = None
        self._last = 0

    def __enter__(self) -> Journal:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if not self.leader or self._steps is None:
            return
        end = (f"run ended at step {self._last} of {self.cfg.steps}" if exc_type is None
               else f"run stopped after step {self._last} of {self.cfg.steps}: {exc_type.__name__}: {exc}")
        try:
            self._write([end])
        except OSError as e:  # a full disk: the run's own error is the one to tell
            log.warning("could not write to %s: %s", self.path, e)

    def start(self, report: StartReport) -> None:
        """Write the start-up block; open TensorBoard's writer (hiding the steps a resumed run repeats)."""
        self._steps = StepLog(steps=self.cfg.steps, every=self.cfg.log_interval)
        self._last = report.resumed_from
        if not self.leader:
            return
        self._write(report.lines())
        if self._writer_class is not None:
            # purge_step: events at and after the resumed step, written before the crash, are hidden.
            self._writer = self._writer_class(
                log_dir=str(Path(self.cfg.out) / TENSORBOARD_DIR),
                purge_step=report.resumed_from + 1 if report.resumed_from else None,
            )
            self._writer.add_text("pipecut/start", "\n".join("    " + s for s in report.lines()), report.resumed_from)

    def step(self, line: Mapping[str, Any]) -> None:
        """Record one step's metrics: every step to TensorBoard, the due ones to ``train.log``."""
        self._last = int(line["step"])
        if not self.leader or self._steps is None:
            return
        if self._writer is not None:
            for key, value in line.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._writer.add_scalar("eval/loss" if key == "eval_loss" else f"train/{key}", value, self._last)
            self._writer.flush()
        text = self._steps.text(line)
        if text is not None:
            self._write([text])

    def _write(self, lines: Sequence[str]) -> None:
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        with self.path.open("a") as f:
            f.writelines(f"{stamp} {s}\n" for s in lines)
