"""``partition()``: trace, cost, cut and describe a model in one call."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from partitioner import algorithms as alg
from partitioner.cost.costs import NodeCost, cost_graph, node_time
from partitioner.cost.devices import Cluster
from partitioner.cost.exchange import Collective
from partitioner.cost.graph import (
    Unit,
    build_graph,
    canonical_names,
    group_units,
    layer_depth,
    module_range,
    to_problem,
)
from partitioner.cost.nodecost import scale_cost, wgrad_time
from partitioner.cost.precision import with_precision
from partitioner.cost.recompute import (
    choose_recompute,
    cut_recomputing,
    note_user_checkpoints,
    recomputing_problem,
    stage_input_bytes,
)
from partitioner.errors import InfeasibleMemoryError, PartitionOptionError, SplitPointError, TooManyStagesError
from partitioner.inference.cut import GenerationCut, cut_for_generation
from partitioner.options import METHODS, Capture, Costing, Cut, PlannerOptions, resolve_options
from partitioner.plan.capacity import StateBound, refused
from partitioner.plan.choose import choose, microbatch_candidates
from partitioner.plan.placement import per_stage_capacity, stage_cluster
from partitioner.plan.plan import Plan
from partitioner.plan.predict import predict
from partitioner.plan.records import StagePlan, binding, structure_text
from partitioner.plan.split import split_graph
from partitioner.schedule.ir import Schedule
from partitioner.schedule.registry import (
    TRAINING_SCHEDULES,
    check_schedule_size,
    stage_schedule,
    stages_per_rank,
)
from partitioner.schedule.validation import peak_inflight
from partitioner.tensor.split import TensorSplit, shard_costs, shard_numel
from partitioner.tracing.globalstate import preserved
from partitioner.tracing.hops import holds
from partitioner.tracing.trace import trace

__all__ = ["partition", "METHODS"]

log = logging.getLogger(__name__)


def partition(
    model: nn.Module,
    example_inputs: Sequence[Any],
    num_stages: int | None = None,
    *,
    cluster: Cluster | None = None,
    cut: Cut | None = None,
    capture: Capture | None = None,
    costing: Costing | None = None,
    **legacy: Any,
) -> Plan:
    """Cut ``model`` into pipeline stages and return the plan.

    Args:
        model: the model; it may live on ``meta`` (nothing is allocated for tracing and costing).
        example_inputs: inputs (positional), real, fake or meta tensors: one micro-batch, or
            the whole batch with ``Capture(example_is='batch')``. Costs are per micro-batch either
            way. The plan trains any batch that divides into its micro-batches: the trace leaves
            the batch dimension free (and, for torch.export, integer inputs' sequence length,
            where the model allows it).
        num_stages: stages to cut; defaults to the cluster's size (times 2 for the schedules that
            put two stages on each device). With ``schedule='auto'`` it is the device count.
            With split points and no cluster: one more than the split points.
        cluster: the devices in pipeline order; defaults to ``Cluster.uniform(p, "cpu")``.
        cut: the schedule and micro-batches the plan is for, and how the cut is chosen
            (:class:`~partitioner.options.Cut`; default ``Cut()``: ``1f1b``, 8 micro-batches, exact).
        capture: how the model is captured and into which units (:class:`~partitioner.options.Capture`).
        costing: how the graph is priced: precision, recomputation, state bytes, profiling
            (:class:`~partitioner.options.Costing`); with ``Costing(inference=Inference(batch=B,
            max_len=L))`` the plan is for generation (a Hugging Face decoder, the example one prompt):
            weights, key/value cache and working memory per stage, cut for the slowest decode step,
            ``plan.inference`` says how many sequences fit (docs/generate.md, "What the planner counts").
        **legacy: the keywords ``partition`` took before the objects (``microbatches=8``,
            ``schedule='zbh1'``, ``precision='bf16'``, ``split_points=[...]``...), for one release:
            ``partitioner.options.SHORTCUTS`` says which object and field each sets.

    A Hugging Face ``transformers`` model is passed as it is (``partitioner.tracing.hf``): traced
    with its cache off, its stages keep its parameter names (so ``weights=`` its own
    ``save_pretrained`` folder loads with no prefix), and the last stage returns its
    ``ModelOutput`` (``loss_fn(out, target)`` reads ``out.logits``, or ``out.loss`` when
    ``labels`` is an input). The model and its config are left as they were.

    Returns:
        A bound ``Plan``: ``print(plan)``, ``plan.save(...)``, ``plan.build_stages()``.

    Raises:
        TraceError: the model could not be captured.
        TooManyStagesError: more stages than units.
        InfeasibleMemoryError: no cut fits the devices' memory.
        SplitPointError: a split point names no module, or they are out of order.
        PartitionOptionError: an argument has a value ``partition`` does not take (an unknown method,
            schedule, granularity, precision or recompute option; a stage count that is not positive
            or does not fit the schedule; ``microbatches`` not a positive int or ``'auto'``; an old
            keyword beside the object that holds it); a ``ValueError``.
        PlannerKeywordError: a keyword ``partition`` does not take (a ``TypeError``).
        ScheduleSizeError: ``num_stages * microbatches`` would make a schedule of more than
            ``partitioner.schedule.generators.MAX_ACTIONS`` actions; raised before tracing.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from partitioner import partition, Cluster, Cut, Costing
        >>> m = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
        >>> plan = partition(m, (torch.randn(8, 32),), 3, cluster=Cluster.uniform(3, "cpu"))
        >>> len(plan.stages), sum(len(st.nodes) for st in plan.stages)
        (3, 6)
        >>> plan.bottleneck >= plan.lower_bound
        True
        >>> plan = partition(m, (torch.randn(8, 32),), 2, cut=Cut(schedule="zbh1", microbatches=4),
        ...                  costing=Costing(precision="bf16"))
        >>> plan.schedule, plan.microbatches, plan.precision
        ('zbh1', 4, 'bf16')
    """
    opts = resolve_options("partition", {"cut": cut, "capture": capture, "costing": costing}, legacy)
    with preserved(model, what="partition()"):
        return _partition(model, example_inputs, num_stages, cluster, opts)


def _partition(
    model: nn.Module, example_inputs: Sequence[Any], num_stages: int | None, cluster: Cluster | None,
    opts: PlannerOptions,
) -> Plan:
    cut = opts.cut
    opts = replace(opts, capture=opts.capture.for_model(model))
    devices = len(cluster) if cluster is not None else None
    if num_stages is None and devices is None and cut.split_points is not None:
        num_stages = len(cut.split_points) + 1  # each split point begins a stage after the first
    if num_stages is None and devices is None:
        raise PartitionOptionError("give num_stages or a cluster (one device per stage)")
    if num_stages is not None and num_stages < 1:
        raise PartitionOptionError(f"num_stages must be at least 1, got {num_stages}")
    if opts.costing.inference is not None:
        if cut.auto:
            raise PartitionOptionError(
                f"Costing(inference=...) plans generation, which has no training schedule to choose: drop "
                f"Cut(schedule={cut.schedule!r}, microbatches={cut.microbatches!r}) (leave them at their defaults)"
            )
        ctx = _context(model, example_inputs, opts, 1)
        stages = num_stages if num_stages is not None else devices
        assert stages is not None  # checked above: num_stages or a cluster
        return ctx.for_generation(stage_cluster(cluster, stages, "forward"))
    if not cut.auto:  # before tracing: a schedule too large to build is refused at once
        assert isinstance(cut.microbatches, int)  # checked by Cut
        stages = num_stages if num_stages is not None else (devices or 1) * stages_per_rank(cut.schedule)
        check_schedule_size(cut.schedule, stages, cut.microbatches)

    ctx = _context(model, example_inputs, opts, _example_microbatches(opts.capture.example_is, cut.microbatches))
    if cut.auto:
        p = len(cluster) if cluster is not None else num_stages
        assert p is not None
        schedules = TRAINING_SCHEDULES if cut.schedule == "auto" else (cut.schedule,)
        ms = microbatch_candidates(p) if cut.microbatches == "auto" else (int(cut.microbatches),)

        def price(sched: str, stages: int, m: int, split: bool) -> Plan:
            return ctx.plan(stage_cluster(cluster, stages, sched), sched, m, split=split)

        try:
            return choose(price, p, schedules, ms)
        except InfeasibleMemoryError as e:  # the bound it breaks, and what would fit
            raise refused(e, ctx.state_bound(cluster, p)) from None
    assert isinstance(cut.microbatches, int)  # checked by Cut: not auto
    if num_stages is not None:
        stages = num_stages
    else:
        assert devices is not None  # checked above: num_stages or a cluster
        stages = devices * stages_per_rank(cut.schedule)
    try:
        return ctx.plan(stage_cluster(cluster, stages, cut.schedule), cut.schedule, cut.microbatches, split=True)
    except InfeasibleMemoryError as e:
        raise refused(e, ctx.state_bound(cluster, stages // stages_per_rank(cut.schedule))) from None


def _context(
    model: nn.Module, example_inputs: Sequence[Any], opts: PlannerOptions, example_microbatches: int
) -> _Context:
    """Trace and cost ``model`` once (``opts.capture`` decided for it): what every candidate cut of it starts from."""
    capture, costing = opts.capture, opts.costing
    assert capture.granularity is not None  # Capture.for_model decided it
    t0 = time.perf_counter()
    traced = trace(
        model, tuple(example_inputs), example_kwargs=dict(capture.example_kwargs or {}),
        leaf_modules=capture.leaf_modules, method=capture.method, example_microbatches=example_microbatches,
    )
    t1 = time.perf_counter()
    note_user_checkpoints(traced.checkpointed, costing.recompute)
    costs = with_precision(
        traced.gm, cost_graph(traced, profile=costing.profile, device=costing.profile_device), costing.precision
    )
    t2 = time.perf_counter()
    g = build_graph(traced.gm, costs, traced.module_path)
    units = group_units(g, capture.granularity, capture.module_depth)
    log.info("partition: trace %.2fs (%s), cost %.2fs, %d units", t1 - t0, traced.method, t2 - t1, len(units))
    return _Context(
        model=model, traced=traced, g=g, units=units, costs=costs, opts=opts,
        numel={name: prm.numel() for name, prm in traced.gm.named_parameters(remove_duplicate=False)},
    )


@dataclass(frozen=True)
class _Found:
    """What one cut of a context produced, for the plan to describe: the problem it solved and its answer."""

    cluster: Cluster
    schedule: str
    microbatches: int
    problem: alg.Problem
    assignment: Sequence[int]
    method: str
    held: Sequence[int]  # micro-batches each stage holds at its peak under the schedule
    forward: Sequence[Sequence[float]]  # per stage, per unit, forward seconds (what recomputation repeats)
    built: Schedule | None
    io: tuple[Any, ...] = ()
    shared: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class _Context:
    """A traced, costed model and the options that stay fixed while candidate plans are tried."""

    model: nn.Module
    traced: Any
    g: Any
    units: list[Unit]
    costs: Mapping[str, NodeCost]
    numel: dict[str, int]
    opts: PlannerOptions  # the capture decided for the model; the cut's method, refine and split points
    # Shared by the copies ``scaled`` and ``sharded`` make: the traced graph's fingerprint, hashed once
    # (hashing a 175B GPT-2's graph for every layout priced took a third of the search).
    memo: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def fingerprint(self) -> str:
        """The traced graph's fingerprint (``TracedModel.fingerprint``), computed once per trace."""
        if "fingerprint" not in self.memo:
            self.memo["fingerprint"] = self.traced.fingerprint()
        return self.memo["fingerprint"]

    @property
    def granularity(self) -> str:
        """The units' granularity (``Capture.for_model`` decided it)."""
        assert self.opts.capture.granularity is not None
        return self.opts.capture.granularity

    @property
    def state_bytes_per_param(self) -> float:
        """Training state bytes per parameter element the cuts are costed with."""
        return self.opts.costing.state_bytes_per_param

    @property
    def params(self) -> float:
        """Parameters of the model, each tensor once (tied ones too)."""
        once = {name for name, _ in self.traced.gm.named_parameters()}
        return float(sum(self.numel.get(n, 0) for n in once))

    def state_bound(self, cluster: Cluster | None, devices: int) -> StateBound:
        """The training state against ``devices`` devices of ``cluster`` (default ``cpu``), one pipeline."""
        used = cluster.with_devices(devices) if cluster is not None else Cluster.uniform(devices, "cpu")
        return StateBound.of(used, self.params, self.state_bytes_per_param, max_pp=len(self.units))

    def scaled(self, factor: float) -> _Context:
        """The same model costed for micro-batches ``factor`` times as large (``scale_cost``)."""
        if factor == 1:
            return self
        costs = {name: scale_cost(c, factor) for name, c in self.costs.items()}
        g = build_graph(self.traced.gm, costs, self.traced.module_path)
        return replace(self, g=g, units=group_units(g, self.granularity, self.opts.capture.module_depth), costs=costs)

    def sharded(self, found: TensorSplit, tp: int, ring: Collective, factor: float = 1.0) -> _Context:
        """One tensor-parallel rank's view of this context (``partitioner.tensor.split``) at micro-batches
        ``factor`` times as large (as :meth:`scaled`, the graph built once): its costs and parameter
        counts split over ``tp``, the all-reduces on ``ring`` in its nodes' times, and no cut between
        a column layer and its row layer (a split value cannot cross a stage boundary)."""
        if tp == 1:
            return self.scaled(factor)
        inputs = {name: float(nbytes) for name, (_, nbytes) in self.g.graph["inputs"].items()}
        whole = self.costs if factor == 1 else {name: scale_cost(c, factor) for name, c in self.costs.items()}
        costs = shard_costs(whole, found, tp, ring, inputs)
        g = build_graph(self.traced.gm, costs, self.traced.module_path)
        for v in found.split:
            if v in g:
                g.nodes[v]["crossable"] = False
        units = group_units(g, self.granularity, self.opts.capture.module_depth)
        return replace(self, g=g, units=units, costs=costs, numel=shard_numel(self.numel, found, tp))

    def with_state_bytes(self, state_bytes_per_param: float) -> _Context:
        """The same context with the training state costed at ``state_bytes_per_param`` (a sharded layout's)."""
        costing = replace(self.opts.costing, state_bytes_per_param=state_bytes_per_param)
        return replace(self, opts=replace(self.opts, costing=costing))

    def plan(
        self, cluster: Cluster, schedule: str, m: int, *, split: bool, predictions: bool = True,
        built: Schedule | None = None,
    ) -> Plan:
        """Cut into ``len(cluster)`` stages for ``schedule`` with ``m`` micro-batches.

        ``split=False`` skips building the stage wiring (for candidates that are only priced);
        ``predictions=False`` skips simulating the schedules (the layout search simulates its own).
        """
        p = len(cluster)
        if p > len(self.units):
            raise TooManyStagesError(p, len(self.units), self.granularity)
        built = built or stage_schedule(schedule, p, m)  # built and checked once: its memory count, then its prediction
        held = peak_inflight(built)
        problem = to_problem(
            self.g, self.units, per_stage_capacity(cluster, schedule), inflight=held,
            param_numel=self.numel, state_bytes_per_param=self.state_bytes_per_param,
            param_aliases=self.traced.param_aliases,
        )
        t0 = time.perf_counter()
        forward = self._forward_rows(cluster)
        recompute = self.opts.costing.recompute
        if recompute is True:
            part = cut_recomputing(problem, forward, self._solve)
        else:
            try:
                part = self._solve(problem)
            except InfeasibleMemoryError:
                if recompute is False:
                    raise
                # Memory binds: cut again for stages that keep only their inputs per micro-batch.
                log.info("partition: %d stages, %s, m=%d: no cut fits; trying recomputation", p, schedule, m)
                part = cut_recomputing(problem, forward, self._solve)
        log.info("partition: %d stages, %s, m=%d: %.3fs (%s)", p, schedule, m, time.perf_counter() - t0, part.method)
        found = _Found(cluster, schedule, m, problem, part.assignment, part.method, held, forward, built)
        if split:
            found = self._wired(found)
        return _make_plan(self, found, predictions=predictions)

    def for_generation(self, cluster: Cluster) -> Plan:
        """Cut into ``len(cluster)`` stages for generation (``Costing.inference``; ``partitioner.inference``)."""
        p = len(cluster)
        if p > len(self.units):
            raise TooManyStagesError(p, len(self.units), self.granularity)
        costing = self.opts.costing
        gen = cut_for_generation(self.model, self.traced, self.g, self.units, cluster, inference=costing.inference,
                                 precision=costing.precision, numel=self.numel, solve=self._solve)
        found = _Found(cluster, "forward", 1, gen.problem, gen.assignment, gen.method, (0,) * p, (), None)
        return _make_plan(self, self._wired(found), predictions=False, generation=gen)

    def _wired(self, found: _Found) -> _Found:
        """``found`` with the stage wiring: what crosses each cut (``split_graph``)."""
        p = len(found.cluster)
        stage_of = {v: found.assignment[u.index] for u in self.units for v in u.nodes}
        bound = binding(self.traced, self.model)
        staged = split_graph(
            self.traced.gm, stage_of, p, param_aliases=self.traced.param_aliases,
            persistent_buffers=bound.persistent, model_state=bound.state,
        )
        return replace(found, io=tuple(staged.io), shared=staged.shared_params)

    def _solve(self, problem: alg.Problem) -> alg.Partition:
        """The cut ``method`` finds (refined for ``'exact'``)."""
        cut = self.opts.cut
        if cut.method == "manual":
            return alg.manual(problem, _cuts_for(cut.split_points or (), self.units, self.g))
        part: alg.Partition = getattr(alg, cut.method)(problem)
        if cut.refine and cut.method == "exact" and problem.p > 1:
            better = alg.refine(problem, part)
            before = alg.evaluate(problem, part.assignment).bottleneck
            if alg.evaluate(problem, better.assignment).bottleneck < before:
                part = better
        return part

    def _forward_rows(self, cluster: Cluster) -> tuple[tuple[float, ...], ...]:
        """Per stage, per unit, forward seconds on the stage's device (what recomputation repeats)."""
        rows: dict[Any, tuple[float, ...]] = {}
        for dev in cluster.devices:
            if dev not in rows:
                rows[dev] = tuple(
                    sum(node_time(self.g.nodes[v]["cost"], dev)[0] for v in u.nodes) for u in self.units
                )
        return tuple(rows[dev] for dev in cluster.devices)


def _example_microbatches(example_is: str, microbatches: int | str) -> int:
    """How many micro-batches the example holds (1, or ``m`` for a whole-batch example)."""
    if example_is == "microbatch":
        return 1
    if not isinstance(microbatches, int):
        raise PartitionOptionError(
            "example_is='batch' needs microbatches as an int, to know the micro-batch size the "
            f"costs are for (got microbatches={microbatches!r}); or pass one micro-batch as the example"
        )
    return microbatches


def _stage_nodes(g: Any, units: Sequence[Unit], assignment: Sequence[int], p: int) -> list[list[str]]:
    """Every stage's nodes in graph order, in one pass over the units (not one per stage: p x n at scale)."""
    by_stage: list[list[str]] = [[] for _ in range(p)]
    for u in units:
        by_stage[assignment[u.index]].extend(u.nodes)
    for nodes in by_stage:
        nodes.sort(key=lambda v: g.nodes[v]["order"])
    return by_stage


def _stage_plans(ctx: _Context, found: _Found) -> list[StagePlan]:
    """Per stage of the cut: its nodes and modules, summed costs, transfers, memory and whether it recomputes."""
    traced, g, numel, cluster, problem = ctx.traced, ctx.g, ctx.numel, found.cluster, found.problem
    assignment, held, recompute = found.assignment, found.held, ctx.opts.costing.recompute
    p = len(cluster)
    ev = alg.evaluate(problem, tuple(assignment))
    ins = stage_input_bytes(problem, assignment)
    # layer_depth only looks at distinct paths; a 175B GPT-2 has ~4k nodes but ~1k paths.
    depth = layer_depth(list(dict.fromkeys(g.nodes[v]["module"] for v in g.nodes)))
    canon = canonical_names(traced.param_aliases)
    stages: list[StagePlan] = []
    for s, nodes in enumerate(_stage_nodes(g, ctx.units, assignment, p)):
        dev = cluster.devices[s]
        costs = [g.nodes[v]["cost"] for v in nodes]
        names = {canon.get(name, name) for c in costs for name in c.param_names}
        params = sum(numel.get(name, 0) for name in names)
        state = params * ctx.state_bytes_per_param + sum(c.buffer_bytes for c in costs)
        act = sum(c.saved_bytes for c in costs)
        (rc,) = choose_recompute([state], [act], [ins[s]], [held[s]], [problem.capacity[s]], recompute)
        if not rc and recompute is not False and traced.checkpointed:  # the model's own checkpointing
            rc = any(holds(g.nodes[v]["module"], traced.checkpointed) for v in nodes)
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
                memory=float(state + held[s] * ins[s] + act if rc else state + held[s] * act),
                capacity=float(dev.usable_memory),
                inflight=held[s],
                fwd_time=float(sum(f for f, _ in times)),
                bwd_time=float(sum(b for _, b in times)),
                comm_in_time=float(ev.transfer_in[s]),
                comm_out_time=float(ev.transfer_out[s]),
                send_bytes=float(ev.boundary_bytes[s]) if s < p - 1 else 0.0,
                wgrad_time=float(sum(wgrad_time(c, b) for c, (_, b) in zip(costs, times))),
                act_bytes=float(act),
                state_bytes=float(state),
                in_bytes=float(ins[s]),
                recompute=rc,
            )
        )
    return stages


def _make_plan(ctx: _Context, found: _Found, *, predictions: bool, generation: GenerationCut | None = None) -> Plan:
    """The Plan of a cut: its stages, the bound and predictions, and what it takes to build the stages again
    (``generation``: a cut for generation, whose stages it priced)."""
    traced, cluster, schedule, microbatches = ctx.traced, found.cluster, found.schedule, found.microbatches
    problem, forward, built = found.problem, found.forward, found.built
    stages = list(generation.stages) if generation is not None else _stage_plans(ctx, found)
    if any(st.recompute for st in stages):
        log.info("partition: stages %s recompute their activations", [st.index for st in stages if st.recompute])
    # With every stage recomputing, each unit's forward runs twice: the bound counts it too.
    everywhere = forward and all(st.recompute for st in stages)
    bound = alg.lower_bound(recomputing_problem(problem, forward) if everywhere else problem)
    # The plan's schedule first, then every other schedule with the same placement (one stage
    # per device); a two-chunk placement's links are its own, so it is predicted alone.
    same = [k for k in TRAINING_SCHEDULES if k != schedule and stages_per_rank(k) == 1 == stages_per_rank(schedule)]
    preds = tuple(
        predict(stages, cluster, k, microbatches, built=built if k == schedule else None) for k in (schedule, *same)
    ) if predictions else ()
    return Plan(
        stages=tuple(stages),
        method=found.method,
        schedule=schedule,
        microbatches=microbatches,
        granularity=ctx.granularity,
        bottleneck=max(st.time for st in stages),
        lower_bound=bound,
        predictions=preds,
        cluster=cluster,
        state_bytes_per_param=generation.dtype_bytes if generation is not None else ctx.state_bytes_per_param,
        fingerprint=ctx.fingerprint,
        trace_method=traced.method,
        input_names=tuple(traced.input_names),
        io=found.io,
        shared_params=tuple(sorted((k, tuple(v)) for k, v in found.shared.items())),
        param_aliases=tuple(sorted((k, tuple(v)) for k, v in traced.param_aliases.items())),
        precision=ctx.opts.costing.precision,
        output_structure=structure_text(traced.out_spec),
        inference=generation.summary if generation is not None else None,
        _binding=binding(traced, ctx.model),
    )


def _cuts_for(split_points: Sequence[str], units: Sequence[Unit], g: Any) -> list[int]:
    """Unit positions where each named module's first node sits (a stage begins there).

    A split point is a module's full name or any unambiguous dot-boundary end of it
    (``alg.resolve_split_point``)."""
    paths = {g.nodes[v]["module"] for v in g.nodes}
    known = {".".join(p.split(".")[:i]) for p in paths for i in range(1, p.count(".") + 2)}
    cuts: list[int] = []
    for written in split_points:
        sp = alg.resolve_split_point(written, known)
        pos = None
        for u in units:
            mods = [g.nodes[v]["module"] for v in u.nodes]
            if any(m == sp or m.startswith(sp + ".") for m in mods):
                pos = u.index
                break
        assert pos is not None  # sp is the prefix of some node's module
        if pos == 0:
            raise SplitPointError(
                f"split point {written!r} ({sp}) starts at the first node, which would leave stage 0 empty; "
                "name the module where the SECOND stage begins"
            )
        cuts.append(pos)
    if cuts != sorted(set(cuts)):
        raise SplitPointError(
            f"split points {list(split_points)} are not in model order (they start at units {cuts}); "
            "list them in the order the model runs them, without duplicates"
        )
    return cuts

