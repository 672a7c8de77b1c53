"""Assembly: the part of a pipeline one process holds, built from a plan and its resolved run.

Legend: ``S`` stages, ``p`` ranks, ``s`` a stage, ``r`` a rank, ``m`` micro-batches, ``dp`` replicas.

The second and third steps of a trainer's constructor, after :func:`runtime.options.resolve_run`
has placed the plan's stages (which ranks run here, on which devices, in which replica of the
job's ("dp", "pp") mesh): :func:`assemble` makes this process's stage modules real (split from
the plan's graph, materialised from meta, weight-gradient accumulation fused), then wraps them
for the replicas (copies of shared weights tied, the gradient exchange or FSDP's shards set up),
in that order, and returns them as one :class:`Assembly`; the trainer only runs it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.fx as fx

from partitioner.plan.plan import Plan
from partitioner.plan.split import StageIO
from partitioner.schedule.registry import schedule_info
from partitioner.tracing.hops import unshare_bodies
from partitioner.tracing.trace import retarget_device
from runtime.execute.records import StageRuntime, stage_runtimes
from runtime.options import Placement, Run
from runtime.parallel.data_parallel import Replicas
from runtime.parallel.fsdp import FSDPReplicas, check_fsdp_plan
from runtime.parallel.tied import TiedGroup, tie_copies
from runtime.state.materialize import materialize_stages, refuse_released, release_whole_copies
from runtime.state.weights import stage_tensors
from runtime.transport.process_group import comm_device

log = logging.getLogger(__name__)

__all__ = ["Assembly", "Placement", "assemble"]


@dataclass(frozen=True)
class Assembly:
    """This process's part of the pipeline, ready to run.

    Attributes:
        placement: see :class:`~runtime.options.Placement`.
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


def assemble(plan: Plan, run: Run) -> Assembly:
    """Build this process's stages of ``plan`` where ``run`` places them, materialised, tied and
    replicated (``engine='fsdp'``: sharded by FSDP2, weights all-gathered in the precision's low
    dtype when it asks for that).

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
    stages = stage_runtimes(staged, devices, fuse_wgrad=ex.fuse_wgrad)
    # Wrap for the replicas: tie the copies of shared weights, then the gradient exchange.
    tied = tie_copies(staged.shared_params, mine, devices, schedule.stage_to_rank,
                      rank if run.mode == "dist" else None, comm_device,
                      replicas=placement.mesh.ranks, replica=placement.mesh.dp_rank, timeout=ex.timeout)
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
    return Assembly(placement, stages, ios, tied, replicas)
