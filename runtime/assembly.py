"""Assembly: the part of a pipeline one process holds, built from a plan and the trainer's options.

Legend: ``S`` stages, ``p`` ranks, ``s`` a stage, ``r`` a rank, ``m`` micro-batches, ``dp`` replicas.

A trainer's constructor places the plan's stages (which ranks run here, on which devices, in
which replica of the job's ("dp", "pp") mesh), makes this process's stage modules real
(materialised from meta, weight-gradient accumulation fused), ties copies of shared weights and
sets up the gradient exchange between replicas. :func:`assemble` does all of that in that order
and returns it as one :class:`Assembly`; the trainer only runs it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from partitioner.plan.plan import Plan
from partitioner.plan.split import StagedModel, StageIO
from partitioner.schedule.ir import Schedule
from partitioner.schedule.registry import schedule_info
from partitioner.tracing.hops import unshare_bodies
from partitioner.tracing.trace import retarget_device
from runtime.execute.executor import StageRuntime
from runtime.execute.wgrad_fusion import fuse_weight_grad_accumulation
from runtime.options import DataParallel, Execution, Init
from runtime.parallel.data_parallel import PipelineMesh, Replicas, job_mesh, one_process_mesh
from runtime.parallel.fsdp import FSDPReplicas, check_fsdp_plan
from runtime.parallel.tied import TiedGroup, tie_copies
from runtime.state.materialize import MaterializeError, materialize_stages, release_whole_copies, released_names
from runtime.state.weights import stage_tensors
from runtime.transport.placement import check_backend, stage_devices
from runtime.transport.process_group import comm_device, default_device, ensure_process_group

log = logging.getLogger(__name__)

__all__ = ["Assembly", "Placement", "assemble", "place"]


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
class Assembly:
    """This process's part of the pipeline, ready to run.

    Attributes:
        placement: see :class:`Placement`.
        stages: this process's stages by index.
        ios: every stage's inputs and outputs (the whole plan's).
        tied: the copies of tied weights whose gradients are summed after each run.
        replicas: the gradient exchange between data-parallel replicas (and the optimizer's share):
            the home-made engine's ``Replicas`` or FSDP2's ``FSDPReplicas``.
    """

    placement: Placement
    stages: dict[int, StageRuntime]
    ios: list[StageIO]
    tied: list[TiedGroup]
    replicas: Replicas | FSDPReplicas


def place(
    schedule: Schedule, mode: str, m: int, ios: Sequence[StageIO], execution: Execution, dp: DataParallel
) -> Placement:
    """This process's placement: under ``'dist'`` (collective: joins the process group, builds the
    mesh) one rank and its device; otherwise every rank, with a device per stage.

    Raises:
        PlacementError: the job's world size is not ``dp * p``, the backend cannot run the
            schedule's messages, stages of one rank are given different devices, or replicas
            are asked for in one process.
    """
    num_stages = len(schedule.stage_to_rank)
    if mode == "dist":
        ensure_process_group()
        check_backend(schedule, ios)
        devices = execution.devices
        device = torch.device(devices) if isinstance(devices, (str, torch.device)) else default_device()
        mesh = job_mesh(schedule, num_stages, dp.size, dp.mesh, device.type)
        own = schedule.stages_of(mesh.pp_rank)
        return Placement(mesh, mesh.pp_rank, (mesh.pp_rank,), dict.fromkeys(own, device))
    mesh = one_process_mesh(schedule.num_ranks, m, dp.size, dp.mesh)
    return Placement(mesh, 0, tuple(range(schedule.num_ranks)),
                     stage_devices(execution.devices, num_stages, schedule))


def assemble(
    plan: Plan, schedule: Schedule, mode: str, m: int, execution: Execution, init: Init, dp: DataParallel,
    *, gather_dtype: torch.dtype | None = None,
) -> Assembly:
    """Build this process's stages of ``plan`` as ``schedule`` places them (``mode``: the
    resolved transport, ``m``: micro-batches per step), materialised, tied and replicated
    (``dp.engine='fsdp'``: sharded by FSDP2, weights all-gathered in ``gather_dtype`` if given).

    Raises:
        PlacementError: see :func:`place`.
        MaterializeError: a stage of a meta model holds a tensor no module owns.
    """
    staged = plan.build_stages()
    ios = list(staged.io)
    placement = place(schedule, mode, m, ios, execution, dp)
    fsdp = dp.engine == "fsdp" and placement.mesh.dp > 1  # one replica: nothing to shard
    if fsdp:  # before any weight is touched, on every rank alike
        check_fsdp_plan(staged.shared_params, schedule.stage_to_rank, schedule.name)
    mine = {s: staged.stages[s] for s in placement.devices}
    will_load = set(stage_tensors(mine)[0]) if init.weights is not None else set()
    if init.weights is None:
        _refuse_released(mine)
    if materialize_stages(plan.model, mine, placement.devices, init_fn=init.init_fn, seed=init.seed,
                          rank=placement.rank, will_load=will_load):
        plan.refresh_binding()
    stages = _stage_runtimes(staged, placement.devices, ios, fuse_wgrad=execution.fuse_wgrad)
    tied = tie_copies(staged.shared_params, {s: st.module for s, st in stages.items()}, placement.devices,
                      schedule.stage_to_rank, placement.rank if mode == "dist" else None, comm_device,
                      replicas=placement.mesh.ranks, replica=placement.mesh.dp_rank, timeout=execution.timeout)
    for st in stages.values():
        st.module.to(st.device)
        # Export records the tracing device (cpu) in factory calls such as the position ids' arange.
        if isinstance(st.module, fx.GraphModule):
            unshare_bodies(st.module)  # shared with the traced graph, which stays as traced
            retarget_device(st.module, st.device)
    replicas: Replicas | FSDPReplicas
    if fsdp:
        whole = [p for st in stages.values() for p in st.module.parameters()]  # before FSDP copies them
        replicas = FSDPReplicas(placement.mesh, {s: st.module for s, st in stages.items()}, tied=tied,
                                reshard_after_forward=dp.reshard_after_forward, gather_dtype=gather_dtype,
                                split_backward=schedule_info(schedule.name).split_backward)
        tied = replicas.tied
        # The shards are the weights now: the whole tensors the planned model still holds go to meta.
        released = release_whole_copies([plan.model, plan.traced.gm], whole)
        del whole
        plan.refresh_binding()
        log.info("rank %d: FSDP sharded stages %s; %.1f MiB of whole weights released", placement.rank,
                 sorted(stages), released / 2**20)
    else:
        replicas = Replicas(
            placement.mesh, {s: list(st.module.parameters()) for s, st in stages.items()},
            {id(prm) for copies, _ in tied for prm in copies}, shard=dp.shard_optimizer,
            overlap=dp.overlap_grad_reduce, bucket_bytes=dp.grad_bucket_bytes, comm_device=comm_device,
            timeout=execution.timeout,
        )
    return Assembly(placement, stages, ios, tied, replicas)


def _refuse_released(stages: Mapping[int, torch.nn.Module]) -> None:
    """Raise if a stage holds weights an FSDP trainer took (:func:`release_whole_copies`): made
    again here, they would silently start from fresh values, not from that trainer's."""
    for s, module in sorted(stages.items()):
        names = released_names(module)
        if names:
            raise MaterializeError(
                f"stage {s}'s weights {names[:3]} were handed to an earlier trainer with engine='fsdp', which "
                "keeps only its shards (the model holds meta tensors in their place). Save that trainer's "
                "weights (trainer.save(...) or trainer.export_safetensors(...)) and build this one with "
                "Init(weights=...), or partition a freshly built model"
            )


def _stage_runtimes(
    staged: StagedModel, devices: dict[int, torch.device], ios: Sequence[StageIO], *, fuse_wgrad: bool
) -> dict[int, StageRuntime]:
    """This process's stages (those ``devices`` names), weight-gradient accumulation fused unless
    told not to."""
    # Parameters several stages hold (tied weights): another thread may write their .grad.
    tied = [prm for st in staged.stages for name, prm in st.named_parameters(remove_duplicate=False)
            if name in staged.shared_params]
    out = {}
    for s in devices:
        module = staged.stages[s]
        if fuse_wgrad:
            fuse_weight_grad_accumulation(module, skip=tied)  # in place: a fresh stage module
        out[s] = StageRuntime(s, module, ios[s], devices[s])
    return out
