"""A Hugging Face decoder cut for generation: its units priced (``price``), cut for the slowest decode
step within memory, and each stage's record.

Legend: ``p`` stages, ``s`` a stage, ``B`` sequences cached, ``G`` groups in flight, ``g`` sequences per
group, ``L`` positions a sequence reaches.

``partition`` calls :func:`cut_for_generation` when ``Costing.inference`` is set; the cut itself is the
planner's own (``exact`` by default, the baselines, split points) on the problem
:func:`~partitioner.inference.price.inference_problem` makes. The decode step is priced for the
generator's default of one group per stage (``G = min(p, B)``, ``g = ceil(B / G)``): with every
stage busy, the slowest stage's step of one group sets the pace, and a round of ``G`` such steps
gives every sequence a token.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from partitioner import algorithms as alg
from partitioner.cost.devices import Cluster
from partitioner.cost.graph import Unit, canonical_names, layer_depth, module_range, to_problem
from partitioner.cost.precision import PRECISIONS
from partitioner.errors import InfeasibleMemoryError, PartitionOptionError
from partitioner.inference.kv import kv_layers
from partitioner.inference.price import UnitPrice, decode_seconds, inference_problem, stage_use, unit_prices
from partitioner.plan.records import InferenceSummary, StagePlan
from partitioner.plan.units import fmt_bytes
from partitioner.tracing.hf import blocks, is_hf_model

__all__ = ["GenerationCut", "cut_for_generation"]

log = logging.getLogger(__name__)

_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}


@dataclass(frozen=True)
class GenerationCut:
    """A cut for generation: the problem solved, its answer, the stages' records and the summary."""

    problem: alg.Problem
    assignment: tuple[int, ...]
    method: str
    stages: tuple[StagePlan, ...]
    summary: InferenceSummary
    dtype_bytes: float


@dataclass(frozen=True)
class _Priced:
    prices: tuple[UnitPrice, ...]
    base: alg.Problem
    dtype: str  # what weights and cache are held in
    compute_dtype: str  # the dtype whose peak the matmuls run at (the autocast policy's, else dtype's)
    shape: tuple[int, int]


def cut_for_generation(
    model: nn.Module, traced: Any, g: Any, units: Sequence[Unit], cluster: Cluster, *, inference: Any,
    precision: str, numel: Mapping[str, int], solve: Callable[[alg.Problem], alg.Partition],
) -> GenerationCut:
    """Cut ``model``'s costed graph into ``len(cluster)`` stages for generation.

    Args:
        model: a Hugging Face decoder-only causal LM (its config says its key/value cache).
        traced: its traced graph (``partitioner.tracing.trace``); the first 2-D input is the prompt.
        g: the costed graph; ``units`` its units.
        cluster: one device per stage.
        inference: the :class:`~partitioner.options.Inference` it is priced for.
        precision: ``Costing.precision`` (autocast: the matmuls' peak).
        numel: every parameter's element count by name.
        solve: the planner's cut for a problem (its method, refinement, split points).

    Raises:
        PartitionOptionError: not a Hugging Face model, or one whose layers the config and the graph
            do not agree on.
        InfeasibleMemoryError: no cut holds ``inference.batch`` sequences; says how many would fit.
    """
    p = len(cluster)
    priced = _priced(model, traced, g, units, cluster, inference, precision, numel)
    batch = inference.batch
    groups = min(p, batch)
    group = math.ceil(batch / groups)
    tokens = priced.shape[0] * priced.shape[1]

    def problem_for(b: int) -> alg.Problem:
        return inference_problem(priced.base, priced.prices, cluster.devices, batch=b, group=group,
                                 dtype=priced.compute_dtype, tokens=tokens)

    problem = problem_for(batch)
    try:
        part = solve(problem)
    except InfeasibleMemoryError as e:
        raise _refused(e, problem_for, inference, p) from None
    ev = alg.evaluate(problem, part.assignment)
    stages = _stage_records(g, units, priced, cluster, part.assignment, ev, batch=batch, group=group,
                            numel=numel, aliases=traced.param_aliases)
    slowest = max(st.time for st in stages)
    summary = InferenceSummary(
        batch=batch, max_len=inference.max_len, prompt_len=priced.shape[1], dtype=priced.dtype, groups=groups,
        fits=min(st.sequences for st in stages), tokens_per_s=batch / (groups * slowest) if slowest > 0 else 0.0,
    )
    log.info("partition (generation): %d stages, %d sequences of %d: fits %d, %.1f tokens/s", p, batch,
             inference.max_len, summary.fits, summary.tokens_per_s)
    return GenerationCut(problem, tuple(part.assignment), part.method, stages, summary, _BYTES[priced.dtype])


def _priced(
    model: nn.Module, traced: Any, g: Any, units: Sequence[Unit], cluster: Cluster, inference: Any,
    precision: str, numel: Mapping[str, int],
) -> _Priced:
    name = type(model).__name__
    if not is_hf_model(model):
        raise PartitionOptionError(
            f"Costing(inference=...) prices a Hugging Face decoder-only causal LM (it reads the key/value cache's "
            f"shape from the model's config); {name} is not one: plan it for training, or build it with transformers"
        )
    layers = kv_layers(model.config)
    names = blocks(model)
    if len(names) != len(layers):
        raise PartitionOptionError(
            f"{name}: its config says {len(layers)} decoder layers but the model holds {len(names)} blocks "
            f"({', '.join(names[:3])}...): inference costing charges each layer's cache to its block"
        )
    shape = next((tuple(i.shape) for i in traced.example_inputs if len(i.shape) == 2), None)
    if shape is None:
        raise PartitionOptionError(
            f"Costing(inference=...) reads the prompt's rows and positions from a 2-D example input (input_ids of "
            f"shape (rows, positions)); the inputs are {[tuple(i.shape) for i in traced.example_inputs]}"
        )
    dtype = inference.dtype or _model_dtype(model)
    in_block = [_block_of(g.nodes[v]["module"], names) for v in sorted(g.nodes, key=lambda v: g.nodes[v]["order"])]
    layer_unit: dict[int, int] = {}
    for u in units:
        for v in u.nodes:
            i = in_block[g.nodes[v]["order"]]
            if i is not None:
                layer_unit.setdefault(i, u.index)
    missing = [names[i] for i in range(len(names)) if i not in layer_unit]
    if missing:
        raise PartitionOptionError(f"{name}: the traced graph runs no node of the blocks {missing}")
    last_block = max(o for o, i in enumerate(in_block) if i is not None)
    head_from = next((g.nodes[v]["order"] for v in sorted(g.nodes, key=lambda v: g.nodes[v]["order"])
                      if g.nodes[v]["order"] > last_block and g.nodes[v]["cost"].fwd_flops > 0
                      and g.nodes[v]["cost"].param_count > 0), None)
    base = to_problem(g, units, cluster, inflight=[0] * len(cluster), param_numel=numel,
                      state_bytes_per_param=_BYTES[dtype], param_aliases=traced.param_aliases)
    prices = unit_prices(g, units, weight_bytes=base.state_bytes, layers=layers, layer_unit=layer_unit,
                         shape=(int(shape[0]), int(shape[1])), max_len=inference.max_len,
                         dtype_bytes=_BYTES[dtype], head_from=head_from)
    compute = PRECISIONS[precision] if precision != "fp32" else PRECISIONS[dtype]
    return _Priced(prices, base, dtype, compute, (int(shape[0]), int(shape[1])))


def _model_dtype(model: nn.Module) -> str:
    """``'fp32'``, ``'bf16'`` or ``'fp16'``: the model's first floating parameter's dtype (fp32 otherwise)."""
    by_name = {v: k for k, v in PRECISIONS.items()}
    dtype = next((str(t.dtype) for t in model.parameters() if t.dtype.is_floating_point), "torch.float32")
    return by_name.get(dtype, "fp32")


def _block_of(module: str, names: Sequence[str]) -> int | None:
    for i, block in enumerate(names):
        if module == block or module.startswith(block + "."):
            return i
    return None


def _stage_records(
    g: Any, units: Sequence[Unit], priced: _Priced, cluster: Cluster, assignment: Sequence[int], ev: Any, *,
    batch: int, group: int, numel: Mapping[str, int], aliases: Mapping[str, Sequence[str]],
) -> tuple[StagePlan, ...]:
    p = len(cluster)
    of_stage: list[list[Unit]] = [[] for _ in range(p)]
    for u in units:
        of_stage[assignment[u.index]].append(u)
    depth = layer_depth(list(dict.fromkeys(g.nodes[v]["module"] for v in g.nodes)))
    canon = canonical_names(aliases)
    out = []
    for s, held in enumerate(of_stage):
        dev = cluster.devices[s]
        nodes = sorted((v for u in held for v in u.nodes), key=lambda v: g.nodes[v]["order"])
        names = {canon.get(n, n) for v in nodes for n in g.nodes[v]["cost"].param_names}
        prices = [priced.prices[u.index] for u in held]
        use = stage_use(prices, batch=batch)
        step = decode_seconds(prices, dev, group=group, dtype=priced.compute_dtype)
        out.append(StagePlan(
            index=s, device=dev.name, nodes=tuple(nodes),
            modules=module_range([".".join(g.nodes[v]["module"].split(".")[:depth]) for v in nodes]),
            params=int(sum(numel.get(n, 0) for n in names)), fwd_flops=float(sum(u.flops for u in prices) * group),
            bwd_flops=0.0, memory=float(use.memory), capacity=float(dev.usable_memory), inflight=0,
            fwd_time=float(step), bwd_time=0.0, comm_in_time=float(ev.transfer_in[s]),
            comm_out_time=float(ev.transfer_out[s]),
            send_bytes=float(ev.boundary_bytes[s]) if s < p - 1 else 0.0, state_bytes=float(use.weights),
            kv_bytes=float(use.kv), work_bytes=float(use.work), sequences=use.largest_batch(dev.usable_memory),
        ))
    return tuple(out)


def _refused(
    error: InfeasibleMemoryError, problem_for: Callable[[int], alg.Problem], inference: Any, p: int,
) -> InfeasibleMemoryError:
    """The refusal of ``inference.batch`` sequences, with the most any cut holds (bisected on ``exact``)."""
    lo, hi = 0, inference.batch - 1  # the batch asked for does not fit; find the most that does
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            alg.exact(problem_for(mid))
            lo = mid
        except InfeasibleMemoryError:
            hi = mid - 1
    need = ", ".join(f"stage {s}: {fmt_bytes(n)} of {fmt_bytes(a)}"
                     for s, (n, a) in enumerate(zip(error.needed, error.available)))
    what = f"{inference.batch} sequences of {inference.max_len} positions"
    if lo == 0:
        hint = ("not even one sequence fits beside the weights: use more stages, devices with more memory, or "
                "bf16 weights and cache (Inference(dtype='bf16'), --precision bf16)")
    else:
        hint = (f"at most {lo} sequences of {inference.max_len} positions fit {p} stages: ask for {lo} or fewer "
                f"(Inference(batch={lo}); pipecut plan --batch {lo}, pipecut generate --batch-size {lo}), a shorter "
                "maximum length, more stages or devices with more memory")
    return InfeasibleMemoryError(
        error.needed, error.available,
        message=f"no cut into {p} stages holds the weights, key/value cache and working memory of {what} "
                f"(the closest cut: {need}); {hint}",
    )


