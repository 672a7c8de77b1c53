"""``partition()``: trace, cost, cut and describe a model in one call."""

from __future__ import annotations

import difflib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from . import algorithms as alg
from . import estimate
from .cost import cost_graph, node_time
from .devices import Cluster
from .errors import SplitPointError, TooManyStagesError
from .graph import Unit, build_graph, canonical_names, group_units, layer_depth, module_range, to_problem
from .plan import Plan, Prediction, StagePlan, _Binding, _persistent_names
from .split import split_graph
from .trace import trace

__all__ = ["partition", "METHODS"]

log = logging.getLogger(__name__)

METHODS = ("exact", "equal_count", "balanced_params", "equal_size", "manual")


def partition(
    model: nn.Module,
    example_inputs: Sequence[Any],
    num_stages: int | None = None,
    *,
    cluster: Cluster | None = None,
    microbatches: int = 8,
    schedule: str = "1f1b",
    method: str = "exact",
    refine: bool = True,
    split_points: Sequence[str] | None = None,
    granularity: str = "node",
    module_depth: int | None = None,
    leaf_modules: Sequence[type | str] = (),
    state_bytes_per_param: float = 16.0,
    profile: bool = False,
    profile_device: str | torch.device | None = None,
    trace_method: str = "auto",
    example_kwargs: Mapping[str, Any] | None = None,
) -> Plan:
    """Cut ``model`` into pipeline stages and return the plan.

    Args:
        model: the model; it may live on ``meta`` (nothing is allocated for tracing and costing).
        example_inputs: ONE micro-batch of inputs (positional), real, fake or meta tensors.
        num_stages: ``p``; defaults to the cluster's size.
        cluster: the devices in pipeline order; defaults to ``Cluster.uniform(p, "cpu")``.
        microbatches: ``m``, micro-batches per optimizer step (sets activation memory in flight).
        schedule: ``'1f1b'`` or ``'gpipe'``; decides how many micro-batches each stage holds.
        method: ``'exact'`` (optimal contiguous cut), or a baseline: ``'equal_count'``,
            ``'balanced_params'``, ``'equal_size'``; ``'manual'`` with ``split_points``.
        refine: after a contiguous cut, move boundary nodes between neighbouring stages while
            the bottleneck falls (helps DAGs whose best cut is not contiguous in one order).
        split_points: module names where new stages begin (implies ``method='manual'``).
        granularity: ``'node'`` cuts anywhere; ``'module'`` only between layers.
        module_depth: with ``granularity='module'``, the module depth of a layer (auto).
        leaf_modules: module classes or names that tracing keeps whole.
        state_bytes_per_param: bytes of weights + grads + optimizer state per parameter element.
        profile: measure each node's time on ``profile_device`` instead of the roofline.
        profile_device: device for ``profile=True`` (default: CUDA if available, else CPU).
        trace_method: ``'auto'``, ``'fx'`` or ``'export'``.
        example_kwargs: keyword inputs for tracing.

    Returns:
        A bound ``Plan``: ``print(plan)``, ``plan.save(...)``, ``plan.build_stages()``.

    Raises:
        TraceError: the model could not be captured.
        TooManyStagesError: more stages than units.
        InfeasibleMemoryError: no cut fits the devices' memory.
        SplitPointError: a split point names no module, or they are out of order.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from partitioner import partition, Cluster
        >>> m = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
        >>> plan = partition(m, (torch.randn(8, 32),), 3, cluster=Cluster.uniform(3, "cpu"))
        >>> len(plan.stages), sum(len(st.nodes) for st in plan.stages)
        (3, 6)
        >>> plan.bottleneck >= plan.lower_bound
        True
    """
    if split_points is not None:
        method = "manual"
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "manual" and split_points is None:
        raise SplitPointError("method='manual' needs split_points=[module names where stages begin]")
    p = num_stages if num_stages is not None else (len(cluster) if cluster is not None else None)
    if p is None:
        raise ValueError("give num_stages or a cluster (one device per stage)")
    if p < 1:
        raise ValueError(f"num_stages must be at least 1, got {p}")
    if cluster is None:
        cluster = Cluster.uniform(p, "cpu")
    elif len(cluster) < p:
        raise ValueError(
            f"the cluster has {len(cluster)} devices but {p} stages were asked for; "
            "give one device per stage"
        )
    elif len(cluster) > p:
        cluster = cluster.with_devices(p)
    if microbatches < 1:
        raise ValueError(f"microbatches must be at least 1, got {microbatches}")

    t0 = time.perf_counter()
    traced = trace(
        model, tuple(example_inputs), example_kwargs=dict(example_kwargs or {}),
        leaf_modules=leaf_modules, method=trace_method,  # type: ignore[arg-type]
    )
    t1 = time.perf_counter()
    costs = cost_graph(traced, profile=profile, device=profile_device)
    t2 = time.perf_counter()
    g = build_graph(traced.gm, costs, traced.module_path)
    units = group_units(g, granularity, module_depth)
    if p > len(units):
        raise TooManyStagesError(p, len(units), granularity)
    numel = {name: prm.numel() for name, prm in traced.gm.named_parameters(remove_duplicate=False)}
    held = estimate.inflight(schedule, p, microbatches)
    problem = to_problem(
        g, units, cluster, inflight=held, param_numel=numel, state_bytes_per_param=state_bytes_per_param,
        param_aliases=traced.param_aliases,
    )
    if method == "manual":
        part = alg.manual(problem, _cuts_for(split_points or (), units, g))
    else:
        part = getattr(alg, method)(problem)
        if refine and method == "exact" and p > 1:
            better = alg.refine(problem, part)
            if alg.evaluate(problem, better.assignment).bottleneck < alg.evaluate(problem, part.assignment).bottleneck:
                part = better
    t3 = time.perf_counter()
    log.info(
        "partition: trace %.2fs (%s), cost %.2fs, %d units, partition %.3fs (%s)",
        t1 - t0, traced.method, t2 - t1, len(units), t3 - t2, part.method,
    )
    stage_of = {v: part.assignment[u.index] for u in units for v in u.nodes}
    staged = split_graph(
        traced.gm, stage_of, p,
        param_aliases=traced.param_aliases, persistent_buffers=_persistent_names(model),
    )
    return _make_plan(
        traced=traced, model=model, g=g, units=units, problem=problem, assignment=part.assignment,
        method=part.method, cluster=cluster, schedule=schedule, microbatches=microbatches,
        granularity=granularity, numel=numel, state_bytes_per_param=state_bytes_per_param,
        staged_io=tuple(staged.io), shared=staged.shared_params,
    )


def _make_plan(
    *, traced: Any, model: nn.Module, g: Any, units: Sequence[Unit], problem: alg.Problem,
    assignment: Sequence[int], method: str, cluster: Cluster, schedule: str, microbatches: int,
    granularity: str, numel: Mapping[str, int], state_bytes_per_param: float,
    staged_io: tuple[Any, ...], shared: Mapping[str, tuple[int, ...]],
) -> Plan:
    p = len(cluster)
    ev = alg.evaluate(problem, tuple(assignment))
    held = estimate.inflight(schedule, p, microbatches)
    # layer_depth only looks at distinct paths; a 175B GPT-2 has ~4k nodes but ~1k paths.
    depth = layer_depth(list(dict.fromkeys(g.nodes[v]["module"] for v in g.nodes)))
    # Every stage's nodes in one pass over the units (not one pass per stage: p x n at scale).
    canon = canonical_names(traced.param_aliases)
    by_stage: list[list[str]] = [[] for _ in range(p)]
    for u in units:
        by_stage[assignment[u.index]].extend(u.nodes)
    stages: list[StagePlan] = []
    for s in range(p):
        nodes = by_stage[s]
        nodes.sort(key=lambda v: g.nodes[v]["order"])
        dev = cluster.devices[s]
        costs = [g.nodes[v]["cost"] for v in nodes]
        names = {canon.get(name, name) for c in costs for name in c.param_names}
        params = sum(numel.get(name, 0) for name in names)
        memory = (
            params * state_bytes_per_param
            + sum(c.buffer_bytes for c in costs)
            + held[s] * sum(c.saved_bytes for c in costs)
        )
        times = [node_time(c, dev) for c in costs]
        stages.append(
            StagePlan(
                index=s,
                device=dev.name,
                nodes=tuple(nodes),
                modules=module_range([".".join(g.nodes[v]["module"].split(".")[:depth]) for v in nodes]),
                params=int(params),
                fwd_flops=float(sum(c.fwd_flops for c in costs)),
                bwd_flops=float(sum(c.bwd_flops for c in costs)),
                memory=float(memory),
                capacity=float(dev.memory),
                inflight=held[s],
                fwd_time=float(sum(f for f, _ in times)),
                bwd_time=float(sum(b for _, b in times)),
                comm_in_time=float(ev.transfer_in[s]),
                comm_out_time=float(ev.transfer_out[s]),
                send_bytes=float(ev.boundary_bytes[s]) if s < p - 1 else 0.0,
            )
        )
    f = [st.fwd_time + (st.comm_in_time + st.comm_out_time) / 2 for st in stages]
    b = [st.bwd_time + (st.comm_in_time + st.comm_out_time) / 2 for st in stages]
    preds = tuple(
        Prediction(k, microbatches, estimate.step_time(k, f, b, microbatches),
                   estimate.bubble_fraction(k, f, b, microbatches))
        for k in estimate.SCHEDULES
    )
    return Plan(
        stages=tuple(stages),
        method=method,
        schedule=schedule,
        microbatches=microbatches,
        granularity=granularity,
        bottleneck=max(st.time for st in stages),
        lower_bound=alg.lower_bound(problem),
        predictions=preds,
        cluster=cluster,
        state_bytes_per_param=state_bytes_per_param,
        fingerprint=traced.fingerprint(),
        trace_method=traced.method,
        input_names=tuple(traced.input_names),
        io=staged_io,
        shared_params=tuple(sorted((k, tuple(v)) for k, v in shared.items())),
        param_aliases=tuple(sorted((k, tuple(v)) for k, v in traced.param_aliases.items())),
        _binding=_Binding(traced, _persistent_names(model)),
    )


def _cuts_for(split_points: Sequence[str], units: Sequence[Unit], g: Any) -> list[int]:
    """Unit positions where each named module's first node sits (a stage begins there)."""
    known: list[str] = []
    cuts: list[int] = []
    for sp in split_points:
        pos = None
        for u in units:
            mods = [g.nodes[v]["module"] for v in u.nodes]
            if any(m == sp or m.startswith(sp + ".") for m in mods):
                pos = u.index
                break
        if pos is None:
            if not known:
                known = sorted({g.nodes[v]["module"] for v in g.nodes} - {""})
            close = difflib.get_close_matches(sp, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; modules look like {known[:4]}"
            raise SplitPointError(f"split point {sp!r} names no module of the traced graph{hint}")
        if pos == 0:
            raise SplitPointError(
                f"split point {sp!r} starts at the first node, which would leave stage 0 empty; "
                "name the module where the SECOND stage begins"
            )
        cuts.append(pos)
    if cuts != sorted(set(cuts)):
        raise SplitPointError(
            f"split points {list(split_points)} are not in model order (they start at units {cuts}); "
            "list them in the order the model runs them, without duplicates"
        )
    return cuts

