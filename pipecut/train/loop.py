"""One ``pipecut train`` run: plan the folder's model, build the trainer, resume, step, save, export.

Legend: ``pp`` pipeline ranks, ``dp`` replicas, ``tp`` processes per pipeline rank, ``B`` sequences
per step, ``b`` rows per micro-batch, ``m`` micro-batches per step (``B = dp * m * b``), ``L``
sequence length.

One process runs the whole pipeline (a thread per rank); under ``torchrun`` the job's
``dp * pp * tp`` processes each run one rank of one replica, or a ``1/tp`` share of its layers
(gloo on CPU, NCCL on GPUs). Every process
builds the model on ``meta`` and makes the same plan (planning is deterministic); each then
allocates and loads only its own stages.

Restart is resume: the run starts from the newest complete checkpoint under
``OUT/checkpoints`` when there is one. Weights, optimizer state, step and RNG states come back
from it, the learning rate and the data are functions of the step, so the run ends with the
weights an uninterrupted one would have, bit for bit.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partitioner.api import partition
from partitioner.cost.devices import Cluster, default_device
from partitioner.cost.recompute import RECOMPUTE_FLAGS
from partitioner.errors import PipecutError
from partitioner.options import Costing, Cut
from partitioner.plan.plan import Plan
from pipecut.folder import HFFolder, max_positions
from pipecut.train import checkpoints, finite, layout_choice, metrics_log, report, runfolder
from pipecut.train.config import TrainConfig, TrainConfigError, check_tp_options, read_toml, resolve, to_toml
from pipecut.train.data import EVAL, TRAIN, TokenData, open_tokens
from pipecut.train.export import export_final
from pipecut.train.lr import lr_at
from runtime.calibration import next_token_loss
from runtime.errors import LossError
from runtime.options import DataParallel, Execution, Init
from runtime.parallel.tensor_stages import plan_problem, size_problems
from runtime.state.weights import Weights
from runtime.trainer import PipelineTrainer
from runtime.transport.process_group import ensure_process_group, world_split

__all__ = ["train", "TrainResult", "Layout", "layout", "lm_loss", "BETAS"]

log = logging.getLogger(__name__)

BETAS = (0.9, 0.95)  # AdamW's, as nanoGPT and most LLM recipes use


@dataclass(frozen=True)
class Layout:
    """How the job's processes and the batch divide: ``dp`` replicas of ``pp`` ranks of ``tp`` processes each,
    ``m`` micro-batches."""

    pp: int
    dp: int
    m: int
    rank: int
    """This process's global rank (0 in one process)."""
    dp_rank: int
    """This process's replica."""
    tp: int = 1


@dataclass
class TrainResult:
    """What a run did: the steps it took now, the last metrics, the final export."""

    resumed_from: int
    """The step the run started from (0 when it started afresh)."""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    final: Path | None = None
    plan: Plan | None = None


# Next-token cross-entropy, the mean over the micro-batch's tokens: the loss `pipecut calibrate
# --model` fits with is the one a run trains with.
lm_loss = next_token_loss


def layout(cfg: TrainConfig, world: int, rank: int) -> Layout:
    """Split ``world`` processes into ``dp x pp x tp`` and the global batch into micro-batches.

    Raises:
        TrainConfigError: ``dp * pp * tp`` is not the world size, the batch does not divide, or
            ``tp > 1`` with an option it does not run with yet (``--zero fsdp``).

    Example:
        >>> cfg = TrainConfig(model="m", data="d", out="o", global_batch=8, micro_batch_size=2, dp=2)
        >>> layout(cfg, world=4, rank=3)
        Layout(pp=2, dp=2, m=2, rank=3, dp_rank=1, tp=1)
        >>> layout(dataclasses.replace(cfg, tp=2), world=8, rank=5)  # rank (d * pp + r) * tp + t
        Layout(pp=2, dp=2, m=2, rank=5, dp_rank=1, tp=2)
    """
    pp, dp, b, tp = cfg.pp, cfg.dp, cfg.micro_batch_size or 1, cfg.tp or 1
    _check_tp(cfg, world)
    pp, dp = world_split(world // tp, pp, dp)
    if world == 1 and dp != 1:
        raise TrainConfigError(
            f"--dp {dp} needs {dp} processes: launch with torchrun --nproc-per-node {dp * (pp or 1)} "
            "(one process runs one replica of the pipeline)"
        )
    if world > 1 and (not pp or not dp or pp * dp * tp != world):
        raise TrainConfigError(
            f"the job has {world} processes, which is not dp x pp x tp (dp {cfg.dp}, pp {cfg.pp}, tp {tp}): "
            f"give --dp and --pp whose product is {world // tp}, or one of them"
        )
    assert pp is not None and dp is not None  # internal invariant
    if cfg.zero not in (None, "none") and dp == 1:
        raise TrainConfigError(
            f"--zero {cfg.zero} shards the training state over data-parallel replicas, and this job has one "
            f"(dp 1, pp {pp}): run dp >= 2 replicas (torchrun --nproc-per-node {2 * pp} ... --dp 2), or drop --zero"
        )
    per_replica = b * dp
    if cfg.global_batch % per_replica:
        raise TrainConfigError(
            f"--global-batch {cfg.global_batch} does not divide into {dp} replicas of micro-batches of "
            f"{b}: use a multiple of dp x micro-batch-size = {per_replica}"
        )
    if world == 1:
        return Layout(pp=pp, dp=1, m=cfg.global_batch // per_replica, rank=0, dp_rank=0)
    # runtime.parallel.data_parallel's mesh: replicas are the outer dimension, tp the inner
    # (rank = (d * pp + r) * tp + t); the trainer's mesh has the last word.
    return Layout(pp=pp, dp=dp, m=cfg.global_batch // per_replica, rank=rank, dp_rank=rank // (pp * tp), tp=tp)


def check_tp_fits(cfg: TrainConfig, config: Any) -> None:
    """Refuse ``--tp`` the model's ``config.json`` cannot split, in one line, before any model is built.

    Raises:
        TrainConfigError: the family has no tensor-parallel plan, or a size it splits does not
            divide by ``--tp`` (the sizes named, with the ``--tp`` values that fit).
    """
    tp = cfg.tp or 1
    if tp == 1:
        return
    name = getattr(config, "model_type", "this model")
    unplanned = plan_problem(config)
    if unplanned is not None:
        said = f"{name} has no tensor-parallel plan" if "no tensor-parallel plan" in unplanned else unplanned
        raise TrainConfigError(f"--tp {tp}: {said}: drop --tp, or use --pp/--dp")
    problems = size_problems(config, tp)
    if not problems:
        return
    fits = [t for t in range(1, 65) if not size_problems(config, t)]
    raise TrainConfigError(f"--tp {tp} does not fit {name}'s config.json: {'; '.join(problems)}. Pick --tp from "
                           f"{', '.join(map(str, fits[:8]))}, or use --pp/--dp")


def _check_tp(cfg: TrainConfig, world: int) -> None:
    """Refuse ``--tp`` where the job cannot run it: too few processes, or an option tp does not compose with."""
    tp = cfg.tp or 1
    if tp == 1:
        return
    if world % tp:
        need = (cfg.dp or 1) * (cfg.pp or 2) * tp
        raise TrainConfigError(
            f"--tp {tp} splits each pipeline rank's stages over {tp} processes, and the job has {world}: launch "
            f"dp x pp x tp processes, e.g. torchrun --nproc-per-node {need} -m pipecut train ... --tp {tp}"
        )
    check_tp_options(cfg)


def train(
    cfg: TrainConfig, *, on_step: Callable[[Mapping[str, Any]], None] | None = None,
    on_start: Callable[[report.StartReport], None] | None = None,
) -> TrainResult:
    """Run (or resume) the training job ``cfg`` describes. Collective under torchrun.

    Args:
        cfg: the settings.
        on_step: called on every process after each step with its metrics line (the CLI draws
            the progress bar with it on rank 0).
        on_start: called on every process before the first step with the start-up block (the
            model, layout, schedule, batch, the plan's predictions, where the files go), which
            rank 0 also writes to ``OUT/train.log``.

    Returns:
        The steps run now, their metrics, and the final export's folder.

    Raises:
        TrainConfigError, DataError, FolderError, UnsupportedModelError: before any step.
        MissingDependencyError: ``cfg.tensorboard`` without the tensorboard package, before ``cfg.out`` is touched.
        PipecutError: anything planning or training refuses (see docs/reference/errors.md).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        ensure_process_group()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if cfg.layout == "manual" and cfg.plan is None:
        layout(cfg, world, rank)  # the flags' layout is refused before anything is read
    # The model folder is honoured or refused before --out is touched: a refused one leaves nothing there.
    folder, config, weights = _open_folder(cfg, warn=rank == 0)
    journal = report.Journal(cfg, leader=rank == 0)  # refuses --tensorboard without the package
    # The run folder is this run's from before it is read (a resume point, the metrics) until it ends.
    with runfolder.owned(Path(cfg.out), leader=rank == 0), journal:
        try:
            return _run(cfg, rank, world, on_step, folder, config, weights, journal=journal, on_start=on_start)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise runfolder.disk_full(Path(e.filename or cfg.out)) from e


def _open_folder(cfg: TrainConfig, *, warn: bool) -> tuple[HFFolder, Any, Path | None]:
    """The model folder, its config and the checkpoint to fine-tune from, or the typed refusal."""
    folder = HFFolder(cfg.model, trust_remote_code=cfg.trust_remote_code)
    config = folder.config
    folder.check_causal_lm(config, command="pipecut train")
    check_tp_fits(cfg, config)
    return folder, config, _weights(folder, cfg, warn=warn)


def _run(
    cfg: TrainConfig, rank: int, world: int, on_step: Callable[[Mapping[str, Any]], None] | None,
    folder: HFFolder, config: Any, weights: Path | None, *, journal: report.Journal,
    on_start: Callable[[report.StartReport], None] | None,
) -> TrainResult:
    """:func:`train`, once the process group is up, the model folder admitted and the run folder this run's."""
    leader = rank == 0
    out = Path(cfg.out)
    longest = max_positions(config)
    if longest is not None and cfg.seq_len > longest:
        raise TrainConfigError(f"--seq-len {cfg.seq_len} is longer than the model's {longest} positions")
    vocab = getattr(config, "vocab_size", None)
    data = open_tokens(cfg.data, dtype=cfg.data_dtype, tokenizer=folder.tokenizer)
    eval_data = _eval_data(cfg, data, folder)
    done = checkpoints.complete(out / "checkpoints")
    if done and done[-1][0] > cfg.steps:
        raise TrainConfigError(
            f"{out} holds a checkpoint at step {done[-1][0]}, past --steps {cfg.steps}: give --steps "
            f"{done[-1][0]} or more to continue that run, or another --out to start afresh"
        )
    # The layout: the flags', the planner's (--layout auto) or a saved plan's, with its keys filled in.
    choice = layout_choice.choose(cfg, folder, config, world=world, preset=_preset(cfg.device), out=out,
                                  loss_fn=lm_loss)
    cfg = choice.cfg
    lay = layout(cfg, world, rank)
    if leader:
        _warn_if_changed(out / "config.toml", cfg)

    plan, trainer = _build(cfg, lay, folder, config, weights, world, choice.plan)
    predicted = layout_choice.predicted_step(plan)
    if leader:
        described = layout_choice.describe(plan, dp=lay.dp, pp=lay.pp, m=lay.m, zero=cfg.zero, how=choice.how,
                                           tp=lay.tp)
        log.info("%s", described)
        runfolder.write_text_atomic(out / "config.toml", to_toml(cfg) + f"# {described}\n")
        plan.save(out / "plan.json")
    lay = dataclasses.replace(lay, dp_rank=trainer.mesh.dp_rank)  # the runtime's mesh decides
    ckpts = out / "checkpoints"
    start = checkpoints.latest(ckpts)
    if start is not None:
        trainer.load(start)
        log.info("resumed from %s (step %d)", start, trainer.step_count)
    result = TrainResult(resumed_from=trainer.step_count, plan=plan)
    metrics_file = out / "metrics.jsonl"
    if leader:
        metrics_log.cut_back(metrics_file, trainer.step_count)
    _started(cfg, plan, lay, world, trainer.step_count, journal, on_start)
    weights_ok = True
    while trainer.step_count < cfg.steps:
        line = _checked_step(trainer, data, cfg, lay, vocab, ckpts)
        if predicted is not None:
            line["predicted_step_s"] = predicted
        bad = finite.problem(line, skipped=bool(trainer.last_found_inf))
        if bad is not None and not cfg.allow_nonfinite_loss:
            if leader:  # the record of what happened; a resumed run drops it with the steps after its checkpoint
                metrics_log.append(metrics_file, line)
            raise finite.NonFiniteLossError(
                f"step {line['step']}: the {bad} at learning rate {line['lr']:g}: training diverged and stopped; "
                f"{finite.resume_hint(checkpoints.latest(ckpts))}"
            )
        if bad is not None:
            log.warning("step %d: the %s (--allow-nonfinite-loss: training on)", line["step"], bad)
        if cfg.eval_every and (trainer.step_count % cfg.eval_every == 0 or trainer.step_count == cfg.steps):
            line["eval_loss"] = evaluate(trainer, eval_data, cfg, lay, vocab)
        if leader:
            metrics_log.append(metrics_file, line)
        journal.step(line)
        result.metrics.append(line)
        if on_step is not None:
            on_step(line)
        n = trainer.step_count
        if (cfg.checkpoint_every and n % cfg.checkpoint_every == 0) or n == cfg.steps:
            weights_ok = _save_if_finite(trainer, cfg, ckpts, n, leader=leader)
    if weights_ok:
        result.final = export_final(trainer, folder, config, out / "final", leader=leader)
    else:
        log.warning("the weights after step %d are not finite: no export written to %s", trainer.step_count,
                    out / "final")
    if dist.is_initialized():
        dist.barrier()
    return result


def _build(
    cfg: TrainConfig, lay: Layout, folder: HFFolder, config: Any, weights: Path | None, world: int,
    plan: Plan | None = None,
) -> tuple[Plan, PipelineTrainer]:
    """The plan (the same on every process: ``plan`` when one was chosen, else the flags' cut) and this
    process's part of the pipeline."""
    if plan is None:
        # The Hugging Face model as it is: its own parameter names, so the folder's weights load and
        # export with their own keys (docs/train.md, *The model as it is*).
        module = folder.build(meta=True, config=config)
        plan = partition(
            module, folder.example_inputs(seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size or 1),
            cluster=Cluster.uniform(lay.pp, _preset(cfg.device), memory_reserve=cfg.memory_reserve),
            cut=Cut(microbatches=lay.m, schedule=cfg.schedule or "1f1b"),
            costing=Costing(precision=cfg.precision, recompute=RECOMPUTE_FLAGS[cfg.recompute]),
        )
    trainer = PipelineTrainer(
        plan, lm_loss, _adamw(cfg),
        execution=Execution(devices=_devices(plan) if world == 1 else None, check_finite=cfg.check_finite),
        init=Init(seed=cfg.seed, weights=Weights(weights, cast=True, allow_nonfinite=cfg.nonfinite_patterns)
                  if weights else None),
        data_parallel=_data_parallel(cfg, lay) if world > 1 else None,
        # The plan's cuts fall between the model's blocks (its default granularity), so no stage
        # parts a column layer from its row layer; a stage that did is refused, named.
        tensor_parallel=lay.tp,
    )
    return plan, trainer


def _started(
    cfg: TrainConfig, plan: Plan, lay: Layout, world: int, resumed_from: int, journal: report.Journal,
    on_start: Callable[[report.StartReport], None] | None,
) -> None:
    """The start-up block, to ``train.log`` and to ``on_start``."""
    params, trainable = report.count_parameters(plan.model)
    facts = report.RunFacts(model_class=type(plan.model).__name__, params=params, trainable=trainable, dp=lay.dp,
                            pp=lay.pp, world=world, resumed_from=resumed_from, tp=lay.tp)
    block = report.start_report(cfg, plan, facts)
    journal.start(block)
    if on_start is not None:
        on_start(block)


def _data_parallel(cfg: TrainConfig, lay: Layout) -> DataParallel:
    """The replicas and their sharding (``--zero``: ``zero1`` shards the optimizer state, ``fsdp`` is FSDP2)."""
    if cfg.zero == "fsdp":
        return DataParallel(size=lay.dp, engine="fsdp", reshard_after_forward=True)
    return DataParallel(size=lay.dp, shard_optimizer=cfg.zero == "zero1")


def _checked_step(
    trainer: PipelineTrainer, data: TokenData, cfg: TrainConfig, lay: Layout, vocab: int | None, ckpts: Path
) -> dict[str, Any]:
    """:func:`_step`, with ``--check-finite``'s refusal of a non-finite loss told with its step and
    where to resume."""
    try:
        return _step(trainer, data, cfg, lay, vocab)
    except LossError as e:
        if not cfg.check_finite:
            raise
        raise LossError(
            f"step {trainer.step_count + 1}: {e}; {finite.resume_hint(checkpoints.latest(ckpts))}"
        ) from e


def _save_if_finite(trainer: PipelineTrainer, cfg: TrainConfig, ckpts: Path, n: int, *, leader: bool) -> bool:
    """Write step ``n``'s checkpoint and rotate, only when the weights are finite; returns whether they are.

    Rotation runs only after a finite save, so it never removes the newest finite checkpoint."""
    device = trainer.devices[next(iter(trainer.devices))] if _nccl() else "cpu"
    if not finite.weights_finite(list(trainer.parameters()), device=device):
        newest = checkpoints.latest(ckpts)
        if not cfg.allow_nonfinite_loss:
            raise finite.NonFiniteLossError(
                f"step {n}: the weights are not finite (NaN or infinity) though its loss and gradient norm "
                f"were: training diverged and stopped; {finite.resume_hint(newest)}"
            )
        log.warning("step %d: the weights are not finite: checkpoint step-%d not written (--allow-nonfinite-loss); "
                    "the newest finite one is %s", n, n, newest)
        return False
    target = checkpoints.checkpoint_dir(ckpts, n)
    try:
        trainer.save(target)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if not runfolder.no_space(e):
            raise
        raise runfolder.disk_full(target, needed=_state_bytes(trainer)) from e
    if leader:
        gone = checkpoints.prune(ckpts, keep=cfg.keep)
        log.info("checkpoint step-%d written%s", n, f"; removed {', '.join(gone)}" if gone else "")
    return True


def _state_bytes(trainer: PipelineTrainer) -> int:
    """About what this process's share of a checkpoint takes: its weights and optimizer state."""
    tensors: list[torch.Tensor] = list(trainer.parameters())
    if trainer.optimizer is not None:
        tensors += [v for st in trainer.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _step(
    trainer: PipelineTrainer, data: TokenData, cfg: TrainConfig, lay: Layout, vocab: int | None
) -> dict[str, Any]:
    """Take the next optimizer step at its learning rate on its batch; return its metrics line."""
    k = trainer.step_count  # the step about to be taken, 0-based
    rate = lr_at(k, lr=cfg.lr, warmup=cfg.warmup, decay_end=cfg.decay_end, floor=cfg.lr_floor)
    if trainer.optimizer is not None:
        for group in trainer.optimizer.param_groups:
            group["lr"] = rate
    x, y = data.batch(seed=cfg.seed, step=k, rows=cfg.global_batch, seq_len=cfg.seq_len, replica=lay.dp_rank,
                      replicas=lay.dp, stream=TRAIN, vocab_size=vocab)
    trainer.step(x, y, max_norm=cfg.max_norm)
    m = trainer.last_metrics
    return {"step": trainer.step_count, "loss": m["loss"], "lr": rate, "grad_norm": m["grad_norm"],
            "tokens_per_s": m["tokens_per_s"], "step_time_s": m["step_time_s"]}


def evaluate(trainer: PipelineTrainer, data: TokenData, cfg: TrainConfig, lay: Layout, vocab: int | None) -> float:
    """The mean next-token loss on ``cfg.eval_batches`` fixed batches (the same at every evaluation)."""
    total = torch.zeros(2, dtype=torch.float64)
    for i in range(cfg.eval_batches):
        x, y = data.batch(seed=cfg.seed, step=i, rows=cfg.global_batch, seq_len=cfg.seq_len,
                          replica=lay.dp_rank, replicas=lay.dp, stream=EVAL, vocab_size=vocab)
        output = trainer.predict(x)
        if output is not None:  # under torchrun, only the last stage's rank has the output
            total += torch.tensor([float(lm_loss(output, y)) * len(x), len(x)], dtype=torch.float64)
    if dist.is_initialized():
        total = total.to(trainer.devices[next(iter(trainer.devices))] if _nccl() else "cpu")
        dist.all_reduce(total)
        total = total.cpu()
    return float(total[0] / total[1])


# -- helpers -------------------------------------------------------------------------------------


def _adamw(cfg: TrainConfig) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """AdamW with weight decay on matrices only (not on norms' scales and biases), as nanoGPT does."""

    def build(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        groups = [{"params": ps, "weight_decay": wd} for ps, wd in ((decay, cfg.weight_decay), (rest, 0.0)) if ps]
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=BETAS)

    return build


def _weights(folder: HFFolder, cfg: TrainConfig, *, warn: bool) -> Path | None:
    """The folder's checkpoint; without one, a warning (on one process) that the run starts from the model's init."""
    weights = folder.weights
    if weights is None and warn:
        log.warning(
            "%s holds no weights (model.safetensors, model.safetensors.index.json, pytorch_model.bin or "
            "pytorch_model.bin.index.json): training starts from the model's own random initialisation "
            "(--seed %d), not from pretrained weights", folder.path, cfg.seed,
        )
    return weights


def _eval_data(cfg: TrainConfig, data: TokenData, folder: HFFolder) -> TokenData:
    if cfg.eval_data is None:
        return data  # evaluation batches are their own stream of the training tokens
    return open_tokens(cfg.eval_data, dtype=cfg.data_dtype, tokenizer=folder.tokenizer)


def _preset(device: str) -> str:
    """The device preset the plan is costed for: the name given, or this machine's (``default_device``)."""
    return default_device() if device == "auto" else device


def _devices(plan: Plan) -> list[str] | None:
    """In one process on a machine with GPUs, the stages of pipeline rank ``r`` on ``cuda:r % n``."""
    if not torch.cuda.is_available():
        return None
    from runtime.transport.placement import placed_schedule

    sched = placed_schedule(plan.schedule, plan.num_stages, plan.microbatches, None)
    n = torch.cuda.device_count()
    return [f"cuda:{sched.stage_to_rank[s] % n}" for s in range(plan.num_stages)]


def _nccl() -> bool:
    return dist.is_initialized() and dist.get_backend() == "nccl"


# Settings a resumed run must share with the run that wrote the checkpoint to continue it exactly.
_SAME_ON_RESUME = ("model", "data", "seed", "seq_len", "global_batch", "data_dtype", "lr", "warmup", "min_lr",
                   "decay_steps", "weight_decay", "max_norm", "precision")


def _warn_if_changed(path: Path, cfg: TrainConfig) -> None:
    """Log a warning when a rerun changes a setting that decides what the resumed steps compute."""
    if not path.is_file():
        return
    try:
        before = resolve(read_toml(path), {})
    except PipecutError:
        return  # an unreadable old file is overwritten; the checkpoint still decides where to resume
    changed = [f"{k}: {getattr(before, k)!r} -> {getattr(cfg, k)!r}" for k in _SAME_ON_RESUME
               if getattr(before, k) != getattr(cfg, k)]
    if changed:
        log.warning("%s: this run changes %s; resumed steps will differ from the run being continued",
                    path.parent, "; ".join(changed))
