"""FSDP2 as the data-parallel engine: each stage's parameters, gradients and optimizer state
sharded over the replicas that hold the stage (``torch.distributed.fsdp.fully_shard``).

Legend: ``dp`` replicas, ``s`` a stage of this process, ``m`` micro-batches of a step.

Each of this process's stage modules is ``fully_shard``-ed over the ``"dp"`` dimension of the
job's ``("dp", "pp")`` mesh, as torchtitan composes FSDP2 with pipeline stages, one unit per
block: stage modules are ``torch.fx`` graphs that read their parameters through ``get_attr``, so
no block's forward would run and its hooks would never fire; ``runtime.parallel.blocks`` first
outlines each block into a module the stage graph calls, and each is sharded as its own unit,
the stage as one more for its other parameters. Parameters become ``DTensor`` shards (``1 / dp``
of each per replica), gathered for a forward and for a backward:

* ``reshard_after_forward=True`` (ZeRO-3): freed after each forward and each backward, gathered
  again for the next (under a split backward a block stays gathered from its first backward to
  the stage's last: its ``W`` may read the weights after its ``I``); ``False`` (ZeRO-2-like):
  kept gathered from a micro-batch's forward until the stage's last backward of the step.
* Gradients accumulate unsharded over the step's micro-batches (sync off) and are
  reduce-scattered once, averaged over the replicas, when the executor reports the stage's last
  backward action (``B``, or the last ``W`` under split backward); the stage is then resharded.
  That reduction is started by hand (``FSDPReplicas.averager.stage_done``), as torch's own
  pipelining does (``_PipelineStageBase.perform_reduce_grad``): a pipeline calls backward once
  per micro-batch and, under split backward, twice, while FSDP's hooks assume one backward per
  step. Like torch's pipelining this reaches into FSDP's private state (the param groups'
  ``post_backward``, the root's final callback, ``FSDPParam._unsharded_param``); the exactness
  tests in ``tests/runtime/parallel/test_fsdp.py`` pin that behaviour for every schedule.
* Split backward asks autograd for the gathered parameters, the ones the graph accumulates into
  (``pipecut_autograd_params`` on the stage module): FSDP reads their gradients at the reduction.

The optimizer is built over the shards, so its state is ``1 / dp`` too. Clipping sums every
rank's shards over the whole job. Tied weights across ranks stay tied: the copies on the ranks
of one replica are sharded alike, so their local shards' gradients are summed as whole copies
were. A weight two stages of one process share cannot be two FSDP units' and is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from runtime.parallel.blocks import outline_blocks
from runtime.parallel.data_parallel import PipelineMesh
from runtime.parallel.tied import TiedGroup
from runtime.transport.placement import PlacementError

__all__ = ["FSDPReplicas", "FSDPOptionError", "check_fsdp_plan", "check_optimizer"]


class FSDPOptionError(PlacementError):
    """FSDP cannot run this configuration; the message says why and what runs instead."""


class _AutogradParams:
    """A sharded stage's parameters as autograd sees them during a step: the gathered ones.

    Called by the executor's split backward (``I`` must name the tensors whose gradient ``W``
    computes). Returns ``(params, fused)``: every gathered parameter that requires grad, and
    those whose layers add their own gradients (``runtime.execute.wgrad_fusion``).
    """

    def __init__(self, fsdp_params: Sequence[Any], fused: Collection[tuple[int, str]]) -> None:
        self._fsdp_params = list(fsdp_params)
        self._fused = set(fused)

    def __call__(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        params, fused = [], []
        for fp in self._fsdp_params:
            prm = getattr(fp, "_unsharded_param", None)  # made by the first all-gather, kept after
            if prm is None or not prm.requires_grad:
                continue
            params.append(prm)
            info = fp._module_info
            if (id(info.module), info.param_name) in self._fused:
                fused.append(prm)
        return params, fused


class _StageReducer:
    """Reduce-scatters a stage's gradients when its last backward of the step has run.

    The interface of ``GradAverager`` that the trainer drives: :meth:`stage_done`,
    :meth:`finish`, :meth:`reset`.
    """

    def __init__(self, modules: Mapping[int, nn.Module], keep: bool = False) -> None:
        self._modules = dict(modules)
        self._keep = keep
        self._done: set[int] = set()
        self._finished = False

    def stage_done(self, s: int) -> None:
        """Stage ``s`` adds no more gradient this step: reduce-scatter it and reshard."""
        module = self._modules.get(s)
        if module is None or s in self._done:
            return
        self._done.add(s)
        _sync(module, True, self._keep)
        try:
            for group in _param_groups(module):
                group.post_backward()
            state = module._get_fsdp_state()  # type: ignore[operator]
            state._root_post_backward_final_callback()  # waits for the reductions, resets FSDP's step state
        finally:
            _sync(module, False, self._keep)

    def finish(self, pipeline: dist.ProcessGroup | None = None) -> None:
        """Reduce the stages no backward reached (they hold no gradient: FSDP leaves theirs ``None``)."""
        for s in self._modules:
            self.stage_done(s)
        self._finished = True

    def reset(self) -> None:
        """Ready for the next step. After a step that failed midway, FSDP's own step state is
        reset too (collectives waited for, every stage resharded) and the gathered gradients
        it left are dropped."""
        if not self._finished:
            for module in self._modules.values():
                state = module._get_fsdp_state()  # type: ignore[operator]
                if state._is_root is None:
                    # No forward ran through the stage yet (the step failed before: a peer, a
                    # batch), so FSDP has not initialised its step state (its lazy init, at the
                    # root's first forward) and there is nothing to reset: resetting it would
                    # raise an AttributeError in place of the step's own error.
                    continue
                reset_iter = getattr(state, "_reset_iter_state", None)
                if callable(reset_iter):
                    reset_iter()
                for fp in _fsdp_params(module):
                    prm = getattr(fp, "_unsharded_param", None)
                    if prm is not None:
                        prm.grad = None
        self._done = set()
        self._finished = False


class FSDPReplicas:
    """The trainer's side of FSDP2 over the replicas: the ``Replicas`` interface.

    Args:
        mesh: this process's place in the job (``dp > 1``, with its ``("dp", "pp")`` device mesh).
        modules: this process's stage modules by stage (sharded in place).
        tied: this process's copies of weights tied across ranks (``tie_copies``); :attr:`tied`
            holds the same groups with the shards in place of the copies.
        reshard_after_forward: ZeRO-3 (``True``) or keep gathered over a step (``False``).
        split_backward: the schedule runs a stage's backward as ``I`` then ``W``: a block's
            weight gradients (``W``) may read its weights after its input gradients (``I``)
            ran, so a block stays gathered from its first backward to the stage's last.
        gather_dtype: all-gather the weights in this dtype (FSDP's ``MixedPrecisionPolicy``,
            gradients reduced in fp32); ``None``: in their own (fp32).

    Raises:
        FSDPOptionError: ``dp < 2`` (nothing to shard). A weight two stages of this process
            share is refused before, by :func:`check_fsdp_plan`.
    """

    shard = True

    def __init__(
        self,
        mesh: PipelineMesh,
        modules: Mapping[int, nn.Module],
        *,
        tied: Sequence[TiedGroup] = (),
        reshard_after_forward: bool = True,
        gather_dtype: torch.dtype | None = None,
        split_backward: bool = False,
    ) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if mesh.device_mesh is None or mesh.dp < 2:
            raise FSDPOptionError(
                f"engine='fsdp' shards over the replicas and needs dp >= 2 with a ('dp', 'pp') mesh; got dp={mesh.dp}: "
                "pass DataParallel(size=2, engine='fsdp') under torchrun, or leave engine at its default"
            )
        self.mesh = mesh
        dp_mesh = mesh.device_mesh["dp"]
        kw: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward}
        if gather_dtype is not None:
            # Inputs are left as they come: autocast decides each op's dtype, as without FSDP.
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=gather_dtype, reduce_dtype=torch.float32,
                                                   cast_forward_inputs=False)
        self.modules = dict(modules)
        keep = split_backward or not reshard_after_forward  # gathered from a backward to the step's last
        where = _names_of([c for copies, _ in tied for c in copies], self.modules)
        for module in self.modules.values():
            blocks = outline_blocks(module) if isinstance(module, fx.GraphModule) else []  # each block a unit
            fused = _fused_slots(module)  # before any parameter becomes a shard
            module.pipecut_fused_params = ()  # type: ignore[assignment]  # the whole tensors: asked of _AutogradParams now
            for path in blocks:
                fully_shard(module.get_submodule(path), **kw)
            fully_shard(module, **kw)
            _sync(module, False, keep)
            # torch types Module.__setattr__'s value as a Tensor or Module; a plain attribute is fine.
            module.pipecut_autograd_params = _AutogradParams(_fsdp_params(module), fused)  # type: ignore[assignment]
        # fully_shard replaced every parameter by its shard: the tied copies are those shards now.
        self.tied: list[TiedGroup] = [
            ([self.modules[where[id(c)][0]].get_parameter(where[id(c)][1]) for c in copies], group)
            for copies, group in tied
        ]
        self.params = list({id(p): p for m in self.modules.values() for p in m.parameters()}.values())
        self.averager = _StageReducer(self.modules, keep=keep)

    @property
    def owned(self) -> list[nn.Parameter]:
        """The shards this process's optimizer steps: all its parameters, each a ``DTensor`` shard."""
        return self.params

    @property
    def norm_group(self) -> dist.ProcessGroup | None:
        """Every rank holds a different shard: a norm is summed over the whole job."""
        return None

    def after_step(self) -> None:
        """Nothing: each replica stepped its own shards, gathered at the next forward."""


def check_optimizer(optimizer: torch.optim.Optimizer, owned: Sequence[nn.Parameter]) -> None:
    """Raise unless ``optimizer`` steps exactly the sharded parameters it was given.

    Raises:
        FSDPOptionError: it holds a tensor that is not one of them (the unsharded model's
            parameters, captured by the factory instead of the list it was called with).
    """
    mine = {id(p) for p in owned}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    stray = [p for p in held if id(p) not in mine]
    if stray:
        raise FSDPOptionError(
            f"the optimizer holds {len(stray)} tensor(s) that are not this rank's FSDP shards (e.g. one of "
            f"shape {tuple(stray[0].shape)}): under engine='fsdp' the parameters are DTensor shards made when "
            "the trainer is built, so the optimizer factory must use the list it is called with, "
            "optimizer=lambda params: torch.optim.AdamW(params, ...), not model.parameters()"
        )


def _param_groups(module: nn.Module) -> list[Any]:
    """The FSDP parameter groups of a stage: its blocks' and its own (the root's), blocks first."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if m is not module and isinstance(m, FSDPModule)] + [module]
    return [g for m in units for g in m._get_fsdp_state()._fsdp_param_groups]  # type: ignore[operator]


def _fsdp_params(module: nn.Module) -> list[Any]:
    """The stage's ``FSDPParam`` records, over all its units."""
    return [fp for g in _param_groups(module) for fp in g.fsdp_params]


def _sync(module: nn.Module, last: bool, keep: bool = False) -> None:
    """FSDP's per-backward switches: reduce only after the stage's last backward; reshard after
    every backward (ZeRO-3: a block is gathered while it computes, no longer), or with ``keep``
    (``reshard_after_forward=False``) only after the last."""
    for setter in ("set_is_last_backward", "set_requires_gradient_sync"):
        fn: Callable[[bool], None] = getattr(module, setter)
        fn(last)
    module.set_reshard_after_backward(last or not keep)  # type: ignore[operator]


def _fused_slots(module: nn.Module) -> set[tuple[int, str]]:
    """(owning module id, attribute name) of each parameter whose layer fuses its gradient."""
    fused = {id(p) for p in getattr(module, "pipecut_fused_params", ())}
    slots = set()
    for name, prm in module.named_parameters(remove_duplicate=False):
        if id(prm) in fused:
            owner, _, leaf = name.rpartition(".")
            slots.add((id(module.get_submodule(owner) if owner else module), leaf))
    return slots


def _names_of(params: Sequence[nn.Parameter], modules: Mapping[int, nn.Module]) -> dict[int, tuple[int, str]]:
    """For each of ``params``, a stage of ``modules`` holding it and its name there."""
    ids = {id(p) for p in params}
    found: dict[int, tuple[int, str]] = {}
    for s, module in sorted(modules.items()):
        for name, prm in module.named_parameters():
            if id(prm) in ids:
                found.setdefault(id(prm), (s, name))
    return found


def check_fsdp_plan(shared: Mapping[str, tuple[int, ...]], stage_to_rank: Sequence[int], schedule: str) -> None:
    """Refuse, on every rank alike, a weight tied between two stages of one rank.

    FSDP shards each stage as its own unit; a parameter two units share would be sharded twice
    and its copies would drift apart.

    Raises:
        FSDPOptionError: such a weight exists; the message names it and what runs instead.
    """
    for name, holders in sorted(shared.items()):
        by_rank: dict[int, list[int]] = {}
        for s in holders:
            by_rank.setdefault(stage_to_rank[s], []).append(s)
        for r, stages in sorted(by_rank.items()):
            if len(stages) > 1:
                raise FSDPOptionError(
                    f"engine='fsdp': schedule {schedule!r} puts stages {stages} on rank {r}, and they share the "
                    f"tied weight {name!r}; FSDP shards each stage as its own unit, so that weight cannot be "
                    "sharded once. Use a schedule that places those stages on different ranks (1f1b, zbh1, "
                    "gpipe, interleaved), untie the weight, or engine='replicate' with shard_optimizer=True "
                    "(ZeRO-1) for this schedule"
                )
