"""Data parallelism over pipeline replicas: the ("dp", "pp") mesh and gradient averaging.

Legend: ``dp`` replicas of the pipeline, ``pp`` ranks per pipeline, ``d`` a replica, ``r`` a
rank within a pipeline, ``s`` a stage.

A job of ``dp * pp`` processes runs ``dp`` copies of one pipeline. Rank ``r`` of every replica
holds the same stages; each replica trains on its own share of the global batch, and before the
optimizer step the replicas average their gradients with an all-reduce over the ranks that hold
the same stages (the "dp" groups), so every replica takes the same step, the one the whole batch
gives. This is synchronous data parallelism (DDP's, Megatron-LM's and torchtitan's): no
parameter server and no stale gradients, so a step equals the unpartitioned model's on the
global batch.

:class:`GradAverager` overlaps that all-reduce with the pipeline: the executor reports when a
stage's last backward action has run on this rank, and the stage's gradients leave then, in
buckets, while the pipeline drains the other stages; :meth:`GradAverager.finish` waits for them.

Example (4 processes)::

    torchrun --nproc-per-node 4 train.py    # a 2-stage plan: 2 pipelines of 2 ranks
    trainer = PipelineTrainer(plan, loss_fn, opt, data_parallel=2)
    trainer.step(*trainer.local_batch(x, y))  # this replica's rows of the global batch
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partitioner.cost.exchange import DEFAULT_BUCKET_BYTES
from runtime.parallel.clipping import local_shard
from runtime.transport.collective import run_bounded, wait_bounded
from runtime.transport.placement import PlacementError

__all__ = [
    "PipelineMesh", "pipeline_mesh", "job_mesh", "one_process_mesh", "GradAverager", "Replicas", "DEFAULT_BUCKET_BYTES",
]

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class PipelineMesh:
    """Where this process sits in a ``dp x pp`` job.

    Attributes:
        dp: replicas of the pipeline.
        pp: ranks per pipeline.
        dp_rank: this process's replica, ``d``.
        pp_rank: this process's rank within its pipeline, ``r`` (which stages it runs).
        ranks: ``ranks[d][r]``, the global rank of every position.
        pp_group: the process group of this replica's pipeline (``None``: the world).
        dp_group: the group of the ranks holding this process's stages (``None`` when ``dp == 1``).
        device_mesh: the ``DeviceMesh`` with dimensions ``("dp", "pp")`` (``("dp", "pp", "tp")``
            with tensor parallelism), when one was built or given.
        tp: tensor-parallel ranks per stage (``runtime.parallel.tensor``); ``ranks`` and the groups
            above are then those of this process's tp rank: rank ``t`` of a stage talks to rank
            ``t`` of the others and of the other replicas.
        tp_rank: this process's rank in its tp group, ``t``.
        tp_mesh: the 1-D ``DeviceMesh`` of this process's tp group (``None`` when ``tp == 1``).
    """

    dp: int
    pp: int
    dp_rank: int
    pp_rank: int
    ranks: tuple[tuple[int, ...], ...]
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    device_mesh: Any = None
    tp: int = 1
    tp_rank: int = 0
    tp_mesh: Any = None

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The process group of this process's tp group (``None`` when ``tp == 1``)."""
        return None if self.tp_mesh is None else self.tp_mesh.get_group()

    @property
    def pipelines(self) -> tuple[tuple[int, ...], ...]:
        """Every pipeline of the job, ``d * tp + t`` in order: the global ranks of tp rank ``t`` of
        each stage of replica ``d`` (``ranks`` when ``tp == 1``). Process groups every process must
        create alike, one per pipeline (a tied weight's), are made over these."""
        return tuple(tuple(g - self.tp_rank + t for g in row) for row in self.ranks for t in range(self.tp))

    @property
    def pipeline(self) -> int:
        """This process's index in :attr:`pipelines`."""
        return self.dp_rank * self.tp + self.tp_rank

    def global_rank(self, pp_rank: int) -> int:
        """The global rank of position ``pp_rank`` in this process's pipeline."""
        return self.ranks[self.dp_rank][pp_rank]


def pipeline_mesh(
    pp: int, data_parallel: int | None = None, mesh: Any = None, device_type: str = "cpu", tensor_parallel: int = 1,
) -> PipelineMesh:
    """This process's place in a job of ``dp`` pipelines of ``pp`` ranks (collective), each rank
    ``tensor_parallel`` processes wide.

    Args:
        pp: ranks one pipeline needs (the schedule's).
        data_parallel: ``dp``; default 1 (or the mesh's).
        mesh: a ``torch.distributed.device_mesh.DeviceMesh`` with dimensions named ``"dp"`` and
            ``"pp"`` (in either order), or a 1-D one named ``"pp"``; default: one is built with
            ``init_device_mesh(device_type, (dp, pp), mesh_dim_names=("dp", "pp"))``, so a
            pipeline's ranks are consecutive. With ``dp == 1`` and no mesh, the world is the
            pipeline and no group is created.
        device_type: the mesh's device type (``'cuda'`` on NCCL).
        tensor_parallel: ``tp``; with ``tp > 1`` the mesh is ``(dp, pp, tp)`` named
            ``("dp", "pp", "tp")``, tp innermost (a stage's tp ranks consecutive, inside a node):
            world rank ``(d * pp + r) * tp + t``.

    Raises:
        PlacementError: the world size is not ``dp * pp * tp``, or the mesh's dimensions do not fit.
    """
    world, tp = dist.get_world_size(), tensor_parallel
    if mesh is not None:
        if tp > 1:
            raise PlacementError(
                f"DataParallel(mesh=...) with TensorParallel(size={tp}): a given mesh is ('dp', 'pp') only; pass "
                f"DataParallel(size=dp) instead and the trainer builds the ('dp', 'pp', 'tp') mesh")
        return _from_device_mesh(mesh, pp, data_parallel, world)
    dp = 1 if data_parallel is None else data_parallel
    if type(dp) is not int or dp < 1:
        raise PlacementError(f"data_parallel must be an int >= 1, got {dp!r}")
    if dp * pp * tp != world:
        wide = f" x {tp} tp" if tp > 1 else ""
        hint = (f", or pass data_parallel={world // (pp * tp)} for that many pipeline replicas"
                if world % (pp * tp) == 0 else "")
        raise PlacementError(
            f"{dp} pipeline replica(s) of {pp} ranks{wide} need {dp * pp * tp} processes, but the job has {world}; "
            f"launch with --nproc-per-node {dp * pp * tp}{hint}"
        )
    me = dist.get_rank()
    t = me % tp
    ranks = tuple(tuple((d * pp + r) * tp + t for r in range(pp)) for d in range(dp))
    if dp == 1 and tp == 1:
        return PipelineMesh(1, pp, 0, me, ranks)
    from torch.distributed.device_mesh import init_device_mesh

    if tp > 1:
        cube = init_device_mesh(device_type, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
        at = me // tp
        return PipelineMesh(dp, pp, at // pp, at % pp, ranks, cube["pp"].get_group(),
                            cube["dp"].get_group() if dp > 1 else None, cube, tp=tp, tp_rank=t, tp_mesh=cube["tp"])

    device_mesh = init_device_mesh(device_type, (dp, pp), mesh_dim_names=("dp", "pp"))
    return PipelineMesh(dp, pp, me // pp, me % pp, ranks, device_mesh["pp"].get_group(),
                        device_mesh["dp"].get_group(), device_mesh)


def job_mesh(
    schedule: Any, num_stages: int, data_parallel: int | None, mesh: Any, device_type: str, tensor_parallel: int = 1,
) -> PipelineMesh:
    """:func:`pipeline_mesh` for a trainer: the world must be ``dp * tp`` times the ranks ``schedule``
    runs the plan's ``num_stages`` stages on (collective).

    Raises:
        PlacementError: it is not; the message gives the launch command that fits.
    """
    world, ranks, tp = dist.get_world_size(), schedule.num_ranks, tensor_parallel
    dp = data_parallel or 1
    if mesh is None and world != dp * ranks * tp:
        v, wide = num_stages // ranks, ranks * tp
        hint = f", pass data_parallel={world // wide} to run that many replicas," if world % wide == 0 else ""
        tps = f" x {tp} tp" if tp > 1 else ""
        raise PlacementError(
            f"schedule {schedule.name!r} runs the plan's {num_stages} stages on {ranks} ranks ({v} per "
            f"rank){tps} x {dp} replica(s), but the job has {world} processes; launch with --nproc-per-node "
            f"{wide * dp}{hint} or partition into {world // tp * v} stages for {world // tp} ranks"
        )
    return pipeline_mesh(ranks, data_parallel, mesh, device_type, tp)


def one_process_mesh(
    ranks: int, m: int, data_parallel: int | None, mesh: Any, tensor_parallel: int = 1
) -> PipelineMesh:
    """The mesh of a pipeline run in one process: one replica.

    Raises:
        PlacementError: replicas were asked for; one process gives the same step with ``dp * m``
            micro-batches, which the message says. Or tensor parallelism: it needs a process per rank.
    """
    if tensor_parallel > 1:
        raise PlacementError(
            f"TensorParallel(size={tensor_parallel}) needs one process per rank under torch.distributed "
            f"(torchrun --nproc-per-node {ranks * tensor_parallel}, transport 'dist'); in one process, drop it")
    dp = data_parallel or 1
    if dp > 1 or mesh is not None:
        raise PlacementError(
            f"data_parallel={data_parallel} needs one process per rank (torchrun --nproc-per-node "
            f"{dp * ranks}); in one process, replicas would give the gradients of {dp} x the "
            f"micro-batches: use microbatches={m * dp} for the same step"
        )
    return PipelineMesh(1, ranks, 0, 0, (tuple(range(ranks)),))


def _from_device_mesh(mesh: Any, pp: int, data_parallel: int | None, world: int) -> PipelineMesh:
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.mesh.numel() != world or "pp" not in names or not set(names) <= {"dp", "pp"}:
        raise PlacementError(
            f"the DeviceMesh must span the job's {world} ranks with dimensions named 'dp' and 'pp' "
            f"(or 'pp' alone); got dimensions {names or '(unnamed)'} of shape {tuple(mesh.mesh.shape)}. "
            "Build it with init_device_mesh(device, (dp, pp), mesh_dim_names=('dp', 'pp'))"
        )
    grid = mesh.mesh if names[0] == "dp" or len(names) == 1 else mesh.mesh.t()
    grid = grid.reshape(-1, grid.shape[-1])
    dp, size = grid.shape
    if size != pp or (data_parallel is not None and data_parallel != dp):
        raise PlacementError(
            f"the mesh has {dp} x {size} ('dp' x 'pp') ranks, but the schedule runs the plan on {pp} ranks"
            + (f" and data_parallel={data_parallel}" if data_parallel is not None else "")
            + f"; build a mesh of shape ({world // pp if world % pp == 0 else '?'}, {pp})"
        )
    ranks = tuple(tuple(int(x) for x in row) for row in grid.tolist())
    me = dist.get_rank()
    d, r = next((d, r) for d, row in enumerate(ranks) for r, g in enumerate(row) if g == me)
    pp_group = mesh["pp"].get_group() if len(names) == 2 else mesh.get_group()
    dp_group = mesh["dp"].get_group() if len(names) == 2 and dp > 1 else None
    return PipelineMesh(dp, pp, d, r, ranks, pp_group, dp_group, mesh)


class GradAverager:
    """Averages this process's gradients over its data-parallel group, a stage at a time.

    Call :meth:`stage_done` when a stage's last backward action of the step has run (with only
    this step's gradients in ``.grad``: ``runtime.execute.accumulation`` sets earlier ones aside): the
    gradients of parameters no other unfinished stage of this process still adds into leave then
    (``overlap=True``), packed into flat buckets of about ``bucket_bytes``, in asynchronous
    collectives. :meth:`finish` sends what is left (and the ``deferred`` parameters, whose
    gradients are complete only then: tied weights summed over the pipeline first), waits, and
    writes the averages back. Every rank of the group must report the same stages in the same
    order (ranks holding the same stages run the same action list, so they do).

    With ``owners`` (ZeRO-1/2, ``runtime.parallel.zero``), each parameter's gradient is reduced to its
    owner only: the owner keeps the average, the other ranks drop theirs (``.grad = None``).

    Args:
        stage_params: this process's parameters per stage (a parameter several stages share
            leaves when the last of them is done). Frozen ones (``requires_grad=False``) are skipped.
        group: the data-parallel process group.
        size: its number of ranks (the divisor).
        comm_device: where the buckets are reduced (the rank's GPU on NCCL, else the CPU).
        bucket_bytes: the target bucket size.
        overlap: start each stage's reduction when it is done; ``False`` waits for :meth:`finish`
            and for the whole pipeline (the all-reduce after the step, for comparison).
        deferred: ids of parameters reduced in :meth:`finish` only.
        owners: parameter id -> the index in the group of the rank that keeps its gradient.
        group_ranks: the global rank of each index in the group.
        index: this process's index in the group (with ``owners``).
        timeout: seconds a bucket's exchange may take; a failed replica raises ``PeerFailed``
            (quoting the first failing rank's error), a late one ``TransportTimeout``.

    Example:
        >>> w = nn.Parameter(torch.ones(3)); w.grad = torch.full((3,), 4.0)
        >>> avg = GradAverager({0: [w]}, group=None, size=1)  # one replica: nothing to exchange
        >>> avg.stage_done(0); avg.finish(); w.grad.tolist()
        [4.0, 4.0, 4.0]
    """

    def __init__(
        self,
        stage_params: Mapping[int, Sequence[nn.Parameter]],
        group: dist.ProcessGroup | None,
        size: int,
        *,
        comm_device: Callable[[], torch.device] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap: bool = True,
        deferred: Collection[int] = (),
        owners: Mapping[int, int] | None = None,
        group_ranks: Sequence[int] = (),
        index: int = 0,
        timeout: float = 300.0,
    ) -> None:
        self.group = group
        self.timeout = timeout
        self.size = size
        self.bucket_bytes = bucket_bytes
        self.overlap = overlap
        self.owners = dict(owners) if owners is not None else None
        self.group_ranks = tuple(group_ranks)
        self.index = index
        self._deferred = set(deferred)
        self._comm_device = comm_device or (lambda: torch.device("cpu"))
        self._stage_params: dict[int, list[nn.Parameter]] = {}
        holders: dict[int, int] = {}
        for s, params in sorted(stage_params.items()):
            mine = list({id(p): p for p in params if p.requires_grad}.values())
            self._stage_params[s] = mine
            for p in mine:
                holders[id(p)] = holders.get(id(p), 0) + 1
        self._all = list({id(p): p for ps in self._stage_params.values() for p in ps}.values())
        self._holders = holders
        self._left: dict[int, int] = {}
        self._sent: list[tuple[list[nn.Parameter], torch.Tensor, Any, int | None]] = []
        self._pending: list[nn.Parameter] = []  # without overlap: ready, sent at finish()
        self.reset()

    def reset(self) -> None:
        """Forget a step that did not finish (before the next one starts)."""
        self._left = dict(self._holders)
        self._sent = []
        self._pending = []

    def stage_done(self, s: int) -> None:
        """Stage ``s`` will add no more gradient this step: send what only it was still adding to."""
        ready = []
        for p in self._stage_params.get(s, []):
            self._left[id(p)] -= 1
            if self._left[id(p)] == 0 and id(p) not in self._deferred:
                ready.append(p)
        if self.overlap:
            self._send(ready)
        else:
            self._pending += ready

    def finish(self, pipeline: dist.ProcessGroup | None = None) -> None:
        """Send what is left, wait for every bucket, write the averages into ``.grad``.

        Without overlap, the exchange starts when the whole pipeline has finished (a barrier over
        the ``pipeline`` group first, when given): the all-reduce after the step, that overlap
        is measured against. With overlap, a rank's stages leave as soon as they are done, while
        the ranks behind it still drain.
        """
        if not self.overlap and self.size > 1 and dist.is_initialized():
            run_bounded(dist.barrier, group=pipeline, timeout=self.timeout,
                        what="the barrier of the pipeline's ranks before the data-parallel exchange")
        sent = {id(p) for bucket, _, _, _ in self._sent for p in bucket} | {id(p) for p in self._pending}
        left = [p for p in self._all if id(p) not in sent]
        self._send(self._pending + left)
        for params, flat, work, owner in self._sent:
            if work is not None:
                self._wait(work)
            keep = owner is None or owner == self.index
            if keep:
                flat.div_(self.size)
            offset = 0
            for p in params:
                assert p.grad is not None
                g = local_shard(p.grad)  # a tp shard (DTensor) is averaged as its local part
                n = g.numel()
                if keep:
                    g.copy_(flat[offset:offset + n].view_as(g))
                else:
                    p.grad = None  # its owner holds the average; this rank will not step it
                offset += n
        self.reset()

    def _wait(self, work: Any) -> None:
        """Wait for one bucket, at most ``timeout`` s; a failed or late replica raises, naming it."""
        wait_bounded(work, timeout=self.timeout, peers="a rank of another replica",
                     what=f"the data-parallel exchange of gradients with ranks {list(self.group_ranks)}")

    def _send(self, params: Sequence[nn.Parameter]) -> None:
        # Backward produces the last layers' gradients first: send in that order. A bucket holds
        # one dtype, one device and (with owners) one owner's parameters.
        buckets: dict[tuple[Any, ...], tuple[list[nn.Parameter], int]] = {}
        for p in reversed(params):
            if p.grad is None:  # no gradient on this replica (so on none): average zeros
                p.grad = torch.zeros_like(p)
            owner = self.owners[id(p)] if self.owners is not None else None
            key = (owner, p.grad.dtype, p.grad.device)
            bucket, nbytes = buckets.get(key, ([], 0))
            size = local_shard(p.grad).numel() * p.grad.element_size()
            if bucket and nbytes + size > self.bucket_bytes:
                self._reduce(bucket, owner)
                bucket, nbytes = [], 0
            buckets[key] = ([*bucket, p], nbytes + size)
        for (owner, _, _), (bucket, _) in buckets.items():
            if bucket:
                self._reduce(bucket, owner)

    def _reduce(self, bucket: list[nn.Parameter], owner: int | None) -> None:
        flat = torch.cat([local_shard(p.grad).reshape(-1) for p in bucket if p.grad is not None])
        flat = flat.to(self._comm_device())
        work = None
        if self.size > 1 and owner is None:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        elif self.size > 1:
            assert owner is not None
            work = dist.reduce(flat, dst=self.group_ranks[owner], group=self.group, async_op=True)
        self._sent.append((bucket, flat, work, owner))


class Replicas:
    """The trainer's side of data parallelism: which parameters this process's optimizer steps,
    the gradient exchange around a step, and, with ``shard``, the owners' broadcast after it.

    Args:
        mesh: this process's place in the job.
        stage_params: this process's parameters per stage.
        tied: ids of parameters whose gradients are summed over the pipeline after the run
            (tied weights): they are exchanged after that sum.
        shard: ZeRO-style sharding (``runtime.parallel.zero``): each parameter is stepped by one owner.
        overlap, bucket_bytes, comm_device, timeout: as for :class:`GradAverager`.
    """

    def __init__(
        self,
        mesh: PipelineMesh,
        stage_params: Mapping[int, Sequence[nn.Parameter]],
        tied: Collection[int] = (),
        *,
        shard: bool = False,
        overlap: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        comm_device: Callable[[], torch.device] | None = None,
        timeout: float = 300.0,
    ) -> None:
        from runtime.parallel.zero import assign_owners

        self.mesh = mesh
        self.shard = shard and mesh.dp > 1
        self._comm_device = comm_device
        self._bucket_bytes = bucket_bytes
        self._timeout = timeout
        self.params = list({id(p): p for ps in stage_params.values() for p in ps}.values())
        owners = assign_owners([p.numel() for p in self.params], mesh.dp) if self.shard else None
        self.owners = {id(p): d for p, d in zip(self.params, owners)} if owners is not None else None
        self.group_ranks = tuple(mesh.ranks[d][mesh.pp_rank] for d in range(mesh.dp))
        self.averager = GradAverager(
            stage_params, mesh.dp_group, mesh.dp, comm_device=comm_device, bucket_bytes=bucket_bytes,
            overlap=overlap, deferred=tied, owners=self.owners, group_ranks=self.group_ranks, index=mesh.dp_rank,
            timeout=timeout,
        ) if mesh.dp > 1 else None

    @property
    def owned(self) -> list[nn.Parameter]:
        """The parameters this process's optimizer steps (all of them unless sharded)."""
        if self.owners is None:
            return self.params
        return [p for p in self.params if self.owners[id(p)] == self.mesh.dp_rank]

    @property
    def norm_group(self) -> dist.ProcessGroup | None:
        """The ranks a gradient norm is summed over: one pipeline, or (sharded) the whole job."""
        return None if self.shard else self.mesh.pp_group

    def after_step(self) -> None:
        """Sharded: every replica takes the owners' new values."""
        if not self.shard or self.owners is None:
            return
        from runtime.parallel.zero import broadcast_from_owners

        trainable = [p for p in self.params if p.requires_grad]
        broadcast_from_owners(trainable, [self.owners[id(p)] for p in trainable], self.mesh.dp_group,
                              self.group_ranks, comm_device=self._comm_device, bucket_bytes=self._bucket_bytes,
                              timeout=self._timeout)
