"""``partition()``: trace, cost, cut and describe a model in one call."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from partitioner import algorithms as alg
from partitioner.cost.costs import NodeCost, cost_graph, node_time, weight_share
from partitioner.cost.devices import Cluster
from partitioner.cost.graph import (
    Unit,
    build_graph,
    canonical_names,
    group_units,
    layer_depth,
    module_range,
    to_problem,
)
from partitioner.cost.nodecost import scale_cost
from partitioner.cost.precision import check_precision, with_precision
from partitioner.cost.recompute import (
    check_option,
    choose_recompute,
    cut_recomputing,
    note_user_checkpoints,
    recomputing_problem,
    stage_input_bytes,
)
from partitioner.errors import InfeasibleMemoryError, PartitionOptionError, SplitPointError, TooManyStagesError
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
from partitioner.tracing.globalstate import preserved
from partitioner.tracing.hf import block_depth, is_hf_model
from partitioner.tracing.hops import holds
from partitioner.tracing.trace import Method as TraceMethod
from partitioner.tracing.trace import trace

__all__ = ["partition", "METHODS"]

log = logging.getLogger(__name__)

METHODS = ("exact", "equal_count", "balanced_params", "equal_size", "manual")


def partition(
    model: nn.Module,
    example_inputs: Sequence[Any],
    num_stages: int | None = None,
    *,
    cluster: Cluster | None = None,
    microbatches: int | str = 8,
    schedule: str = "1f1b",
    method: str = "exact",
    refine: bool = True,
    split_points: Sequence[str] | None = None,
    granularity: str | None = None,
    module_depth: int | None = None,
    leaf_modules: Sequence[type | str] = (),
    state_bytes_per_param: float = 16.0,
    profile: bool = False,
    profile_device: str | torch.device | None = None,
    trace_method: TraceMethod = "auto",
    example_kwargs: Mapping[str, Any] | None = None,
    example_is: str = "microbatch",
    precision: str = "fp32",
    recompute: bool | str = "auto",
) -> Plan:
    """Cut ``model`` into pipeline stages and return the plan.

    Args:
        model: the model; it may live on ``meta`` (nothing is allocated for tracing and costing).
        example_inputs: inputs (positional), real, fake or meta tensors: one micro-batch, or
            the whole batch with ``example_is='batch'``. Costs are per micro-batch either way.
            The plan trains any batch that divides into its micro-batches: the trace leaves
            the batch dimension free (and, for torch.export, integer inputs' sequence length,
            where the model allows it).
        num_stages: stages to cut; defaults to the cluster's size (times 2 for the schedules that
            put two stages on each device). With ``schedule='auto'`` it is the device count.
            With ``split_points`` and no cluster: one more than the split points.
        cluster: the devices in pipeline order; defaults to ``Cluster.uniform(p, "cpu")``.
        microbatches: ``m``, micro-batches per optimizer step (sets activation memory in flight),
            or ``'auto'`` to try ``p, 2p, 4p, 8p``.
        schedule: ``'1f1b'``, ``'gpipe'``, ``'zbh1'``, ``'interleaved'`` or ``'zbv'`` (the last
            two place two stages per device); it decides how many micro-batches each stage
            holds. ``'auto'`` prices every schedule with the simulator and keeps the fastest
            that fits (``plan.candidates``, ``plan.choice``).
        method: ``'exact'`` (optimal contiguous cut), or a baseline: ``'equal_count'``,
            ``'balanced_params'``, ``'equal_size'``; ``'manual'`` with ``split_points``.
        refine: after a contiguous cut, move boundary nodes between neighbouring stages while
            the bottleneck falls (helps DAGs whose best cut is not contiguous in one order).
        split_points: module names where new stages begin (implies ``method='manual'``): a full
            name or any unambiguous end of one at a dot (``'h.4'`` for ``'transformer.h.4'``).
        granularity: ``'node'`` cuts anywhere; ``'module'`` only between layers. Default:
            ``'module'`` at the depth of the transformer blocks for a Hugging Face model (its
            ``_no_split_modules``, e.g. each of ``model.layers``: a block is never cut), else
            ``'node'``.
        module_depth: with ``granularity='module'``, the module depth of a layer (auto).
        leaf_modules: module classes or names that tracing keeps whole.
        state_bytes_per_param: bytes of weights + grads + optimizer state per parameter element.
        profile: measure each node's time on ``profile_device`` instead of the roofline.
        profile_device: device for ``profile=True`` (default: CUDA if available, else CPU).
        trace_method: ``'auto'``, ``'fx'`` or ``'export'`` (``'auto'`` is export for a Hugging
            Face model).
        example_kwargs: keyword inputs for tracing (``attention_mask``, ``labels``,
            ``pixel_values``, ``decoder_input_ids``...): graph inputs after the positional ones,
            named by their keys; the trainer takes them the same way (``trainer.step({...}, y)``).
        example_is: ``'microbatch'`` (the example is one micro-batch) or ``'batch'`` (it is the
            whole batch of ``microbatches`` micro-batches along dimension 0; needs an int
            ``microbatches``).
        precision: the mixed-precision policy the plan is costed for (and trains with by
            default): ``'fp32'``, ``'bf16'`` or ``'fp16'`` (autocast, fp32 master weights; see
            ``partitioner.cost.precision``): low-precision matmuls at the 16-bit peak, activations
            saved and sent in half the bytes, training state unchanged.
        recompute: activation recomputation per stage (``runtime.execute.recompute``; the plan records
            it in ``StagePlan.recompute`` and the trainer follows it). ``'auto'`` (default):
            only when memory binds, i.e. no cut fits the devices with every micro-batch's
            activations held, cut for recomputing stages and turn it on for the stages that do
            not fit without it (with ``microbatches='auto'`` / ``schedule='auto'`` every
            candidate is priced that way, so more micro-batches can fit); a plan that fits is
            unchanged. ``True``: every stage recomputes; ``False``: none.

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
            or does not fit the schedule; ``microbatches`` not a positive int or ``'auto'``); a
            ``ValueError``.
        ScheduleSizeError: ``num_stages * microbatches`` would make a schedule of more than
            ``partitioner.schedule.generators.MAX_ACTIONS`` actions; raised before tracing.

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
    with preserved(model, what="partition()"):
        return _partition(
            model, example_inputs, num_stages, cluster=cluster, microbatches=microbatches,
            schedule=schedule, method=method, refine=refine, split_points=split_points,
            granularity=granularity, module_depth=module_depth, leaf_modules=leaf_modules,
            state_bytes_per_param=state_bytes_per_param, profile=profile,
            profile_device=profile_device, trace_method=trace_method, example_kwargs=example_kwargs,
            example_is=example_is, precision=precision, recompute=recompute,
        )


def _partition(
    model: nn.Module,
    example_inputs: Sequence[Any],
    num_stages: int | None,
    *,
    cluster: Cluster | None,
    microbatches: int | str,
    schedule: str,
    method: str,
    refine: bool,
    split_points: Sequence[str] | None,
    granularity: str | None,
    module_depth: int | None,
    leaf_modules: Sequence[type | str],
    state_bytes_per_param: float,
    profile: bool,
    profile_device: str | torch.device | None,
    trace_method: TraceMethod,
    example_kwargs: Mapping[str, Any] | None,
    example_is: str,
    precision: str,
    recompute: bool | str = "auto",
) -> Plan:
    check_precision(precision)
    recompute = check_option(recompute)
    if granularity is None:  # a Hugging Face model's blocks stay whole; anything else cuts anywhere
        depth = block_depth(model) if is_hf_model(model) else None
        granularity, module_depth = ("module", module_depth or depth) if depth else ("node", module_depth)
    if split_points is not None:
        method = "manual"
    if method not in METHODS:
        raise PartitionOptionError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "manual" and split_points is None:
        raise SplitPointError("method='manual' needs split_points=[module names where stages begin]")
    auto = schedule == "auto" or microbatches == "auto"
    if not auto:
        _check_schedule(schedule)
        if type(microbatches) is not int or microbatches < 1:  # a bool is not a count
            raise PartitionOptionError(
                f"microbatches must be a positive int or 'auto', got {microbatches!r}: pass the "
                "micro-batches per step, e.g. microbatches=8, or 'auto' to let the planner choose"
            )
    devices = len(cluster) if cluster is not None else None
    if num_stages is None and devices is None and split_points is not None:
        num_stages = len(split_points) + 1  # each split point begins a stage after the first
    if num_stages is None and devices is None:
        raise PartitionOptionError("give num_stages or a cluster (one device per stage)")
    if num_stages is not None and num_stages < 1:
        raise PartitionOptionError(f"num_stages must be at least 1, got {num_stages}")
    if not auto:  # before tracing: a schedule too large to build is refused at once
        assert isinstance(microbatches, int)  # checked above
        stages = num_stages if num_stages is not None else (devices or 1) * stages_per_rank(schedule)
        check_schedule_size(schedule, stages, microbatches)

    ctx = _context(
        model, example_inputs, example_kwargs=example_kwargs, leaf_modules=leaf_modules, trace_method=trace_method,
        example_microbatches=_example_microbatches(example_is, microbatches), profile=profile,
        profile_device=profile_device, precision=precision, granularity=granularity, module_depth=module_depth,
        method=method, refine=refine, split_points=split_points, state_bytes_per_param=state_bytes_per_param,
        recompute=recompute,
    )
    if auto:
        p = len(cluster) if cluster is not None else num_stages
        assert p is not None
        schedules = TRAINING_SCHEDULES if schedule == "auto" else (schedule,)
        if schedule != "auto":
            _check_schedule(schedule)
        ms = microbatch_candidates(p) if microbatches == "auto" else (int(microbatches),)

        def price(sched: str, stages: int, m: int, split: bool) -> Plan:
            return ctx.plan(stage_cluster(cluster, stages, sched), sched, m, split=split)

        try:
            return choose(price, p, schedules, ms)
        except InfeasibleMemoryError as e:  # the bound it breaks, and what would fit
            raise refused(e, ctx.state_bound(cluster, p)) from None
    assert isinstance(microbatches, int)  # checked above: not auto
    if num_stages is not None:
        stages = num_stages
    else:
        assert devices is not None  # checked above: num_stages or a cluster
        stages = devices * stages_per_rank(schedule)
    try:
        return ctx.plan(stage_cluster(cluster, stages, schedule), schedule, microbatches, split=True)
    except InfeasibleMemoryError as e:
        raise refused(e, ctx.state_bound(cluster, stages // stages_per_rank(schedule))) from None


def _context(
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    example_kwargs: Mapping[str, Any] | None,
    leaf_modules: Sequence[type | str],
    trace_method: TraceMethod,
    example_microbatches: int,
    profile: bool,
    profile_device: str | torch.device | None,
    precision: str,
    granularity: str,
    module_depth: int | None,
    method: str,
    refine: bool,
    split_points: Sequence[str] | None,
    state_bytes_per_param: float,
    recompute: bool | str,
) -> _Context:
    """Trace and cost ``model`` once: what every candidate cut of it starts from."""
    t0 = time.perf_counter()
    traced = trace(
        model, tuple(example_inputs), example_kwargs=dict(example_kwargs or {}),
        leaf_modules=leaf_modules, method=trace_method,
        example_microbatches=example_microbatches,
    )
    t1 = time.perf_counter()
    note_user_checkpoints(traced.checkpointed, recompute)
    costs = with_precision(traced.gm, cost_graph(traced, profile=profile, device=profile_device), precision)
    t2 = time.perf_counter()
    g = build_graph(traced.gm, costs, traced.module_path)
    units = group_units(g, granularity, module_depth)
    log.info("partition: trace %.2fs (%s), cost %.2fs, %d units", t1 - t0, traced.method, t2 - t1, len(units))
    return _Context(
        model=model, traced=traced, g=g, units=units, granularity=granularity, method=method,
        refine=refine, split_points=split_points, state_bytes_per_param=state_bytes_per_param,
        numel={name: prm.numel() for name, prm in traced.gm.named_parameters(remove_duplicate=False)},
        precision=precision,
        recompute=recompute,
        costs=costs,
        module_depth=module_depth,
    )


@dataclass
class _Context:
    """A traced, costed model and the options that stay fixed while candidate plans are tried."""

    model: nn.Module
    traced: Any
    g: Any
    units: list[Unit]
    granularity: str
    method: str
    refine: bool
    split_points: Sequence[str] | None
    state_bytes_per_param: float
    numel: dict[str, int]
    precision: str = "fp32"
    recompute: bool | str = "auto"
    costs: Mapping[str, NodeCost] = field(default_factory=dict)
    module_depth: int | None = None

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
        return replace(self, g=g, units=group_units(g, self.granularity, self.module_depth), costs=costs)

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
        if self.recompute is True:
            part = cut_recomputing(problem, forward, self._solve)
        else:
            try:
                part = self._solve(problem)
            except InfeasibleMemoryError:
                if self.recompute is False:
                    raise
                # Memory binds: cut again for stages that keep only their inputs per micro-batch.
                log.info("partition: %d stages, %s, m=%d: no cut fits; trying recomputation", p, schedule, m)
                part = cut_recomputing(problem, forward, self._solve)
        log.info("partition: %d stages, %s, m=%d: %.3fs (%s)", p, schedule, m, time.perf_counter() - t0, part.method)
        io: tuple[Any, ...] = ()
        shared: Mapping[str, tuple[int, ...]] = {}
        if split:
            stage_of = {v: part.assignment[u.index] for u in self.units for v in u.nodes}
            bound = binding(self.traced, self.model)
            staged = split_graph(
                self.traced.gm, stage_of, p, param_aliases=self.traced.param_aliases,
                persistent_buffers=bound.persistent, model_state=bound.state,
            )
            io, shared = tuple(staged.io), staged.shared_params
        return _make_plan(
            traced=self.traced, model=self.model, g=self.g, units=self.units, problem=problem,
            assignment=part.assignment, method=part.method, cluster=cluster, schedule=schedule,
            microbatches=m, held=held, granularity=self.granularity, numel=self.numel,
            state_bytes_per_param=self.state_bytes_per_param, staged_io=io, shared=shared,
            precision=self.precision, recompute=self.recompute, forward=forward, built=built,
            predictions=predictions,
        )

    def _solve(self, problem: alg.Problem) -> alg.Partition:
        """The cut ``method`` finds (refined for ``'exact'``)."""
        if self.method == "manual":
            return alg.manual(problem, _cuts_for(self.split_points or (), self.units, self.g))
        part: alg.Partition = getattr(alg, self.method)(problem)
        if self.refine and self.method == "exact" and problem.p > 1:
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
    if example_is != "batch":
        raise PartitionOptionError(f"example_is must be 'microbatch' or 'batch', got {example_is!r}")
    if not isinstance(microbatches, int):
        raise PartitionOptionError(
            "example_is='batch' needs microbatches as an int, to know the micro-batch size the "
            f"costs are for (got microbatches={microbatches!r}); or pass one micro-batch as the example"
        )
    return microbatches


def _check_schedule(schedule: str) -> None:
    if schedule not in TRAINING_SCHEDULES:
        raise PartitionOptionError(
            f"unknown schedule {schedule!r}; choose one of {', '.join(TRAINING_SCHEDULES)} or 'auto'"
        )


def _stage_nodes(g: Any, units: Sequence[Unit], assignment: Sequence[int], p: int) -> list[list[str]]:
    """Every stage's nodes in graph order, in one pass over the units (not one per stage: p x n at scale)."""
    by_stage: list[list[str]] = [[] for _ in range(p)]
    for u in units:
        by_stage[assignment[u.index]].extend(u.nodes)
    for nodes in by_stage:
        nodes.sort(key=lambda v: g.nodes[v]["order"])
    return by_stage


def _stage_plans(
    *, traced: Any, g: Any, units: Sequence[Unit], problem: alg.Problem, assignment: Sequence[int],
    cluster: Cluster, held: Sequence[int], numel: Mapping[str, int], state_bytes_per_param: float,
    recompute: bool | str,
) -> list[StagePlan]:
    """Per stage of the cut: its nodes and modules, summed costs, transfers, memory and whether it recomputes."""
    p = len(cluster)
    ev = alg.evaluate(problem, tuple(assignment))
    ins = stage_input_bytes(problem, assignment)
    # layer_depth only looks at distinct paths; a 175B GPT-2 has ~4k nodes but ~1k paths.
    depth = layer_depth(list(dict.fromkeys(g.nodes[v]["module"] for v in g.nodes)))
    canon = canonical_names(traced.param_aliases)
    stages: list[StagePlan] = []
    for s, nodes in enumerate(_stage_nodes(g, units, assignment, p)):
        dev = cluster.devices[s]
        costs = [g.nodes[v]["cost"] for v in nodes]
        names = {canon.get(name, name) for c in costs for name in c.param_names}
        params = sum(numel.get(name, 0) for name in names)
        state = params * state_bytes_per_param + sum(c.buffer_bytes for c in costs)
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
                wgrad_time=float(sum(b * weight_share(c) for c, (_, b) in zip(costs, times))),
                act_bytes=float(act),
                state_bytes=float(state),
                in_bytes=float(ins[s]),
                recompute=rc,
            )
        )
    return stages


def _make_plan(
    *, traced: Any, model: nn.Module, g: Any, units: Sequence[Unit], problem: alg.Problem,
    assignment: Sequence[int], method: str, cluster: Cluster, schedule: str, microbatches: int,
    held: Sequence[int], granularity: str, numel: Mapping[str, int], state_bytes_per_param: float,
    staged_io: tuple[Any, ...], shared: Mapping[str, tuple[int, ...]], precision: str = "fp32",
    recompute: bool | str = False, forward: Sequence[Sequence[float]] = (), built: Schedule | None = None,
    predictions: bool = True,
) -> Plan:
    """The Plan of a cut: its stages, the bound and predictions, and what it takes to build the stages again."""
    stages = _stage_plans(
        traced=traced, g=g, units=units, problem=problem, assignment=assignment, cluster=cluster, held=held,
        numel=numel, state_bytes_per_param=state_bytes_per_param, recompute=recompute,
    )
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
        method=method,
        schedule=schedule,
        microbatches=microbatches,
        granularity=granularity,
        bottleneck=max(st.time for st in stages),
        lower_bound=bound,
        predictions=preds,
        cluster=cluster,
        state_bytes_per_param=state_bytes_per_param,
        fingerprint=traced.fingerprint(),
        trace_method=traced.method,
        input_names=tuple(traced.input_names),
        io=staged_io,
        shared_params=tuple(sorted((k, tuple(v)) for k, v in shared.items())),
        param_aliases=tuple(sorted((k, tuple(v)) for k, v in traced.param_aliases.items())),
        precision=precision,
        output_structure=structure_text(traced.out_spec),
        _binding=binding(traced, model),
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

