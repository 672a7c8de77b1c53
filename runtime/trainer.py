"""PipelineTrainer: train a Plan as a micro-batched pipeline, in one process or one process per rank.

Legend: ``S`` stages (the plan's model chunks), ``p`` ranks, ``v`` stages per rank (``S = p * v``;
2 for interleaved and ZB-V, 1 otherwise), ``m`` micro-batches, ``s`` a stage index, ``mb`` a
micro-batch index.

The same script runs both ways::

    python train.py                                   # all ranks here, one thread each
    torchrun --standalone --nproc-per-node 4 train.py # one process per rank (gloo on CPU, NCCL on GPU)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partitioner.plan.plan import Plan
from partitioner.schedule.generators import forward_only
from partitioner.schedule.ir import Schedule
from partitioner.schedule.timeline import Timeline, from_records, save_chrome_trace
from runtime.assembly import assemble, resolve_run
from runtime.errors import TrainerStateError
from runtime.execute.accumulation import add_back, set_aside
from runtime.execute.executor import ActionRecord, Executor, RunResult
from runtime.execute.inputs import as_flat, check_inputs, check_sizes, check_targets, is_example_size, shape_key
from runtime.execute.local_run import RankThreads, run_interleaved, run_threads
from runtime.execute.microbatch import MicrobatchError, split_microbatches
from runtime.execute.recompute import RecomputeOption
from runtime.execute.shapes import wire_shapes
from runtime.execute.wiring import merge_microbatches, model_output
from runtime.metrics import step_metrics
from runtime.options import DataParallel, Execution, Init, TensorParallel, resolve_options
from runtime.parallel.clipping import clip_grad_norm_
from runtime.parallel.fsdp import FSDPReplicas, check_optimizer
from runtime.parallel.tied import copy_tied_values, second_copies, sum_tied_grads
from runtime.precision import (
    CallerAutocast,
    CallPrecision,
    LossScaler,
    MixedPrecision,
    PrecisionError,
    wire_dtypes,
)
from runtime.state import checkpoint
from runtime.state.weights import LoadReport, Weights, load_weights, stage_tensors
from runtime.transport.agreement import StepAgreement
from runtime.transport.collective import run_bounded
from runtime.transport.p2p import DistTransport, LocalTransport, PeerFailed, Transport
from runtime.transport.process_group import comm_device as _comm_device

__all__ = ["PipelineTrainer", "MicrobatchError", "split_microbatches"]

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


class PipelineTrainer:
    """Trains the stages of a plan with a pipeline schedule and exact gradients.

    Args:
        plan: a bound plan (from ``partition``, or ``Plan.load(...).bind(model, inputs)``).
        loss_fn: ``loss_fn(output, target) -> scalar`` with mean reduction over the batch;
            ``output`` is what the model returns, rebuilt from the last stage's tensors with the
            plan's output structure: a tensor, a tuple, a dict, or a Hugging Face
            ``ModelOutput`` (``output.logits``; ``lambda out, _: out.loss`` when ``labels`` is
            an input).
        optimizer: called with this process's parameters; ``None`` to only compute gradients.
        lr_scheduler: called with the optimizer, e.g. ``lambda opt: LambdaLR(opt, warmup)``;
            stepped after every optimizer step (``None`` on a rank without parameters).
        precision: ``'fp32'``, ``'bf16'``, ``'fp16'`` or a ``runtime.precision.MixedPrecision``
            (default: the plan's). Parameters, gradients and optimizer state stay fp32; each
            stage's forward and the loss run under ``torch.autocast`` in the low dtype, and
            floating values cross stages in it (``MixedPrecision(cast_activations=False)``
            keeps the plan's dtype on the wire). fp16 scales the loss (:attr:`scaler`):
            gradients are unscaled in :meth:`forward_backward`, and :meth:`step` skips the
            optimizer when any rank found inf/NaN (``last_found_inf``). See docs/reference/precision.md.
        recompute: activation recomputation (``runtime.execute.recompute``): a recomputing stage's
            forward keeps only its inputs and its backward runs the forward again first, so it
            holds its input bytes per micro-batch in flight instead of its saved activations,
            for one more forward per backward. ``None`` (default): the stages the plan chose
            (``StagePlan.recompute``, set by ``partition(..., recompute='auto')`` where memory
            binds); ``True`` / ``False``: every stage / none; or a collection of stage indices.
            Dropout replays the same random numbers; gradients are unchanged.
        execution: a :class:`~runtime.options.Execution`: the schedule (default: the plan's),
            micro-batches, transport (``'auto'``, ``'local'``, ``'sequential'``, ``'dist'``),
            devices, timeout, recording, weight-gradient fusion, loss checks.
        init: an :class:`~runtime.options.Init`: initialisation of a meta model (``init_fn``,
            ``seed``) and a checkpoint to load (``weights``, see :meth:`load_weights`).
        data_parallel: a :class:`~runtime.options.DataParallel`: ``dp`` replicas of the pipeline
            under torch.distributed (world size ``dp * p``), each training on its share of the
            global batch (:meth:`local_batch`), gradients averaged before every step; or an int,
            short for ``DataParallel(size=n)``.
        tensor_parallel: a :class:`~runtime.options.TensorParallel` or its size: stages split over ``tp`` processes.
        **shortcuts: the keywords this trainer took before the option objects (``schedule=``,
            ``microbatches=``, ``weights=``...), kept for one release: each sets its object's
            field (``runtime.options.SHORTCUTS``). Not together with that object.

    The options it runs with, every field resolved, are :attr:`options` (a
    ``runtime.options.TrainerOptions``).

    Raises:
        PlacementError: ``S`` is not a multiple of the schedule's stages per rank, the job's
            world size is not ``dp * p``, stages of one rank are given different devices, or
            ``dp > 1`` in one process.
        OptionKeywordError: a keyword that is neither a parameter nor a shortcut.
        TrainerOptionError: a shortcut given beside the object that holds its field.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from partitioner import partition
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> plan = partition(model, (torch.randn(2, 8),), 2, microbatches=4)
        >>> trainer = PipelineTrainer(plan, nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1),
        ...                           execution=Execution(schedule="1f1b", microbatches=2))
        >>> loss = trainer.step(torch.randn(8, 8), torch.randn(8, 4))
        >>> loss.shape, trainer.m
        (torch.Size([]), 2)
    """

    def __init__(
        self,
        plan: Plan,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        optimizer: OptimizerFactory | None = None,
        *,
        lr_scheduler: SchedulerFactory | None = None,
        precision: str | MixedPrecision | None = None,
        recompute: RecomputeOption = None,
        execution: Execution | None = None,
        init: Init | None = None,
        data_parallel: DataParallel | int | None = None,
        tensor_parallel: TensorParallel | int | None = None,
        **shortcuts: Any,
    ) -> None:
        # The recipe, one step a room, each from what the step before gave: resolve the run from
        # the plan and options (schedule, placement, micro-batches, precision) -> build this
        # process's stages and wrap them for the replicas -> connect the transport -> ready.
        self._init_run_state()
        opts = resolve_options(execution, init, data_parallel, tensor_parallel, **shortcuts)
        run = resolve_run(plan, opts, precision, recompute)
        built = assemble(plan, run)
        ex, mp = run.options.execution, run.precision
        if mp.gather_low_precision and not isinstance(built.replicas, FSDPReplicas):
            raise PrecisionError(
                f"precision={mp!r} gathers weights in {mp.name}, which only FSDP does: pass "
                "data_parallel=DataParallel(size=dp, engine='fsdp') with dp >= 2 under torchrun, or drop "
                "gather_low_precision (autocast alone keeps the plain model's numerics)"
            )
        self._dist_transport = (
            DistTransport(run.schedule.stage_to_rank, ex.timeout, built.placement.mesh.pp_group)
            if run.mode == "dist" else None
        )
        # Under 'dist', every rank checks once per new batch shape that the others run the same step.
        self._agreement = StepAgreement(plan, mp, ex.timeout) if run.mode == "dist" else None
        self.options, self.plan, self.loss_fn, self.precision = run.options, plan, loss_fn, mp
        self.p, self.m, self.schedule, self.mode = run.num_stages, run.m, run.schedule, run.mode  # p: S, the stages
        self.schedule_name = run.schedule.name
        self.timeout, self.record, self.check_finite = ex.timeout, ex.record, ex.check_finite
        self.recompute, self._out_spec = run.recompute, run.out_spec  # what the model returns: loss_fn gets it
        self.mesh, self.rank, self.devices = built.placement.mesh, built.placement.rank, built.placement.devices
        self._ranks, self.stages, self._ios = list(built.placement.ranks), built.stages, built.ios
        self._tied, self._replicas = built.tied, built.replicas
        self._trains = optimizer is not None
        # A stage may hold no parameters (only reshapes, say): it has nothing to update. Sharded:
        # the optimizer steps this replica's share.
        self.optimizer = optimizer(built.replicas.owned) if optimizer is not None and built.replicas.owned else None
        if self.optimizer is not None and isinstance(built.replicas, FSDPReplicas):
            check_optimizer(self.optimizer, built.replicas.owned)  # FSDP: the shards, not the model's tensors
        self.scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None and self.optimizer else None
        device_types = set(map(operator.attrgetter("type"), self.devices.values()))  # map: no frame (test_layout)
        self.scaler = LossScaler(mp.init_scale, growth_interval=mp.growth_interval) if mp.scales_loss else None
        self._autocast = CallerAutocast(mp, device_types, functools.partial(
            wire_dtypes, ios=built.ios, gm=run.traced.gm, inputs=run.traced.example_inputs,
            device_type=next(iter(self.devices.values())).type))
        if self.options.init.weights is not None:
            self.load_weights(self.options.init.weights)

    def _init_run_state(self) -> None:
        """What the steps leave behind, as before the first."""
        self.step_count = 0  # optimizer steps taken (saved and restored by checkpoints)
        self.last_found_inf = False  # fp16: whether the last forward_backward's gradients had inf/NaN
        self.last_grad_norm: torch.Tensor | None = None
        # The last step's metrics (runtime.metrics.step_metrics): loss, lr, tokens/s, bubble...
        self.last_metrics: dict[str, float | int | None] = {}
        self.last_peak_inflight: dict[int, int] = {}
        self.last_records: list[ActionRecord] = []
        self._example_sized = False
        self._busy: list[float] = []
        self._run_seconds = 0.0
        self._shape_cache: dict[tuple[tuple[int, ...], ...], dict[str, tuple[int, ...]]] = {}
        self._threads: RankThreads | None = None  # transport='local': started at the first step

    # -- public API -----------------------------------------------------------------------

    def step(self, inputs: Any, targets: Any = None, *, max_norm: float | None = None) -> torch.Tensor:
        """One optimizer step over ``m`` micro-batches; returns the batch's mean loss.

        ``inputs`` is the whole batch: a tensor, a tuple of the model's inputs in order (the
        positional ones, then the keyword ones in the order ``partition`` got them), or a dict
        by input name, as a tokenizer gives it (``{'input_ids': ids, 'attention_mask': mask}``).
        Every tensor is cut into ``m`` micro-batches along dimension 0, and so are the
        ``targets`` (a tensor, tuple or dict; ``None`` when ``loss_fn`` reads the output alone,
        e.g. ``out.loss`` of a model given ``labels``).

        With ``max_norm``, gradients are clipped to that total norm over all stages first
        (:meth:`clip_grad_norm_`); the norm is kept as ``last_grad_norm``. The step's metrics
        (loss, learning rate, norm, wall time, samples and tokens per second over all replicas,
        measured bubble) are left in ``last_metrics``, a dict for any logger, and drawn by
        ``runtime.metrics.TrainingProgress``.

        Raises:
            InputError: the inputs do not match the plan (their number, a dtype, a size the
                graph cannot run, or the targets' rows); raised before any stage runs.
            MicrobatchError: the batch does not split into ``m`` equal micro-batches.
            StageError: a stage's forward, backward or loss raised (rank, stage, action,
                micro-batch and model node in the message; the original as ``__cause__``).
            LossError: ``loss_fn`` returned something other than a scalar tensor that requires
                grad, or (``check_finite``) a non-finite loss.
            TransportTimeout: a peer sent nothing in time; its subclass ``PeerFailed`` when a
                peer failed first (its message quotes that rank's error).
            TrainerStateError: the trainer was built without an optimizer.
        """
        if not self._trains:
            raise TrainerStateError("this trainer has no optimizer: pass optimizer=lambda params: ... to step")
        self._autocast.resolve("step()")  # a refusal before zero_grad clears anything
        start = time.perf_counter()
        self.zero_grad()
        loss = self.forward_backward(inputs, targets)
        if max_norm is not None:
            self.last_grad_norm = self.clip_grad_norm_(max_norm)
        if self.optimizer is not None and not self.last_found_inf:
            self.optimizer.step()
        self._replicas.after_step()
        if self.scaler is not None:
            self.scaler.update(self.last_found_inf)
        if self.scheduler is not None:
            self.scheduler.step()
        self.step_count += 1
        self.last_metrics = step_metrics(
            step=self.step_count, loss=loss, seconds=time.perf_counter() - start, busy=self._busy,
            pipeline_seconds=self._run_seconds,
            inputs=as_flat(self.plan.input_names, inputs), replicas=self.mesh.dp,
            optimizer=self.optimizer, grad_norm=self.last_grad_norm if max_norm is not None else None,
        )
        return loss

    def forward_backward(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """Accumulate the gradients of the whole batch's loss (no optimizer step); return the loss.

        ``inputs`` and ``targets`` as in :meth:`step`. Under fp16 the gradients it adds are
        unscaled before it returns; ``last_found_inf`` says whether any rank's had an inf or NaN."""
        call = self._autocast.resolve("forward_backward()")
        ins = self._micro_inputs(inputs)
        check_targets(self.plan.traced, as_flat(self.plan.input_names, inputs), targets)
        tgts = split_microbatches(targets, self.m, "targets")
        averager = self._replicas.averager
        # Gradients of earlier calls were summed, averaged and unscaled already: only this call's
        # are, and the earlier ones are added back (runtime.execute.accumulation).
        aside = set_aside(list(self.parameters()))
        try:
            results = self._run(self.schedule, ins, tgts, call, train=True,
                                on_stage_done=averager.stage_done if averager is not None else None)
            sum_tied_grads(self._tied, _comm_device, timeout=self.timeout)
            if averager is not None:
                averager.finish(self.mesh.pp_group)  # every replica (sharded: each owner) holds the averages
        finally:
            if averager is not None:
                averager.reset()
        if self.scaler is not None:
            self.last_found_inf = self.scaler.unscale_(self.parameters(), distributed=self.mode == "dist",
                                                       comm_device=_comm_device, group=self._replicas.norm_group,
                                                       timeout=self.timeout, tp_group=self.mesh.tp_group)
        add_back(aside)
        loss = torch.zeros((), dtype=torch.float32)
        for res in results:
            for v in res.losses.values():
                loss = loss + v.detach().to("cpu", torch.float32)
        if self.mode == "dist":
            loss = loss.to(_comm_device())
            last = self.mesh.global_rank(self.schedule.stage_to_rank[self.p - 1])
            run_bounded(dist.broadcast, loss, src=last, group=self.mesh.pp_group, timeout=self.timeout,
                        what=f"the broadcast of the loss from rank {last}")
            if self.mesh.dp > 1:  # each replica's loss is its share's mean: average them
                run_bounded(dist.all_reduce, loss, group=self.mesh.dp_group, timeout=self.timeout,
                            what="the average of the replicas' losses")
                loss = loss / self.mesh.dp
            loss = loss.cpu()
        return loss

    def local_batch(self, *batch: Any) -> Any:
        """This replica's share of a global batch: every tensor's rows cut into ``dp`` equal
        parts, part ``dp_rank`` kept (the batch itself when ``dp == 1``). Each replica may also
        load its own share; the step is the same when the shares together are the global batch.

        Example: ``trainer.step(*trainer.local_batch(x, y))``.
        """
        parts = [split_microbatches(b, self.mesh.dp, "the global batch")[self.mesh.dp_rank] for b in batch]
        return parts[0] if len(parts) == 1 else tuple(parts)

    def predict(self, inputs: Any) -> Any:
        """Pipelined forward-only inference; returns the model's output for the whole batch
        (``inputs`` as in :meth:`step`), in the model's own structure (a ``ModelOutput``...):
        batched tensors concatenated over the micro-batches, a 0-dim floating one (a model's
        ``loss`` given ``labels``) their mean, anything else the first micro-batch's.

        Under ``'dist'`` only the rank holding the last stage returns the output; others return
        ``None``.
        """
        call = self._autocast.resolve("predict()")
        ins = self._micro_inputs(inputs)
        fwd = forward_only(self.schedule.num_ranks, self.m, stage_to_rank=self.schedule.stage_to_rank)
        with torch.no_grad():
            results = self._run(fwd, ins, None, call, train=False)
        outs: dict[int, tuple[Any, ...]] = {}
        for res in results:
            outs.update(res.outputs)
        if not outs:
            return None
        cols = list(zip(*(outs[mb] for mb in range(self.m))))
        return model_output(tuple(merge_microbatches(c) for c in cols), self._out_spec)

    def zero_grad(self) -> None:
        """Clear the gradients of this process's parameters."""
        for prm in self.parameters():
            prm.grad = None

    def parameters(self) -> Iterator[nn.Parameter]:
        """This process's parameters, each once (a tied parameter shared in-process once)."""
        for _, prm in self.named_parameters():
            yield prm

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This process's parameters with the original model's names, each once."""
        seen: set[int] = set()
        for s in sorted(self.stages):
            for name, prm in self.stages[s].module.named_parameters():
                if id(prm) not in seen:
                    seen.add(id(prm))
                    yield name, prm

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This process's stages' state, keyed by the original model's names."""
        out: dict[str, torch.Tensor] = {}
        for s in sorted(self.stages):
            out.update(self.stages[s].module.state_dict())
        return out

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients to a total norm, as ``torch.nn.utils.clip_grad_norm_`` on the
        unpartitioned model: the norm is taken over every stage (reduced over the ranks under
        torch.distributed), a tied parameter counted once. Returns the total norm.

        Call it between :meth:`forward_backward` and the optimizer, or use
        ``step(..., max_norm=...)``. Collective under torch.distributed.
        """
        params = [prm for st in self.stages.values() for prm in st.module.parameters()]
        unique = list({id(prm): prm for prm in params}.values())
        counted = {id(prm) for prm in self._replicas.owned} - second_copies(
            self._tied, self.plan.shared_params, {s: st.module for s, st in self.stages.items()}
        )
        return clip_grad_norm_(unique, max_norm, norm_type, counted=counted, distributed=self.mode == "dist",
                               comm_device=_comm_device, group=self._replicas.norm_group,
                               tp_group=self.mesh.tp_group, timeout=self.timeout)

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Save a checkpoint: model, optimizer and scheduler state, step and RNG states.

        A torch.distributed.checkpoint directory keyed by the original model's names, so it
        loads under any plan, schedule or world size, and into the plain model
        (``runtime.state.checkpoint.load_model``). Written beside ``directory`` and renamed into place
        when every rank is done: a crash midway never leaves something that loads as a whole
        checkpoint, and the next save to ``directory`` removes what it left. Every entry is a
        tensor (no pickle). Collective under torch.distributed. See ``runtime.state.checkpoint``.
        """
        return checkpoint.save(self, directory)

    def load(self, directory: str | os.PathLike[str], *, optimizer: bool = True) -> None:
        """Resume from a checkpoint written by :meth:`save`, under this or any other plan.

        With the same plan and world size, training continues bitwise as if never stopped
        (weights, optimizer and scheduler state, step, RNG states). ``optimizer=False`` reads
        the weights and step only. Collective under torch.distributed.

        A transaction: everything is checked against the checkpoint's metadata and read into
        staging first, so a load that raises leaves the trainer exactly as it was (on every
        rank). Staging holds a second copy of this rank's weights for the length of the load
        (and of its optimizer state, if it has stepped). See ``runtime.state.staging``.

        Raises:
            CheckpointError: not a checkpoint, it lacks an entry this trainer needs, or DCP failed.
            CheckpointShapeError: a tensor's shape differs from the checkpoint's (named, with both
                shapes: another model, or another run's ``--out``); also a ``ValueError``.
            CheckpointDtypeError: a tensor's dtype differs from the checkpoint's.
            UnsafeFileError: a file would import a class or function (no code of it runs).
            CorruptFileError: a file is missing, truncated or damaged (named, with the entry).
        """
        checkpoint.load(self, directory, optimizer=optimizer)

    def export_safetensors(self, directory: str | os.PathLike[str], *, prefix: str = "") -> Path:
        """Write the weights as a Hugging Face safetensors folder (a shard per rank and an index);
        ``prefix`` is removed from the names (``'model.'`` under ``CausalLMLogits``). Collective."""
        return checkpoint.export_safetensors(self, directory, prefix=prefix)

    def load_weights(self, weights: str | os.PathLike[str] | Weights) -> LoadReport:
        """Copy this process's stages' tensors from a checkpoint, reading only those.

        ``weights`` is a path (a ``.safetensors`` file, a sharded Hugging Face directory or its
        ``model.safetensors.index.json``, a ``torch.save`` file, or a torch.distributed.checkpoint
        directory) or a :class:`~runtime.state.weights.Weights` with options (name prefix, ``cast``,
        ``strict``, ``allow_nonfinite``). Names are the original model's; a tied weight may be stored
        under any of its names; a Hugging Face model's checkpoint is read through transformers' own
        conversion mapping, as ``from_pretrained`` reads it (legacy names, experts stored one by
        one). Every name, shape and dtype is checked before any data is copied, and every value
        is checked finite as it is copied. A split (tp) or FSDP weight: each rank reads its shard only.

        Raises:
            WeightsError: a missing or unexpected key, a shape or dtype mismatch (typed
                subclasses name the key, the stage and the fix); see ``runtime.state.weights``.
            UnsafeFileError: a torch.distributed.checkpoint's ``.metadata`` would import a class
                or function (no code of it runs).
        """
        spec = weights if isinstance(weights, Weights) else Weights(weights)
        into, stage_of = stage_tensors({s: st.module for s, st in self.stages.items()})
        report = load_weights(
            spec.source, into, names=list(self.plan.model.state_dict(keep_vars=True)),
            aliases=self.plan.param_aliases, stage_of=stage_of, prefix=spec.prefix, cast=spec.cast,
            strict=spec.strict, model=self.plan.model, allow_nonfinite=spec.allow_nonfinite,
        )
        self.sync_tied_copies()
        return report

    def sync_tied_copies(self) -> None:
        """In one process, give copies of a tied weight on other devices the first copy's values
        and optimizer state (after loading weights or a checkpoint into the first)."""
        copy_tied_values(self._tied, self.optimizer)

    def timeline(self) -> Timeline:
        """The last run as measured in this process: a :class:`~partitioner.schedule.timeline.Timeline`.

        Built by :func:`~partitioner.schedule.timeline.from_records` from ``last_records`` (``perf_counter``
        times, shifted to start at 0; messages between ranks inferred from the hand-overs), so
        ``bubble``, ``peak_inflight``, ``memory`` and traces read it as they read a simulated
        one. Activation bytes per stage are the plan's when the micro-batches had the plan's
        example size (else the memory metrics count micro-batches). Under ``'dist'`` it holds
        this rank's actions only; :meth:`save_trace` gathers every rank's.

        Raises:
            TrainerStateError: the trainer was built without ``record=True``, or nothing ran yet (a
                ``RuntimeError``).

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from partitioner import partition
            >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
            >>> plan = partition(model, (torch.randn(2, 8),), 4, microbatches=4)
            >>> trainer = PipelineTrainer(plan, nn.functional.mse_loss, schedule="zbv", record=True)
            >>> _ = trainer.forward_backward(torch.randn(8, 8), torch.randn(8, 8))
            >>> t = trainer.timeline()
            >>> t.num_ranks, len(t.spans), t.peak_inflight   # 4 stages x 4 mb x (F, I, W) on 2 ranks
            (2, 48, (4, 4))
        """
        return self._timeline(self.last_records)

    def save_trace(self, path: str | Path) -> Path | None:
        """Write the last run as Chrome trace JSON (open in https://ui.perfetto.dev).

        The same format as simulated timelines (``partitioner.schedule.timeline.save_chrome_trace``): a
        track per rank, an event per action named like ``1F3``, flow arrows for the messages
        between ranks, activation counters. Needs ``record=True``.

        Under ``'dist'`` it is collective: every rank calls it; rank 0 gathers the ranks' records
        (``dist.gather_object``, a few bytes per action), writes ``path`` and returns it, the
        others return ``None``. Each rank's ``perf_counter`` times are mapped to wall-clock time
        first, so ranks line up exactly on one host and to the clocks' synchronisation across
        hosts.

        Raises:
            TrainerStateError: the trainer was built without ``record=True``, or nothing ran yet (a
                ``RuntimeError``).
        """
        name = f"pipecut {self.schedule.name} (measured)"
        if self.mode != "dist":
            return save_chrome_trace(self.timeline(), path, name=name)
        self._check_recorded(self.last_records)
        offset = time.time() - time.perf_counter()
        mine = [dataclasses.replace(x, start=x.start + offset, end=x.end + offset) for x in self.last_records]
        gathered: list[Any] | None = [None] * self.schedule.num_ranks if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=self.mesh.global_rank(0), group=self.mesh.pp_group)
        if gathered is None or self.mesh.dp_rank != 0:  # one replica's pipeline is written
            return None
        return save_chrome_trace(self._timeline([x for part in gathered for x in part]), path, name=name)

    # -- internals ------------------------------------------------------------------------

    def _check_recorded(self, records: Sequence[ActionRecord]) -> None:
        if not self.record:
            raise TrainerStateError(
                "this trainer does not record its actions: build it with "
                "PipelineTrainer(..., record=True) to get timelines and traces"
            )
        if not records:
            raise TrainerStateError("nothing was recorded yet: run step(), forward_backward() or predict() first")

    def _timeline(self, records: Sequence[ActionRecord]) -> Timeline:
        self._check_recorded(records)
        act_bytes = None
        if self._example_sized:
            # A recomputing stage holds only its inputs between F and its backward.
            act_bytes = [float(getattr(st, "in_bytes" if s in self.recompute else "act_bytes", 0.0))
                         for s, st in enumerate(self.plan.stages)]
            act_bytes = act_bytes if len(act_bytes) == self.p and any(act_bytes) else None
        timeline = from_records(records, act_bytes)
        return dataclasses.replace(timeline, num_ranks=self.schedule.num_ranks)

    def _micro_inputs(self, inputs: Any) -> list[dict[str, Any]]:
        """The batch cut into micro-batches, checked against the plan first (``runtime.execute.inputs``)."""
        names = self.plan.input_names
        flat = as_flat(names, inputs)
        check_inputs(self.plan.traced, flat)
        per_input = [split_microbatches(x, self.m, f"input {n!r}") for n, x in zip(names, flat)]
        micro = [{n: chunks[mb] for n, chunks in zip(names, per_input)} for mb in range(self.m)]
        check_sizes(self.plan.traced, micro[0], self._shape_cache)
        return micro

    def _wire_shapes(self, mb_inputs: Mapping[str, Any]) -> dict[str, tuple[int, ...]] | None:
        """Wire shapes for this micro-batch size, or None when it is the plan's example size."""
        traced = self.plan.traced
        if is_example_size(traced, mb_inputs):
            return None
        key = shape_key(mb_inputs)
        if key not in self._shape_cache:
            self._shape_cache[key] = wire_shapes(traced.gm, mb_inputs, method=traced.method)
        return self._shape_cache[key]

    def _executors(self, transport: Transport, call: CallPrecision) -> dict[int, Executor]:
        out = {}
        for r in self._ranks:
            mine = {s: self.stages[s] for s in self.schedule.stages_of(r) if s in self.stages}
            out[r] = Executor(mine, self._ios, transport, self.loss_fn, rank=r, record=self.record,
                              check_finite=self.check_finite, precision=call.policy,
                              loss_scale=self.scaler.scale if self.scaler is not None else 1.0,
                              wire_dtypes=call.wire, recompute=self.recompute, out_spec=self._out_spec)
        return out

    def _run(
        self, schedule: Schedule, ins: list[dict[str, Any]], tgts: list[Any] | None, call: CallPrecision, *,
        train: bool,
        on_stage_done: Callable[[int], None] | None = None,
    ) -> list[RunResult]:
        started = time.perf_counter()
        if self.mode == "dist":
            assert self._dist_transport is not None and self._agreement is not None
            self._agreement.check(schedule, ins, call.policy)  # RankDisagreementError on every rank, before any message
            ex = self._executors(self._dist_transport, call)[self.rank]
            shapes = self._wire_shapes(ins[0])
            mb_shapes = dict.fromkeys(range(len(ins)), shapes) if shapes is not None else None
            try:
                results = [ex.run(schedule.actions[self.rank], ins, tgts, train=train, mb_shapes=mb_shapes,
                                  on_stage_done=on_stage_done)]
            except Exception as e:
                # Tell the peers why they will stop hearing from this rank (the first report wins).
                if not isinstance(e, PeerFailed):
                    self._dist_transport.announce(e)
                raise
        else:
            transport = LocalTransport(self.devices, self.timeout)
            exs = self._executors(transport, call)
            try:
                if self.mode == "sequential":
                    results = run_interleaved(exs, schedule, transport, ins, tgts, train)
                else:
                    if self._threads is None or self._threads.ranks != tuple(exs):
                        self._threads = RankThreads(list(exs))
                    results = run_threads(self._threads, exs, schedule, transport, ins, tgts, train)
            finally:
                transport.close()
        self.last_peak_inflight = {s: n for res in results for s, n in res.peak_inflight.items()}
        self._busy = [res.busy for res in results]
        self._run_seconds = time.perf_counter() - started
        self.last_records = sorted((r for res in results for r in res.records), key=lambda r: r.start)
        self._example_sized = is_example_size(self.plan.traced, ins[0]) if ins else False
        return results
