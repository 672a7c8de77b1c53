"""What each sharding over the replicas leaves on a rank: training state per parameter, FSDP's gathers.

Legend: ``dp`` replicas (a "dp" group's size), ``m`` micro-batches per replica per step.

The layout search (``partitioner.search``) prices three shardings (``ZERO_OPTIONS``):

* ``none``: every replica holds its stages' weights, gradients and optimizer state whole.
* ``zero1``: the optimizer state is ``1 / dp`` per rank (ZeRO-1: reduce the gradients to their
  owners, step, broadcast the new weights).
* ``fsdp``: FSDP2, ``fully_shard`` on each stage over its rank's "dp" group (the stage is the
  unit: ``runtime.parallel.fsdp``), with ``reshard_after_forward=True`` (ZeRO-3), the gradient
  reduce-scattered once per step after the stage's last backward (gradient sync off for the
  earlier micro-batches), as the runtime runs it:

  - memory: the weight (4 of the state's bytes) and the optimizer state are ``1 / dp`` per rank;
    the gradient (4 bytes) is whole, because FSDP2 accumulates the unsharded gradient while sync
    is off; and while a stage computes, its weights are gathered whole
    (``GATHERED_BYTES_PER_PARAM``, fp32 as stored), counted with the stage's state. Per
    parameter that is ``4 / dp + 4 + 8 / dp + 4`` bytes of fp32 Adam against ZeRO-1's
    ``8 + 8 / dp``: with the whole stage as the unit, FSDP holds more at its peak than ZeRO-1,
    never less, and the search chooses it only where nothing else fits (nowhere, today). Sharding
    each block as its own unit would hold one block gathered instead of the stage, which is what
    makes FSDP fit where ZeRO-1 does not; the runtime does not do that yet;
  - time: each forward and each backward of a stage all-gathers its weights, ``(dp - 1) / dp`` of
    their bytes per rank, added to the action as if nothing overlapped it (:func:`gathering`);
    a recomputing stage's replayed forward gathers for its backward, once;
  - the reduce-scatter leaves after the stage's last backward and overlaps the drain, like the
    other exchanges; the optimizer steps ``1 / dp`` of the parameters; nothing is broadcast
    after it (the next step's forwards gather the new weights).

``reshard_after_forward=False`` (weights gathered once per step and kept until its last backward)
is not a fourth option: its peak holds the whole weights and gradients with the optimizer state
over ``dp`` (ZeRO-1's memory) and it moves ZeRO-1's bytes (a reduce-scatter behind the drain, a
gather of the new weights before the next step's forwards where ZeRO-1 broadcasts them), so
``zero1`` prices it.
"""

from __future__ import annotations

from dataclasses import replace

from partitioner.cost.exchange import WEIGHT_GRAD_BYTES_PER_PARAM
from partitioner.plan.records import StagePlan

__all__ = ["state_per_param", "gathering"]


def state_per_param(state_bytes_per_param: float, zero: str, dp: int, gathered: float = 0.0) -> float:
    """Bytes per parameter element a rank holds for a stage under ``zero`` over ``dp`` replicas.

    The first ``WEIGHT_GRAD_BYTES_PER_PARAM`` bytes of the state are the weight and its gradient
    (half each), the rest the optimizer's; ``fsdp`` adds ``gathered``, the stage's weights
    gathered whole while it computes.

    Example:
        >>> [state_per_param(16.0, z, 4, gathered=4.0) for z in ("none", "zero1", "fsdp")]   # Adam in fp32
        [16.0, 10.0, 11.0]
    """
    opt = max(0.0, state_bytes_per_param - WEIGHT_GRAD_BYTES_PER_PARAM)
    whole = state_bytes_per_param - opt  # weight and gradient
    if zero == "zero1":
        return whole + opt / dp
    if zero == "fsdp":  # the weight's shard and the gathered weight; the gradient whole until the reduce-scatter
        return whole / 2 / dp + whole / 2 + opt / dp + gathered
    return state_bytes_per_param


def gathering(st: StagePlan, gather: float, faster: float = 1.0) -> StagePlan:
    """``st`` computing ``faster`` times as fast, its forward and its backward each after a gather
    of ``gather`` seconds (a recomputing stage's replayed forward, part of its backward, gathers).

    Example:
        >>> st = StagePlan(0, "cpu", ("n",), "", 0, 0.0, 0.0, 0.0, 1e9, 1, 1.0, 2.0, 0.0, 0.0, 0.0,
        ...                wgrad_time=1.0)
        >>> g = gathering(st, 0.5)
        >>> g.fwd_time, g.bwd_time, g.wgrad_time, gathering(replace(st, recompute=True), 0.5).time
        (1.5, 2.5, 1.0, 5.0)
    """
    return replace(st, fwd_time=st.fwd_time / faster + gather, wgrad_time=st.wgrad_time / faster,
                   bwd_time=st.bwd_time / faster + (0.0 if st.recompute else gather))
