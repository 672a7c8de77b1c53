"""Assembly: the part of a pipeline one process holds, built from a plan and the trainer's options.

Legend: ``S`` stages, ``p`` ranks, ``s`` a stage, ``r`` a rank, ``m`` micro-batches, ``dp`` replicas.

A trainer's constructor is a recipe whose first steps are here. :func:`resolve_run` reads the
plan once and resolves the options against it into a frozen :class:`Run`: schedule,
micro-batches, precision, recomputation, transport, and where this process sits
(:class:`Placement`: which ranks run here, on which devices, in which replica of the job's
("dp", "pp") mesh). :func:`assemble` takes that run and makes this process's stage modules real
(split from the plan's graph, materialised from meta, weight-gradient accumulation fused), then
wraps them for the replicas (copies of shared weights tied, the gradient exchange or FSDP's
shards set up), in that order, and returns them as one :class:`Assembly`; the trainer connects
the transport and only runs it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from partitioner.plan.plan import Plan
from partitioner.plan.split import StageIO
from partitioner.schedule.ir import Schedule
from partitioner.schedule.registry import schedule_info
from partitioner.schedule.validation import validate
from partitioner.tracing.hops import unshare_bodies
from partitioner.tracing.trace import TracedModel, retarget_device
from runtime.execute.microbatch import microbatch_count
from runtime.execute.recompute import RecomputeOption, stages_to_recompute
from runtime.execute.records import StageRuntime, stage_runtimes
from runtime.options import TrainerOptions, apply_layout
from runtime.parallel.clipping import local_shard
from runtime.parallel.data_parallel import PipelineMesh, Replicas, job_mesh, one_process_mesh
from runtime.parallel.fsdp import FSDPReplicas, check_fsdp_plan
from runtime.parallel.tensor import TensorParallelLayout
from runtime.parallel.tensor_stages import refuse_unsupported, split_stages
from runtime.parallel.tied import TiedGroup, tie_copies
from runtime.precision import MixedPrecision, resolve_precision
from runtime.state.materialize import materialize_stages, refuse_released, release_whole_copies
from runtime.state.weights import stage_tensors
from runtime.transport.placement import check_backend, placed_schedule, stage_devices
from runtime.transport.process_group import comm_device, default_device, ensure_process_group, resolve_mode

log = logging.getLogger(__name__)

__all__ = ["Placement", "Run", "resolve_run", "Assembly", "assemble"]


@dataclass(frozen=True)
class Placement:
    """Where this process sits: its mesh, its pipeline rank, the ranks it runs, its stages' devices.

    Attributes:
        mesh: this process's place in the job (one replica in one process).
        rank: its pipeline rank under ``'dist'``; 0 in one process.
        ranks: the pipeline ranks this process runs (all of them in one process).
        devices: each stage this process holds -> its device.
    """

    mesh: PipelineMesh
    rank: int
    ranks: tuple[int, ...]
    devices: dict[int, torch.device]


@dataclass(frozen=True)
class Run:
    """A trainer's run, resolved once from its plan and options: what every later step of the
    constructor takes instead of the plan.

    Attributes:
        options: the option objects, every field resolved and the plan's layout applied.
        precision: the mixed-precision policy (the given one, else the plan's).
        num_stages: ``S``, the plan's stages.
        m: micro-batches per step.
        schedule: the schedule running the ``S`` stages on ``p`` ranks (validated).
        recompute: the stages that recompute their forward in the backward.
        mode: the resolved transport: ``'local'``, ``'sequential'`` or ``'dist'``.
        out_spec: the model's output structure (``Plan.output_treespec``).
        placement: this process's :class:`Placement`.
        model: the model the plan is bound to (its stages hold that model's tensors).
        traced: the plan's traced graph (``Plan.traced``).
    """

    options: TrainerOptions
    precision: MixedPrecision
    num_stages: int
    m: int
    schedule: Schedule
    recompute: frozenset[int]
    mode: str
    out_spec: Any
    placement: Placement
    model: torch.nn.Module
    traced: TracedModel


def resolve_run(
    plan: Plan, options: TrainerOptions, precision: str | MixedPrecision | None = None,
    recompute: RecomputeOption = None,
) -> Run:
    """Read ``plan`` once and resolve ``options`` against it: the first step of a trainer's
    constructor. Under ``'dist'`` it joins the process group (and, with replicas, builds the
    job's device mesh): collective.

    Raises:
        PrecisionError: an unknown precision name.
        MicrobatchError: ``Execution.microbatches`` is not an int >= 1.
        PlanMismatchError: the plan was loaded from a file and not bound to a model yet.
        PlacementError: ``S`` is not a multiple of the schedule's stages per rank, the job's
            world size is not ``dp * p * tp``, the backend cannot run the schedule's messages, stages
            of one rank are given different devices, or replicas are asked for in one process.
        UnknownScheduleError: the schedule's name is not registered.
        RecomputeOptionError: ``recompute`` names no stage of the plan, or is of another type.
        TransportOptionError: an unknown transport.
        TensorParallelOptionError: ``tp > 1`` with an option it does not compose with yet.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from partitioner import partition
        >>> from runtime.options import resolve_options
        >>> plan = partition(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), (torch.randn(2, 4),), 2)
        >>> run = resolve_run(plan, resolve_options(schedule="gpipe", microbatches=2, transport="sequential"))
        >>> run.schedule.name, run.m, run.mode, run.placement.ranks, run.precision.name
        ('gpipe', 2, 'sequential', (0, 1), 'fp32')
    """
    # The plan, read once, first: every later step gets these values, not the plan.
    ex = options.execution
    flags = []
    for st in plan.stages:
        flags.append(getattr(st, "recompute", False))
    num_stages, out_spec, io, model, traced = plan.num_stages, plan.output_treespec(), plan.io, plan.model, plan.traced
    layout, planned_m, planned_schedule = getattr(plan, "layout", None), plan.microbatches, plan.schedule
    mp = resolve_precision(precision, getattr(plan, "precision", "fp32"))
    m = microbatch_count(ex.microbatches, planned_m)  # at the door: 0 is not the plan's
    stages = stages_to_recompute(recompute, flags)
    mode = resolve_mode(ex.transport)
    schedule = placed_schedule(ex.schedule or planned_schedule, num_stages, m, ex.chunks_per_rank)
    validate(schedule)
    ranks = schedule.num_ranks
    options = apply_layout(options, layout, mode)
    # Where this process sits: under 'dist' (collective: joins the process group, builds the mesh)
    # one rank and its device; otherwise every rank, with a device per stage.
    devices, dp, tp = ex.devices, options.data_parallel, options.tensor_parallel.size
    refuse_unsupported(tp, engine=dp.engine if (dp.size or 1) > 1 else "replicate")
    if mode == "dist":
        ensure_process_group()
        check_backend(schedule, io)
        device = torch.device(devices) if isinstance(devices, (str, torch.device)) else default_device()
        mesh = job_mesh(schedule, num_stages, dp.size, dp.mesh, device.type, tp)
        own = dict.fromkeys(schedule.stages_of(mesh.pp_rank), device)
        placement = Placement(mesh, mesh.pp_rank, (mesh.pp_rank,), own)
    else:
        mesh = one_process_mesh(ranks, m, dp.size, dp.mesh, tp)
        placement = Placement(mesh, 0, tuple(range(ranks)), stage_devices(devices, num_stages, schedule))
    return Run(options, mp, num_stages, m, schedule, stages, mode, out_spec, placement, model, traced)


@dataclass(frozen=True)
class Assembly:
    """This process's part of the pipeline, ready to run.

    Attributes:
        placement: see :class:`Placement`.
        stages: this process's stages by index.
        ios: every stage's inputs and outputs (the whole plan's).
        tied: the copies of tied weights whose gradients are summed after each run.
        replicas: the gradient exchange between data-parallel replicas (and the optimizer's share):
            the home-made engine's ``Replicas`` or FSDP2's ``FSDPReplicas``.
        tensor_parallel: each stage's split over its tp group (empty when ``tp == 1``).
    """

    placement: Placement
    stages: dict[int, StageRuntime]
    ios: list[StageIO]
    tied: list[TiedGroup]
    replicas: Replicas | FSDPReplicas
    tensor_parallel: dict[int, TensorParallelLayout]


def assemble(plan: Plan, run: Run) -> Assembly:
    """Build this process's stages of ``plan`` where ``run`` places them, materialised, tied and
    replicated (``engine='fsdp'``: sharded by FSDP2, weights all-gathered in the precision's low
    dtype when it asks for that); with ``TensorParallel(size=tp)``, each stage split over its tp
    group once materialised.

    The plan is read here for its stages (the split) and told when its model's tensors changed
    (materialised, or released under FSDP); everything else comes resolved in ``run``.

    Raises:
        PlanMismatchError: the plan was loaded from a file and not bound to a model yet.
        PlacementError: a weight is tied between two stages of one rank under FSDP.
        MaterializeError: a stage of a meta model holds a tensor no module owns, or holds weights
            an earlier FSDP trainer took.
    """
    placement, schedule, init, dp = run.placement, run.schedule, run.options.init, run.options.data_parallel
    ex, devices, rank = run.options.execution, placement.devices, placement.rank
    fsdp = dp.engine == "fsdp" and placement.mesh.dp > 1  # one replica: nothing to shard
    # Build: split the plan's graph, make this process's stages real.
    staged, model, gm = plan.build_stages(), run.model, run.traced.gm
    ios = list(staged.io)
    if fsdp:  # before any weight is touched, on every rank alike
        check_fsdp_plan(staged.shared_params, schedule.stage_to_rank, schedule.name)
    mine: dict[int, torch.nn.Module] = {}
    for s in devices:
        mine[s] = staged.stages[s]
    will_load = set(stage_tensors(mine)[0]) if init.weights is not None else set()
    if init.weights is None:
        refuse_released(mine)
    if materialize_stages(model, mine, devices, init_fn=init.init_fn, seed=init.seed, rank=rank,
                          will_load=will_load):
        plan.refresh_binding()
    # Split over tp once real, before weight-gradient fusion, the replicas and the optimizer see the weights.
    layouts: dict[int, TensorParallelLayout] = {}
    if placement.mesh.tp > 1:
        before: list[torch.nn.Parameter] = []
        for module in mine.values():
            before += module.parameters()
            if isinstance(module, fx.GraphModule):
                unshare_bodies(module)  # the rewrite must not reach the traced graph's bodies
        tp = run.options.tensor_parallel
        vocab = tp.splits_vocab(getattr(model, "config", None))
        layouts = split_stages(mine, tp.patterns(), model, placement.mesh.tp_mesh, tied=staged.shared_params,
                               vocab_last=run.num_stages - 1 if vocab else None)
        # A split weight is a new tensor (the rank's shard); a whole one a DTensor over the same storage,
        # which stays. The planned model's tensors of the split ones go to meta, as FSDP's do.
        live = {local_shard(p).untyped_storage().data_ptr() for module in mine.values() for p in module.parameters()}
        released = release_whole_copies([model, gm], [p for p in before if p.untyped_storage().data_ptr() not in live])
        del before
        plan.refresh_binding()
        log.info("rank %d: tp split stages %s; %.1f MiB of whole weights released", rank, sorted(mine),
                 released / 2**20)
    stages = stage_runtimes(staged, devices, fuse_wgrad=ex.fuse_wgrad)
    # Wrap for the replicas: tie the copies of shared weights, then the gradient exchange.
    tied = tie_copies(staged.shared_params, mine, devices, schedule.stage_to_rank,
                      rank if run.mode == "dist" else None, comm_device,
                      replicas=placement.mesh.pipelines, replica=placement.mesh.pipeline, timeout=ex.timeout)
    for st in stages.values():
        st.module.to(st.device)
        # Export records the tracing device (cpu) in factory calls such as the position ids' arange.
        if isinstance(st.module, fx.GraphModule):
            unshare_bodies(st.module)  # shared with the traced graph, which stays as traced
            retarget_device(st.module, st.device)
    replicas: Replicas | FSDPReplicas
    if fsdp:
        mp = run.precision
        whole: list[torch.nn.Parameter] = []  # before FSDP copies them
        for st in stages.values():
            whole += st.module.parameters()
        replicas = FSDPReplicas(placement.mesh, mine, tied=tied, reshard_after_forward=dp.reshard_after_forward,
                                gather_dtype=mp.dtype if mp.gather_low_precision else None,
                                split_backward=schedule_info(schedule.name).split_backward)
        tied = replicas.tied
        # The shards are the weights now: the whole tensors the planned model still holds go to meta.
        released = release_whole_copies([model, gm], whole)
        del whole
        plan.refresh_binding()
        log.info("rank %d: FSDP sharded stages %s; %.1f MiB of whole weights released", rank,
                 sorted(stages), released / 2**20)
    else:
        params: dict[int, list[torch.nn.Parameter]] = {}
        for s, st in stages.items():
            params[s] = list(st.module.parameters())
        copied: set[int] = set()
        for copies, _ in tied:
            copied.update(map(id, copies))
        replicas = Replicas(
            placement.mesh, params, copied, shard=dp.shard_optimizer,
            overlap=dp.overlap_grad_reduce, bucket_bytes=dp.grad_bucket_bytes, comm_device=comm_device,
            timeout=ex.timeout,
        )
    return Assembly(placement, stages, ios, tied, replicas, layouts)
