"""What each sharding over the replicas leaves on a rank: training state per parameter, FSDP's gathers.

Legend: ``dp`` replicas (a "dp" group's size), ``m`` micro-batches per replica per step.

The layout search (``partitioner.search``) prices three shardings (``ZERO_OPTIONS``):

* ``none``: every replica holds its stages' weights, gradients and optimizer state whole.
* ``zero1``: the optimizer state is ``1 / dp`` per rank (ZeRO-1: reduce the gradients to their
  owners, step, broadcast the new weights).
* ``fsdp``: FSDP2, ``fully_shard`` on each block of a stage (the runtime outlines the blocks of a
  stage's graph into modules of their own, ``runtime.parallel.blocks``) and on the stage itself
  for the rest of its parameters (embeddings, a final norm, a head), over its rank's "dp" group,
  with ``reshard_after_forward=True`` (ZeRO-3), the gradient reduce-scattered once per step after
  the stage's last backward (gradient sync off for the earlier micro-batches), as the runtime
  runs it:

  - memory: the weight (4 of the state's bytes) and the optimizer state are ``1 / dp`` per rank;
    the gradient (4 bytes) is whole, because FSDP2 accumulates the unsharded gradient while sync
    is off. Gathered weights come on top (``GATHERED_BYTES_PER_PARAM``, fp32 as stored): with a
    schedule that runs each backward whole (1F1B, GPipe, interleaved) a block is gathered while it
    computes, so a rank holds two blocks (the one computing, and the next one gathered before the
    first is freed) and its stage's other parameters (the stage's own unit stays gathered while
    the stage runs), counted on every rank as two of the model's largest block and all of its
    parameters outside the blocks (:func:`gathered_units`), whatever its cut; with a split
    backward (ZB-H1, ZB-V) a block's weight gradients may read its weights after its input
    gradients, so the runtime keeps each block gathered from its first backward to the stage's
    last: the whole stage, 4 more bytes per parameter;
  - time: each forward and each backward of a stage all-gathers its weights, ``(dp - 1) / dp`` of
    their bytes per rank, and FSDP2 copies the shard into the gather's buffer and the gathered
    weights out of it into the parameters (:func:`gather_copy_bytes` through the device's memory),
    added to the action as if nothing overlapped it (:func:`gathering`);
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

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from partitioner.cost.exchange import GATHERED_BYTES_PER_PARAM, WEIGHT_GRAD_BYTES_PER_PARAM
from partitioner.cost.graph import canonical_names, layer_depth
from partitioner.plan.records import StagePlan

__all__ = ["state_per_param", "gathered_units", "gathering", "gather_copy_bytes"]


def state_per_param(state_bytes_per_param: float, zero: str, dp: int, gathered: float = 0.0) -> float:
    """Bytes per parameter element a rank holds for a stage under ``zero`` over ``dp`` replicas.

    The first ``WEIGHT_GRAD_BYTES_PER_PARAM`` bytes of the state are the weight and its gradient
    (half each), the rest the optimizer's; ``fsdp`` adds ``gathered``, bytes of the stage's
    weights held gathered per parameter (a split backward's whole stage; 0 where the gathered
    blocks are counted apart).

    Example:
        >>> [state_per_param(16.0, z, 4) for z in ("none", "zero1", "fsdp")]   # Adam in fp32
        [16.0, 10.0, 7.0]
        >>> state_per_param(16.0, "fsdp", 4, gathered=4.0)   # ZB-H1: the stage gathered whole
        11.0
    """
    opt = max(0.0, state_bytes_per_param - WEIGHT_GRAD_BYTES_PER_PARAM)
    whole = state_bytes_per_param - opt  # weight and gradient
    if zero == "zero1":
        return whole + opt / dp
    if zero == "fsdp":  # the weight's shard; the gradient whole until the reduce-scatter
        return whole / 2 / dp + whole / 2 + opt / dp + gathered
    return state_bytes_per_param


def gathered_units(g: Any, numel: Mapping[str, int], aliases: Mapping[str, Sequence[str]]) -> tuple[float, float]:
    """``(largest block, outside the blocks)``: parameters of a costed graph's largest block (a
    module at the model's layer depth with a numbered name, ``transformer.h.3`` in a GPT-2: one
    FSDP unit) and of all its parameters in no block (embeddings, final norm, head: each stage's
    own unit holds its share of them); each tensor once.
    """
    depth = layer_depth(list(dict.fromkeys(g.nodes[v]["module"] for v in g.nodes)))
    canon = canonical_names(aliases)
    blocks: dict[str, set[str]] = {}
    outside: set[str] = set()
    for v in g.nodes:
        parts = g.nodes[v]["module"].split(".")
        names = {canon.get(n, n) for n in g.nodes[v]["cost"].param_names}
        if len(parts) >= depth and parts[depth - 1].isdigit():
            blocks.setdefault(".".join(parts[:depth]), set()).update(names)
        else:
            outside |= names
    inside = set().union(*blocks.values()) if blocks else set()
    largest = max((sum(numel.get(n, 0) for n in names) for names in blocks.values()), default=0)
    return float(largest), float(sum(numel.get(n, 0) for n in outside - inside))


def gather_copy_bytes(params: float, dp: int, bytes_per_param: float = GATHERED_BYTES_PER_PARAM) -> float:
    """Bytes one FSDP2 all-gather of ``params`` parameters moves through the device's memory beside
    the collective: the shard copied into the gather's input (``1 / dp``) and the whole result
    copied out into the parameters, each read once and written once.

    Example:
        >>> gather_copy_bytes(1000, 2)   # 2 x 4 x (500 + 1000)
        12000.0
    """
    return 2.0 * bytes_per_param * params * (1.0 + 1.0 / dp)


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
