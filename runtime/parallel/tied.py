"""Tied parameters held by several stages: one tensor per rank and device, equal copies across.

Legend: ``s`` a stage index. A tied parameter (GPT-2's input and output embedding) is read by
every stage that holds one of its names. The stages of one rank on one device share the tensor
(one thread runs them in a fixed order). Across ranks each has its own copy: in one process
too, since a tensor cannot live on two devices, and two rank threads adding into one ``.grad``
would add in thread order, so the sums would differ in the last bits from run to run. Either way the copies start equal,
their gradients are summed before every optimizer step (:func:`sum_tied_grads`), and so they stay
equal.

Under tensor parallelism each stage runs on ``tp`` processes and a tied weight stays whole on
each (a ``Replicate`` ``DTensor``, read through its local tensor here): the copies of tp rank ``t``
form their own group, so each "pipeline" below is one ``(replica, t)`` pair.

Under torch.distributed each exchange is bounded by the trainer's ``timeout``
(``runtime.transport.collective``): a holder that failed, exited or never reaches the sum makes the
others raise ``PeerFailed`` or ``TransportTimeout`` instead of waiting for the process group's
own timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from runtime.parallel.clipping import local_shard
from runtime.transport.collective import group_ranks, wait_bounded

__all__ = ["TiedGroup", "tie_copies", "sum_tied_grads", "copy_tied_values", "second_copies"]

# The copies of one tied parameter this process holds, and the process group of the ranks that
# hold one (``None``: all copies are in this process, on different devices).
TiedGroup = tuple[list[nn.Parameter], "dist.ProcessGroup | None"]


def tie_copies(
    shared: Mapping[str, tuple[int, ...]],
    modules: Mapping[int, nn.Module],
    devices: Mapping[int, torch.device],
    stage_to_rank: Sequence[int],
    rank: int | None,
    comm_device: Callable[[], torch.device],
    *,
    replicas: Sequence[Sequence[int]] | None = None,
    replica: int = 0,
    timeout: float = 300.0,
) -> list[TiedGroup]:
    """The groups of copies whose gradients must be summed, making the copies that are needed.

    Args:
        shared: tied parameter name -> the stages holding it (``StagedModel.shared_params``).
        modules: this process's stage modules by stage.
        devices: each of this process's stages' device.
        stage_to_rank: rank of every stage.
        rank: this rank of the pipeline under torch.distributed (every rank of the job must call
            this, in the same order: it creates process groups), or ``None`` in one process.
        comm_device: where collectives run (the rank's GPU on NCCL, else the CPU).
        replicas: with data or tensor parallelism, ``replicas[i][r]``: the global rank of pipeline
            rank ``r`` in pipeline ``i``, every pipeline of the job (``PipelineMesh.pipelines``: one
            per replica and tp rank; default: one pipeline, global rank ``r``).
        replica: this process's pipeline ``i`` (``PipelineMesh.pipeline``).
        timeout: seconds the first copy's broadcast may take.

    Raises:
        PeerFailed: a holder failed or exited during the broadcast.
        TransportTimeout: a holder did not join it within ``timeout``.
    """
    groups: list[TiedGroup] = []
    rows = replicas if replicas is not None else [tuple(range(max(stage_to_rank) + 1))]
    for name, holders in sorted(shared.items()):
        if rank is not None:
            ranks = sorted({stage_to_rank[s] for s in holders})
            if len(ranks) < 2:
                continue
            # Every process calls new_group for every replica's holders, in the same order.
            made = [dist.new_group([row[r] for r in ranks]) for row in rows]
            group = made[replica]
            if rank in ranks:
                prm = next(_param(modules[s], name) for s in holders if s in modules)
                with torch.no_grad():  # start from identical values on every holder
                    mine = local_shard(prm.detach())  # under tp: the whole weight a Replicate DTensor holds
                    buf = mine.to(comm_device())
                    work = dist.broadcast(buf, src=rows[replica][ranks[0]], group=group, async_op=True)
                    wait_bounded(work, timeout=timeout, what=f"the broadcast of tied weight {name!r} to ranks "
                                 f"{group_ranks(group)}")
                    mine.copy_(buf.to(mine.device))
                groups.append(([prm], group))
        elif len({(devices[s], stage_to_rank[s]) for s in holders}) > 1:
            groups.append((_untie(name, holders, modules, devices, stage_to_rank), None))
    return groups


def sum_tied_grads(
    groups: Sequence[TiedGroup], comm_device: Callable[[], torch.device], *, timeout: float = 300.0,
) -> None:
    """Give every copy of each tied parameter the sum of all copies' gradients.

    Under torch.distributed the all-reduces of every group are posted together, then each is
    waited for at most ``timeout`` seconds (the trainer's).

    Raises:
        PeerFailed: a holder failed or exited before or during the sum.
        TransportTimeout: a holder did not reach the sum within ``timeout``.
    """
    posted = []
    for copies, group in groups:
        if group is not None:
            prm = copies[0]
            if prm.grad is None:
                prm.grad = torch.zeros_like(prm)
            # Under FSDP the gradient is this replica's shard, sharded alike on every holder.
            buf = local_shard(prm.grad).to(comm_device())
            posted.append((prm, buf, group, dist.all_reduce(buf, group=group, async_op=True)))
        else:
            grads = [c.grad for c in copies if c.grad is not None]
            if not grads:
                continue
            total = sum(g.to(copies[0].device) for g in grads)
            assert isinstance(total, torch.Tensor)  # grads is not empty: sum() never returns its start, 0
            for c in copies:
                c.grad = total.to(c.device).clone()
    for prm, buf, group, work in posted:
        wait_bounded(work, timeout=timeout, what=f"the all-reduce of tied weights' gradients (a tensor of "
                     f"{tuple(prm.shape)}) with ranks {group_ranks(group)}")
        assert prm.grad is not None
        with torch.no_grad():
            local_shard(prm.grad).copy_(buf)


def copy_tied_values(groups: Sequence[TiedGroup], optimizer: torch.optim.Optimizer | None) -> None:
    """In one process, copies on other devices take the first copy's values and optimizer state."""
    with torch.no_grad():
        for copies, group in groups:
            if group is not None:
                continue
            first = copies[0]
            for c in copies[1:]:
                c.copy_(first)
                if optimizer is None or first not in optimizer.state:
                    continue
                mine = optimizer.state.setdefault(c, {})
                for key, value in optimizer.state[first].items():
                    if isinstance(value, torch.Tensor):
                        mine[key] = value.to(c.device if value.dim() else value.device, copy=True)
                    else:
                        mine[key] = value


def second_copies(
    groups: Sequence[TiedGroup], shared: Iterable[tuple[str, tuple[int, ...]]], modules: Mapping[int, nn.Module],
) -> set[int]:
    """Ids of this process's tied-parameter copies that must not count a second time in a norm:
    copies after the first in one process, and every copy where another rank holds the first
    stage (that rank counts it)."""
    skip: set[int] = set()
    for copies, group in groups:
        if group is None:
            skip.update(id(c) for c in copies[1:])
    for name, holders in shared:
        if holders[0] not in modules:
            skip.update(id(modules[s].get_parameter(name)) for s in holders if s in modules)
    return skip


def _untie(
    name: str, holders: Sequence[int], modules: Mapping[int, nn.Module], devices: Mapping[int, torch.device],
    stage_to_rank: Sequence[int],
) -> list[nn.Parameter]:
    # One Parameter cannot live on two devices, and two rank threads adding into one .grad add
    # in whichever order the threads run (float sums then differ from run to run). So each
    # (device, rank) holding the weight other than the first holder's gets its own copy (under
    # every alias), kept equal by summing gradients, in stage order, before each step.
    first = _param(modules[holders[0]], name)
    copies = [first]
    made: dict[tuple[torch.device, int], nn.Parameter] = {(devices[holders[0]], stage_to_rank[holders[0]]): first}
    for s in holders[1:]:
        key = (devices[s], stage_to_rank[s])
        if key not in made:
            made[key] = nn.Parameter(first.detach().clone(), requires_grad=first.requires_grad)
            copies.append(made[key])
        clone = made[key]
        if clone is first:
            continue
        module = modules[s]
        for alias, prm in list(module.named_parameters(remove_duplicate=False)):
            if prm is first:
                owner_name, _, leaf = alias.rpartition(".")
                setattr(module.get_submodule(owner_name) if owner_name else module, leaf, clone)
    return copies


def _param(module: nn.Module, name: str) -> nn.Parameter:
    """A parameter by any of its names (a tied weight has several; named_parameters() shows one)."""
    return dict(module.named_parameters(remove_duplicate=False))[name]
