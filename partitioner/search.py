"""``plan_layout()``: how to spend a cluster on a global batch, searched and priced, as one plan.

Legend: ``N = dp x pp x tp`` devices, ``dp`` replicas, ``pp`` ranks per pipeline, ``tp`` devices
per pipeline rank (a tensor-parallel group in one node), ``S`` stages, ``b`` rows per micro-batch,
``m`` micro-batches per replica, ``B`` the global batch, ``P`` parameters.

The model is traced and costed once, at the example's micro-batch; every other micro-batch size
scales those costs (``partitioner.cost.nodecost.scale_cost``). Each layout of
``partitioner.plan.layout.layout_space`` is priced as the runtime runs it:

* the exact cut for its ``S`` stages, with the memory its schedule holds at ``m`` micro-batches
  and its training state (optimizer state over ``dp`` with ``zero1``; with ``fsdp`` see below),
  recomputing the stages that do not fit otherwise (``recompute='auto'``);
* one step of the schedule through the event simulator, on the first pipeline's links (a link
  between two nodes at the inter-node bandwidth: ``partitioner.cost.exchange.pipeline_links``);
* the gradient exchange of each stage over its "dp" group, leaving when the stage's last
  backward ends (``Simulation.grads_ready``) as the runtime's overlapped exchange does: an
  all-reduce, with ``zero1`` a reduce to the owners, with ``fsdp`` a reduce-scatter; what runs
  past the pipeline's end shows;
* the optimizer step on the fullest rank (its ``1 / dp`` share when sharded), and with ``zero1``
  the owners' broadcast of the new values after it.

``fsdp`` (FSDP2 over each stage) is priced as ``partitioner.plan.sharding`` says: weights and
optimizer state over ``dp``, the gradients whole, two gathered blocks and the parameters outside
the blocks per rank (the whole stage under a split backward), a gather before every forward and
backward, a reduce-scatter behind the drain.

``tp > 1`` is priced on one tp rank (``partitioner.tensor``): the linear weights of the blocks'
column/row pairs, their gradients and optimizer state ``1 / tp``, embeddings, norms and the head
whole; the compute and activations between a column layer and its row layer ``1 / tp``; per pair
one all-reduce of ``B x T x C`` forward and one backward over the node's link, latency included,
in the F and B the cut balances (a recomputed forward repeats its own); no cut inside a pair;
the pipeline and the "dp" rings on the ranks ``(d * pp + r) * tp`` (``tp_groups``), whose
gradients are ``1 / tp`` of the sharded weights.

What it ignores: compute slowed by concurrent communication (the tp all-reduces and the exchange
included), the tied-weight all-reduce (one tensor per tie), the loss broadcast, and the kernels'
lower efficiency on the ``1 / tp`` narrower matrices of a tp rank (the roofline runs them at peak).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from partitioner.api import _Context, _context
from partitioner.cost.costs import node_time
from partitioner.cost.devices import Cluster, DeviceSpec
from partitioner.cost.exchange import (
    GATHERED_BYTES_PER_PARAM,
    GRAD_BYTES_PER_PARAM,
    allreduce_time,
    collective,
    exchange_end,
    optimizer_time,
    pipeline_links,
    reduce_time,
)
from partitioner.cost.nodecost import wgrad_time
from partitioner.cost.probes import fit_or_overhead_only, rows_like, time_forward_backward
from partitioner.errors import InfeasibleMemoryError, PartitionOptionError
from partitioner.options import Capture, Costing, LayoutSpace, resolve_options
from partitioner.plan.capacity import StateBound, refused
from partitioner.plan.layout import Layout, Option, explain, layout_space, pick, search
from partitioner.plan.placement import stage_cluster
from partitioner.plan.plan import Plan
from partitioner.plan.predict import prediction, simulate_stages
from partitioner.plan.sharding import gather_copy_bytes, gathered_units, gathering, state_per_param
from partitioner.schedule.ir import Schedule
from partitioner.schedule.registry import TRAINING_SCHEDULES, schedule_info, stage_schedule
from partitioner.schedule.validation import peak_inflight
from partitioner.tensor.sizes import model_heads, tp_groups, tp_sizes
from partitioner.tensor.split import TensorSplit, find_split
from partitioner.tracing.globalstate import preserved

__all__ = ["plan_layout", "LayoutSearch", "with_fit"]

log = logging.getLogger(__name__)


def plan_layout(
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    cluster: Cluster,
    global_batch: int,
    space: LayoutSpace | None = None,
    capture: Capture | None = None,
    costing: Costing | None = None,
    **legacy: Any,
) -> Plan:
    """Choose the whole layout of a job on ``cluster`` for ``global_batch`` rows per step.

    Searches every ``dp x pp x tp = len(cluster)``, micro-batch size, schedule and sharding
    (see the module docstring for how each is priced) and returns the fastest that fits as a
    plan the trainer runs as it is: ``plan.layout`` holds dp, the micro-batch size and the
    sharding, ``plan.schedule`` / ``plan.microbatches`` / each stage's ``recompute`` the rest.

    Args:
        model: the model (it may live on ``meta``).
        example_inputs: one micro-batch of inputs (any number of rows ``b0``; other micro-batch
            sizes scale its costs by ``b / b0``).
        cluster: the devices (``Cluster.uniform(64, "A100-80GB")``, or one ``Cluster.measure``
            made): their count is ``N``; the first device's kind, node size and links price all.
        global_batch: rows per optimizer step over all replicas, ``B``.
        space: the layouts to search and how hard (:class:`~partitioner.options.LayoutSpace`:
            schedules, micro-batch sizes, shardings, replica counts, ``top``, ``prune``).
        capture: how the model is captured, as ``partition`` takes it (the example is one
            micro-batch: ``example_is`` stays ``'microbatch'``).
        costing: how it is priced, as ``partition`` takes it; ``Costing.bucket_bytes`` sizes the
            gradient buckets the replicas' exchange runs in.
        **legacy: the keywords ``plan_layout`` took before the objects (``zero=``, ``top=``,
            ``precision=``...), for one release: ``partitioner.options.SHORTCUTS`` says where each goes.

    Returns:
        The chosen layout's plan, bound to ``model``: ``print(plan)`` shows the layout and the
        ranked alternatives (``plan.layouts``), with why each lost (``plan.choice`` says why the
        winner won).

    Raises:
        PartitionOptionError: an argument has a value the search does not take.
        PlannerKeywordError: a keyword ``plan_layout`` does not take (a ``TypeError``).
        InfeasibleMemoryError: no layout fits the devices.
        TraceError: the model could not be captured.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from partitioner import Cluster, LayoutSpace, plan_layout
        >>> m = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
        >>> plan = plan_layout(m, (torch.randn(1, 64),), cluster=Cluster.uniform(4, "cpu"), global_batch=16,
        ...                    space=LayoutSpace(zero=("none",), top=3))
        >>> plan.layout.dp * plan.layout.pp, plan.layout.global_batch, plan.layout.zero
        (4, 16, 'none')
    """
    opts = resolve_options("plan_layout", {"space": space, "capture": capture, "costing": costing}, legacy)
    found = LayoutSearch(
        model, example_inputs, cluster=cluster, global_batch=global_batch, capture=opts.capture, costing=opts.costing,
    )
    return found.run(opts.space)


class LayoutSearch:
    """A model traced and costed once for a cluster and a global batch: search, price or plan any layout of it.

    ``plan_layout(...)`` is ``LayoutSearch(...).run(space)``. Keep the object to price or plan other
    layouts of the same model without tracing it again (a benchmark that runs every layout, say).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from partitioner import Cluster
        >>> from partitioner.plan.layout import Option
        >>> found = LayoutSearch(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]), (torch.randn(1, 32),),
        ...                      cluster=Cluster.uniform(2, "cpu"), global_batch=8)
        >>> plan = found.plan(Option(dp=1, pp=2, schedule="zbh1", microbatch_size=2, zero="none", global_batch=8))
        >>> plan.layout.microbatches, plan.schedule, plan.layout.step_time > 0
        (4, 'zbh1', True)
    """

    def __init__(
        self,
        model: nn.Module,
        example_inputs: Sequence[Any],
        *,
        cluster: Cluster,
        global_batch: int,
        capture: Capture | None = None,
        costing: Costing | None = None,
        **legacy: Any,
    ) -> None:
        """Trace and cost ``model``; the arguments are :func:`plan_layout`'s (the old keywords of
        ``capture`` and ``costing`` too, for one release)."""
        opts = resolve_options("LayoutSearch", {"capture": capture, "costing": costing}, legacy)
        if opts.costing.inference is not None:
            raise PartitionOptionError(
                "the layout search prices training layouts; Costing(inference=...) plans generation: cut it with "
                "partition(model, (prompt,), p, costing=Costing(inference=...)), or drop inference= here"
            )
        _check(cluster, global_batch)
        if opts.capture.example_is != "microbatch":
            raise PartitionOptionError(
                f"the layout search takes one micro-batch as the example (other sizes scale its costs), got "
                f"Capture(example_is={opts.capture.example_is!r}): pass one micro-batch with example_is='microbatch'"
            )
        self.model, self.global_batch = model, global_batch
        with preserved(model, what="plan_layout()"):
            opts = replace(opts, capture=opts.capture.for_model(model))  # cut exactly: Cut()'s method and refine
            ctx = _context(model, example_inputs, opts, 1)
        kwargs = opts.capture.example_kwargs
        self._pricer = _Pricer(ctx, cluster, _rows(example_inputs, kwargs), opts.costing.bucket_bytes)
        self._example = (tuple(example_inputs), dict(kwargs or {}))
        # What a tensor-parallel group would split, from the graph; the heads from the model's config.
        self._split = find_split(ctx.traced.gm, {v: ctx.g.nodes[v]["module"] for v in ctx.g.nodes})
        self._heads = model_heads(model)
        self._tp: dict[int, _Pricer] = {1: self._pricer}

    @property
    def cluster(self) -> Cluster:
        """The cluster layouts are priced on (:meth:`use_cluster` replaces it)."""
        return self._pricer.cluster

    def use_cluster(self, cluster: Cluster) -> None:
        """Price on ``cluster`` from now on (same device count): a calibrated or fitted one, say."""
        if len(cluster) != len(self.cluster):
            raise PartitionOptionError(
                f"the search is for {len(self.cluster)} devices; the new cluster has {len(cluster)}: make it "
                f"with cluster.with_devices({len(self.cluster)})"
            )
        p = self._pricer
        self._pricer = _Pricer(p.ctx, cluster, (p.rows, p.tokens), p.bucket_bytes)
        self._tp = {1: self._pricer}

    def _pricer_for(self, tp: int) -> _Pricer:
        """The pricer of the layouts with ``tp`` devices per pipeline rank (made once)."""
        if tp not in self._tp:
            p = self._pricer
            self._tp[tp] = _Pricer(p.ctx, p.cluster, (p.rows, p.tokens), p.bucket_bytes, tp=tp, split=self._split)
        return self._tp[tp]

    def _price(self, option: Option) -> Layout:
        return self._pricer_for(option.tp).price(option)

    def _bound(self, option: Option) -> tuple[float, str | None, float]:
        return self._pricer_for(option.tp).bound(option)

    def fit_to_model(self, sizes: tuple[int, int] = (1, 4), *, repeat: int = 7) -> Cluster:
        """The cluster with its devices' speed and per-op overhead fitted to the model's own step here.

        Times one forward and backward of the whole traced model (one stage of it, as the runtime
        runs it, in this process, on the example's device) at ``sizes`` rows and solves for the
        speed factor and the overhead that make the roofline match both
        (``partitioner.cost.probes.fit_speed_and_overhead``). Run it in every process of a job at once (after a
        barrier) and the figures include the cores they share; agree on one result before
        :meth:`use_cluster` (plans must be the same on every rank). The model runs with
        gradients, and they are cleared after.

        Raises:
            CalibrationError: the model is on meta, or the timings do not grow with the size.
        """
        inputs, kwargs = self._example
        p = self._pricer
        # What the runtime runs: the traced graph (as one stage), not the model's own Python.
        batches: list[tuple[Sequence[Any], Mapping[str, Any]]] = [
            ([rows_like(x, b) for x in (*inputs, *kwargs.values())], {}) for b in sizes
        ]
        with preserved(self.model, what="LayoutSearch.fit_to_model()"):
            whole = p.ctx.plan(p.cluster.with_devices(1), "1f1b", 1, split=True, predictions=False).build_stages()
            times = time_forward_backward(whole, batches, repeat=repeat)
            self.model.zero_grad(set_to_none=True)
        return self.fit_to_timings(sizes, (times[0], times[1]))

    def fit_to_timings(self, sizes: tuple[int, int], seconds: tuple[float, float]) -> Cluster:
        """The cluster fitted to a forward and backward of the whole model measured at ``sizes`` rows
        (``seconds``), however they were timed: :meth:`fit_to_model` times the traced graph, and
        ``runtime.overheads.fit_to_runtime`` a one-stage trainer step, loss included.

        Where the timings do not grow with the size, the devices' speed is kept and only the per-op
        overhead is fitted (``fit_or_overhead_only``; logged as a warning).
        """
        p, times = self._pricer, seconds
        bare = with_fit(p.cluster, 1.0, 0.0)
        # Every node runs a forward, and a backward where it needs one (scaling keeps the nodes).
        ops = sum(1 + (c.requires_grad is True) for c in p.ctx.costs.values())
        roof = []
        for b in sizes:
            g = p.ctx.scaled(b / p.rows).g
            roof.append(sum(sum(node_time(g.nodes[v]["cost"], bare.devices[0])) for v in g.nodes))
        speed, overhead, grew = fit_or_overhead_only((roof[0], roof[1]), (times[0], times[1]), ops)
        if not grew:
            log.warning("the model's step did not take longer at %d rows than at %d (%.4gs, %.4gs: overhead and noise "
                        "swamp its compute here): the devices' speed is kept, the per-op overhead fitted alone",
                        sizes[1], sizes[0], times[0], times[1])
        log.info("fit to the model: %d ops, %s rows: %.4gs, %.4gs measured; speed x%.3g, %.3g s per op",
                 ops, sizes, times[0], times[1], speed, overhead)
        return with_fit(p.cluster, speed, overhead)

    def space(self, space: LayoutSpace | None = None, **legacy: Any) -> list[Option]:
        """Every layout of the cluster for the global batch (``layout_space``) within ``space`` and the
        model's units (``space``'s fields as old keywords too, for one release: ``zero=...``)."""
        space = resolve_options("LayoutSearch.space", {"space": space}, legacy).space
        tps = tp_sizes(space.tp_sizes, heads=self._heads, found=self._split,
                       node_size=self.cluster.devices[0].node_size, devices=len(self.cluster))
        options = layout_space(
            len(self.cluster), self.global_batch, schedules=tuple(space.schedules or TRAINING_SCHEDULES),
            microbatch_sizes=space.microbatch_sizes, zero=space.zero, max_stages=len(self._pricer.ctx.units),
            dp_sizes=space.dp_sizes, pp_sizes=space.pp_sizes, tp_sizes=tps,
        )
        if not options:
            raise PartitionOptionError(
                f"no layout of {len(self.cluster)} devices divides a global batch of {self.global_batch} rows "
                f"into replicas and micro-batches (microbatch_sizes={space.microbatch_sizes}, "
                f"dp_sizes={space.dp_sizes}, tp sizes {tps}); pick a global batch that a replica count divides"
            )
        return options

    def price(self, option: Option) -> Layout:
        """What the cost model says ``option`` does (see the module docstring).

        Raises:
            InfeasibleMemoryError: no cut of it fits the devices.
        """
        with preserved(self.model, what="plan_layout()"):
            return self._price(option)

    def run(self, space: LayoutSpace | None = None, **legacy: Any) -> Plan:
        """Search ``space`` (default ``LayoutSpace()``; its fields as old keywords too, for one release:
        ``top=3``) and return the chosen plan."""
        space = resolve_options("LayoutSearch.run", {"space": space}, legacy).space
        t0 = time.perf_counter()
        options = self.space(space)
        p = self._pricer
        with preserved(self.model, what="plan_layout()"):
            rows = search(options, self._price, self._bound, capacity=p.capacity, top=space.top, prune=space.prune)
            try:
                best, why = pick(rows)
            except InfeasibleMemoryError as e:  # the bound it breaks, and what would fit
                raise refused(e, StateBound.of(
                    p.cluster, p.params, p.ctx.state_bytes_per_param, dp_sizes=tuple(sorted({o.dp for o in options})),
                    zero=tuple(sorted({o.zero for o in options})), max_pp=len(p.ctx.units), gathered=p.gathered,
                ), f"No layout fits {len(p.cluster)} x {p.cluster.devices[0].name} (tried {len(rows)}: every "
                   "dp x pp x tp, micro-batch size, schedule and sharding searched).") from None
            rows = explain(rows, best)
            log.info("plan_layout: %d layouts, %.2fs: %s", len(rows), time.perf_counter() - t0, why)
            plan = self._pricer_for(best.tp).plan(best.option)
        chosen = next(r for r in rows if r.note == "chosen")
        return replace(plan, layout=chosen, layouts=tuple(rows), choice=why)

    def plan(self, option: Option) -> Plan:
        """The plan that trains ``option`` (its stages built, bound to the model), priced: ``plan.layout``.

        Raises:
            InfeasibleMemoryError: no cut of it fits the devices.
        """
        with preserved(self.model, what="plan_layout()"):
            pricer = self._pricer_for(option.tp)
            lay = pricer.price(option)
            plan = pricer.plan(option)
        return replace(plan, layout=lay)


def with_fit(cluster: Cluster, speed: float, overhead: float) -> Cluster:
    """``cluster`` with every device ``speed`` times as fast (FLOP/s and bandwidth) and ``overhead`` per op.

    Example:
        >>> c = with_fit(Cluster.uniform(2, "cpu"), 0.5, 1e-5)
        >>> c.devices[0].peak_flops_fp32, c.devices[0].op_overhead, c.devices[0].name
        (25000000000.0, 1e-05, 'cpu (fitted to the model)')
    """
    def fitted(d: DeviceSpec) -> DeviceSpec:
        name = d.name if d.name.endswith("(fitted to the model)") else f"{d.name} (fitted to the model)"
        return replace(d, name=name, peak_flops=d.peak_flops * speed, peak_flops_fp32=d.peak_flops_fp32 * speed,
                       mem_bandwidth=d.mem_bandwidth * speed, op_overhead=overhead)

    return replace(cluster, devices=tuple(fitted(d) for d in cluster.devices))



def _shared_cores_speedup(cluster: Cluster, processes: int, dp: int, busy: Sequence[float], step: float) -> float:
    """How much faster the ranks compute than the cluster's figures say, when they share too few cores.

    A measured CPU cluster (``cluster.cores``: the cores its processes share) times compute with
    every process busy, each getting ``cores / processes`` of a core. A pipeline's ranks idle in its
    bubble, ``k`` of them busy on average (every replica alike), and the busy ones get
    ``min(1, cores / k)`` of a core instead.

    Example:
        >>> c = replace(Cluster.uniform(4, "cpu"), cores=2)
        >>> _shared_cores_speedup(c, 4, 1, [1.0, 1.0, 0.5, 0.5], 2.0)   # 1.5 busy of 4: a core each, not half
        2.0
    """
    cores = cluster.cores
    if not cores or processes <= cores or step <= 0:
        return 1.0
    busy_on_average = dp * sum(busy) / step
    return min(1.0, cores / max(busy_on_average, 1e-9)) / (cores / processes)


def _check(cluster: Cluster, global_batch: int) -> None:
    if not isinstance(cluster, Cluster):
        raise PartitionOptionError(
            f"cluster must be a Cluster (e.g. Cluster.uniform(8, 'A100-80GB')), got {type(cluster).__name__}"
        )
    if type(global_batch) is not int or global_batch < 1:
        raise PartitionOptionError(f"global_batch must be a positive int (rows per step), got {global_batch!r}")


def _rows(example_inputs: Sequence[Any], example_kwargs: Mapping[str, Any] | None) -> tuple[int, int]:
    """(rows of the example micro-batch, tokens per row when the first input is token ids, else 0)."""
    given = (*example_inputs, *(example_kwargs or {}).values())
    tensors = [x for x in given if isinstance(x, torch.Tensor) and x.dim()]
    if not tensors:
        raise PartitionOptionError(
            "plan_layout needs a tensor input with a batch dimension, to scale the example's rows to "
            "other micro-batch sizes"
        )
    x = tensors[0]
    tokens = int(x.shape[1]) if x.dim() == 2 and not x.is_floating_point() else 0
    return int(x.shape[0]), tokens


class _Pricer:
    """Prices layouts of one traced, costed model on one cluster with ``tp`` devices per pipeline rank;
    caches per micro-batch size.

    With ``tp > 1`` every context it cuts is one tp rank's (``_Context.sharded``: costs and
    parameters split as ``split`` says, the all-reduces on the node's link in the nodes' times), and
    its ``cluster`` is the one the ``dp x pp`` ranks see (``tp_groups``: nodes of ``node_size / tp``).
    """

    def __init__(self, ctx: _Context, cluster: Cluster, rows: tuple[int, int], bucket_bytes: int, *,
                 tp: int = 1, split: TensorSplit | None = None) -> None:
        self.ctx, self.bucket_bytes = ctx, bucket_bytes
        self.tp, self.split = tp, split or TensorSplit()
        self.ring = collective(cluster, tp, 1)  # a tp group: consecutive devices inside one node
        self.cluster = tp_groups(cluster, tp)
        self.rows, self.tokens = rows
        self.capacity = min(d.usable_memory for d in cluster.devices)
        rank = self._shard(ctx)
        self.params = rank.params  # on one tp rank, each tensor once, tied ones included
        self.gathered_bpp = GATHERED_BYTES_PER_PARAM  # fsdp: what each gather moves and holds, per parameter
        # FSDP's gathered weights on a rank, whole backward: two of the largest block and the parameters
        # outside the blocks (see partitioner.plan.sharding).
        block, outside = gathered_units(rank.g, rank.numel, ctx.traced.param_aliases)
        self.gathered = (2 * block + outside) * self.gathered_bpp
        self._fastest: dict[tuple[int, int], float] = {}
        self._at: dict[int, tuple[_Context, float, float, float, float]] = {}
        self._schedules: dict[tuple[str, int, int], tuple[Schedule, tuple[int, ...]]] = {}
        self._no_fit: set[tuple[int, int, str, int]] = set()  # (dp, pp, schedule, b) cut too big with zero1
        # (dp, pp, schedule, zero, micro-batches held per stage) -> the smallest b no cut fits: with
        # the same held counts, larger micro-batches only add activation bytes.
        self._too_big: dict[tuple[int, int, str, str, tuple[int, ...]], int] = {}

    def _shard(self, ctx: _Context, factor: float = 1.0) -> _Context:
        """``ctx`` as one tp rank runs it (itself when ``tp`` is 1), at micro-batches ``factor`` times
        the traced one."""
        return ctx.sharded(self.split, self.tp, self.ring, factor)

    def _sized(self, b: int) -> tuple[_Context, float, float, float, float]:
        """The context costed for ``b`` rows (one tp rank's); one micro-batch's total work (forward and
        backward), its activation bytes, the largest any one unit saves, and its work less the weight
        gradients (the bounds' terms)."""
        if b not in self._at:
            ctx = self._shard(self.ctx, b / self.rows)  # the all-reduces priced at b rows
            dev = self.cluster.devices[0]
            times = [(ctx.g.nodes[v]["cost"], node_time(ctx.g.nodes[v]["cost"], dev)) for v in ctx.g.nodes]
            work = sum(f + bw for _, (f, bw) in times)
            inputs = sum(f + bw - wgrad_time(c, bw) for c, (f, bw) in times)
            acts = [sum(ctx.g.nodes[v]["cost"].saved_bytes for v in u.nodes) for u in ctx.units]
            self._at[b] = (ctx, work, float(sum(acts)), float(max(acts, default=0)), inputs)
        return self._at[b]

    def _schedule(self, o: Option) -> tuple[Schedule, tuple[int, ...]]:
        """The option's schedule and the micro-batches each stage holds at its peak, built and
        counted once for every option that shares them (the shardings, say)."""
        key = (o.schedule, o.stages, o.microbatches)
        if key not in self._schedules:
            built = stage_schedule(*key)
            self._schedules[key] = (built, peak_inflight(built))
        return self._schedules[key]

    def _state_per_param(self, o: Option) -> float:
        """Training state bytes per parameter on a rank (``partitioner.plan.sharding``)."""
        whole_stage = o.zero == "fsdp" and schedule_info(o.schedule).split_backward  # kept gathered from I to W
        return state_per_param(self.ctx.state_bytes_per_param, o.zero, o.dp, self.gathered_bpp if whole_stage else 0.0)

    def _reserved(self, o: Option) -> float:
        """Bytes of every rank's memory that its stages cannot use: fsdp's gathered blocks and the rest."""
        return self.gathered if o.zero == "fsdp" and not schedule_info(o.schedule).split_backward else 0.0

    def _gathers_floor(self, o: Option) -> float:
        """A floor under the seconds one forward and one backward of every stage spend all-gathering
        (fsdp): all parameters' weight bytes on the fastest "dp" ring, without latency."""
        if o.zero != "fsdp":
            return 0.0
        key = (o.dp, o.pp)
        if key not in self._fastest:
            self._fastest[key] = max(collective(self.cluster, o.dp, o.pp, r).bandwidth for r in range(o.pp))
        return 2 * (o.dp - 1) / o.dp * self.params * self.gathered_bpp / self._fastest[key]

    def bound(self, o: Option) -> tuple[float, str | None, float]:
        """A lower bound on the step time, why the state cannot fit (or ``None``), the state per rank."""
        # fsdp's gathered units are on every rank whatever the cut (the price adds them so).
        state = self.params * self._state_per_param(o) / o.pp + self._reserved(o)
        if state > self.capacity:
            return 0.0, f"training state alone needs {state / 2**30:.1f} GiB per rank on average", state
        _, work, act, top_act, inputs = self._sized(o.microbatch_size)
        # Every rank's peak holds at least one micro-batch's activations of its stages (a
        # recomputing stage rebuilds them in its backward): the fullest holds the average of
        # state and those, and at least the unit that saves the most.
        least = max(state + act / o.pp, top_act + self._reserved(o))
        if least > self.capacity:
            return 0.0, (f"state and one micro-batch's activations need at least {least / 2**30:.1f} GiB "
                         "per rank"), least
        dev = self.cluster.devices[0]
        share = self.params / o.pp / (o.dp if o.zero != "none" else 1)
        # The ranks share m micro-batches' forwards and backwards (and fsdp's gathers); one
        # micro-batch runs them in a chain, but for its weight gradients when the schedule
        # defers them (W). Ranks sharing too few cores compute up to devices / cores faster.
        fast = max(1.0, o.devices / self.cluster.cores) if self.cluster.cores else 1.0
        gathers = self._gathers_floor(o)
        chain = (inputs if schedule_info(o.schedule).split_backward else work) / fast + gathers
        lb = max(o.microbatches * (work / fast + gathers) / o.pp, chain) + optimizer_time(share, dev.mem_bandwidth)
        if o.zero == "zero1":
            lb += reduce_time(self.params / o.pp * GRAD_BYTES_PER_PARAM, o.dp, collective(self.cluster, o.dp, o.pp),
                              self.bucket_bytes)
        return lb, None, state

    def _cut(self, o: Option, *, split: bool, built: Schedule | None = None) -> tuple[Plan, Cluster]:
        ctx = self._sized(o.microbatch_size)[0].with_state_bytes(self._state_per_param(o))
        links = pipeline_links(self.cluster, o.pp)
        if self._reserved(o):  # the stages fit in what the gathered units leave
            links = replace(links, devices=tuple(replace(d, memory=max(d.memory_reserve, d.memory - self._reserved(o)))
                                                 for d in links.devices))
        stages = stage_cluster(links, o.stages, o.schedule)
        plan = ctx.plan(stages, o.schedule, o.microbatches, split=split, predictions=split, built=built)
        return plan, stages

    def price(self, o: Option) -> Layout:
        """The layout ``o`` as the cost model sees it (see the module docstring)."""
        key = (o.dp, o.pp, o.schedule, o.microbatch_size)
        if o.zero == "none" and key in self._no_fit:  # more state than zero1's, which no cut fits
            raise InfeasibleMemoryError([0.0], [self.capacity], "no cut fits (it does not with zero1 either)")
        built, inflight = self._schedule(o)
        held = (o.dp, o.pp, o.schedule, o.zero, inflight)
        if self._too_big.get(held, o.microbatch_size + 1) <= o.microbatch_size:
            raise InfeasibleMemoryError(
                [0.0], [self.capacity], f"no cut fits (none does at micro-batch size {self._too_big[held]} either)"
            )
        try:
            plan, stages = self._cut(o, split=False, built=built)
        except InfeasibleMemoryError:
            if o.zero == "zero1":
                self._no_fit.add(key)
            self._too_big[held] = min(self._too_big.get(held, o.microbatch_size), o.microbatch_size)
            raise
        ring = [collective(self.cluster, o.dp, o.pp, built.stage_to_rank[s]) for s in range(o.stages)]
        # fsdp: every forward and backward of a stage first all-gathers its weights (and copies them
        # in and out of the gather's buffer through its device's memory).
        gather = [reduce_time(st.params * self.gathered_bpp, o.dp, ring[s], self.bucket_bytes)
                  + gather_copy_bytes(st.params, o.dp, self.gathered_bpp) / stages.devices[s].mem_bandwidth
                  if o.zero == "fsdp" else 0.0 for s, st in enumerate(plan.stages)]
        timed = [gathering(st, g, 1.0) for st, g in zip(plan.stages, gather)] if any(gather) else plan.stages
        sched, sim = simulate_stages(timed, stages, o.schedule, o.microbatches, built=built)
        faster = _shared_cores_speedup(self.cluster, o.devices, o.dp, sim.busy, sim.step_time)
        if faster > 1:  # idle ranks leave their share of the cores to the busy ones
            quick = [gathering(st, g, faster) for st, g in zip(plan.stages, gather)]
            sched, sim = simulate_stages(quick, stages, o.schedule, o.microbatches, built=built)
        pr = prediction(plan.stages, o.schedule, o.microbatches, sched, sim)
        # Each stage's gradients leave over its rank's "dp" ring: an all-reduce, with zero1 a
        # reduce to the owners now and their broadcast after the step (an all-reduce's bytes),
        # with fsdp a reduce-scatter (the next step's forwards gather the new weights).
        move = allreduce_time if o.zero == "none" else reduce_time
        exch, rank_params = [], [0.0] * o.pp
        for s, st in enumerate(plan.stages):
            r = sched.stage_to_rank[s]
            exch.append(move(st.params * GRAD_BYTES_PER_PARAM, o.dp, ring[s], self.bucket_bytes))
            rank_params[r] += st.params
        ends = exchange_end(sim.grads_ready, exch, sched.stage_to_rank, o.pp)
        tail = max(0.0, max(ends, default=0.0) - sim.step_time)
        dev = self.cluster.devices[0]
        owned = max(rank_params) / (o.dp if o.zero != "none" else 1)
        opt = optimizer_time(owned, dev.mem_bandwidth)
        if o.zero == "zero1":  # the owners broadcast the new values after the step
            tail += max(
                reduce_time(p * GRAD_BYTES_PER_PARAM, o.dp, collective(self.cluster, o.dp, o.pp, r), self.bucket_bytes)
                for r, p in enumerate(rank_params)
            )
        sent = 2 * (o.dp - 1) / o.dp * max(rank_params, default=0.0) * GRAD_BYTES_PER_PARAM
        if o.zero == "fsdp":  # a reduce-scatter, and two gathers per micro-batch
            per_param = GRAD_BYTES_PER_PARAM + 2 * o.microbatches * self.gathered_bpp
            sent = (o.dp - 1) / o.dp * max(rank_params, default=0.0) * per_param
        step = sim.step_time + tail + opt
        memory = pr.memory + self._reserved(o)
        costs = self._sized(o.microbatch_size)[0].costs  # the tp all-reduces (a recomputed forward's again)
        reduces = sum(costs[v].comm_fwd_s * (1 + st.recompute) + costs[v].comm_bwd_s
                      for st in plan.stages for v in st.nodes) if o.tp > 1 else 0.0
        return Layout(
            o.dp, o.pp, o.stages, o.schedule, o.microbatch_size, o.microbatches, o.global_batch, o.zero,
            step_time=step, pipeline_time=sim.step_time, exchange_time=tail, optimizer_time=opt,
            bubble=sim.bubble_total, memory=memory, capacity=self.capacity,
            exchange_bytes=sent, recompute=sum(st.recompute for st in plan.stages),
            tokens_per_row=self.tokens, fits=memory <= self.capacity and math.isfinite(step), priced=True,
            gather_time=2 * o.microbatches * sum(gather) / o.pp, tp=o.tp,
            allreduce_time=o.microbatches * reduces / o.pp,
        )

    def plan(self, o: Option) -> Plan:
        """The chosen layout's full plan: stages built, every schedule of its placement predicted."""
        plan, _ = self._cut(o, split=True)
        return plan
