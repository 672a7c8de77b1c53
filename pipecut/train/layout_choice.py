"""Which layout a ``pipecut train`` job runs: the flags' (``--layout manual``), the planner's
(``--layout auto``) or a saved plan's (``--plan``), checked against the job's processes and the model.

Legend: ``N`` devices the layout spends, ``dp`` replicas, ``pp`` ranks per pipeline, ``b`` rows per
micro-batch, ``m`` micro-batches per replica, ``B`` the global batch (``B = dp * m * b``).

* ``--layout manual`` (the default): the flags decide, as they always have; nothing is searched.
* ``--layout auto``: the folder's model is traced once on ``meta`` and ``partitioner.LayoutSearch``
  searches ``dp x pp x tp = N`` (``N``: the job's processes; in one process, ``--pp`` or the GPU
  count, else 1, with ``dp = tp = 1``), the micro-batch size, the schedule, recomputation and the
  sharding for ``--global-batch``. The layout keys given (``--dp``, ``--pp``, ``--tp``,
  ``--schedule``, ``--micro-batch-size``, ``--zero``) constrain the search instead of being
  refused, so a run's ``OUT/config.toml``, which records the chosen values, searches exactly its
  own layout again. A tp group must sit inside one node: on GPUs the job's node is the processes
  torchrun started on this host (``LOCAL_WORLD_SIZE``, else the preset's 8), and tp is searched
  over the divisors of that count which the model's heads and split sizes take
  (``partitioner.tensor.sizes``); on CPU processes only with ``--tp`` (:func:`job_nodes` says
  why); not with ``--zero fsdp``, which the runtime does not run under tp yet.
  The devices are priced as ``--calibrate FILE`` measured them, else as the ``--device`` preset;
  when the device is this machine's CPU (``--device auto`` without CUDA), every rank first times
  the model with real weights (``runtime.overheads.calibrate_job``, collective).
* ``--plan FILE``: the saved plan's layout, refused with what differs when it was made for another
  number of processes, another model, sequence length, global batch or precision.

A rerun on a folder that holds a checkpoint and the ``plan.json`` of a ``--layout auto`` run trains
that recorded plan again instead of searching anew: a fresh calibration is noisy and could choose
another layout, and the resumed steps must be those the first run would have taken.

Example:
    >>> from pipecut.train.config import TrainConfig
    >>> cfg = TrainConfig(model="m", data="d", out="o", layout="auto", global_batch=16, pp=2)
    >>> space = search_space(cfg, world=4)
    >>> space["dp_sizes"], space["pp_sizes"], space["tp_sizes"], space["schedules"], space["zero"]
    (None, (2,), None, None, ('none', 'zero1'))
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from partitioner.cost.devices import Cluster
from partitioner.cost.recompute import RECOMPUTE_FLAGS
from partitioner.errors import CalibrationError, MissingPredictionError, PipecutError, PlanMismatchError
from partitioner.options import Costing, LayoutSpace
from partitioner.plan.layout import DEFAULT_ZERO, Option
from partitioner.plan.plan import Plan
from partitioner.plan.units import fmt_time
from partitioner.schedule.registry import stages_per_rank
from partitioner.search import LayoutSearch
from pipecut.folder import HFFolder
from pipecut.train import checkpoints
from pipecut.train.config import LAYOUT_KEYS, TrainConfig, TrainConfigError, check_tp_options
from runtime.parallel.tensor_stages import plan_problem, vocab_only_plan

__all__ = [
    "Choice", "choose", "search_space", "resolved", "bind_plan", "predicted_step", "describe", "job_nodes",
    "TrainPlanError", "PlanWorldError", "PlanModelError",
]

log = logging.getLogger(__name__)


LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


class TrainPlanError(TrainConfigError):
    """A saved plan (``--plan``) does not fit the run: a flag or setting contradicts it (named, with the plan's)."""


class PlanWorldError(TrainPlanError):
    """A saved plan was made for another number of processes than the job has (both are in the message)."""


class PlanModelError(TrainPlanError):
    """A saved plan was made for another model than ``--model`` (what differs is in the message)."""


@dataclass(frozen=True)
class Choice:
    """The layout a run trains: the settings with it filled in, and the plan when one decides it."""

    cfg: TrainConfig
    """The run's settings; with a plan, its ``dp``, ``pp``, ``tp``, ``schedule``, ``micro_batch_size`` and ``zero``."""
    plan: Plan | None
    """The plan to train, bound to the folder's model on ``meta``; ``None``: the flags' (the loop cuts it)."""
    how: str
    """Where the layout comes from, for the log and ``OUT/config.toml``."""


def choose(
    cfg: TrainConfig, folder: HFFolder, config: Any, *, world: int, preset: str, out: Path, loss_fn: LossFn,
) -> Choice:
    """The layout the run trains (see the module docstring). Collective under torch.distributed.

    Args:
        cfg: the run's settings.
        folder, config: the model folder and its config.
        world: the job's processes (1 in one process).
        preset: the device preset ``--device`` resolves to on this machine.
        out: the run's folder (a recorded plan there is reused on resume with ``--layout auto``).
        loss_fn: the training loss, for the calibration's timed steps.

    Raises:
        TrainPlanError: ``--plan`` does not fit the job (:class:`PlanWorldError`, :class:`PlanModelError`).
        TrainConfigError: ``--layout auto`` with layout keys no layout of the job satisfies.
        InfeasibleMemoryError: no layout fits the devices.
    """
    if cfg.plan is not None:
        plan = _load(cfg.plan)
        settled = resolved(cfg, plan, world, source=f"--plan {cfg.plan}")
        return Choice(settled, bind_plan(plan, folder, config, cfg, source=f"--plan {cfg.plan}"), f"--plan {cfg.plan}")
    if cfg.layout == "manual":  # the defaults written out, as the run's config.toml records them
        filled = dataclasses.replace(cfg, schedule=cfg.schedule or "1f1b", micro_batch_size=cfg.micro_batch_size or 1,
                                     tp=cfg.tp or 1)
        return Choice(filled, None, "the flags")
    recorded = _recorded(cfg, folder, config, world, out)
    if recorded is not None:
        return Choice(resolved(cfg, recorded, world, source=str(out / "plan.json")), recorded,
                      f"recorded in {out / 'plan.json'} (resumed run)")
    plan, priced_on = _search(cfg, folder, config, world, preset, loss_fn)
    return Choice(resolved(cfg, plan, world, source="the planner"), plan, f"the planner, priced on {priced_on}")


def search_space(cfg: TrainConfig, *, world: int) -> dict[str, Any]:
    """``LayoutSpace``'s fields for a job of ``world`` processes: the layout keys ``cfg`` sets, as constraints.

    Raises:
        TrainConfigError: ``--dp``/``--pp``/``--tp`` that no split of the job's processes gives,
            ``--tp`` in one process or with an option tp does not run with, or ``--zero`` sharding
            over replicas the job cannot have.
    """
    pp_sizes = (cfg.pp,) if cfg.pp is not None else None
    dp_sizes: tuple[int, ...] | None
    tp_sizes: tuple[int, ...] | None
    if world == 1:
        if cfg.dp not in (None, 1) or cfg.tp not in (None, 1):
            flag, n = ("--dp", cfg.dp) if cfg.dp not in (None, 1) else ("--tp", cfg.tp)
            raise TrainConfigError(
                f"{flag} {n} needs {n} processes: launch with torchrun --nproc-per-node {(n or 1) * (cfg.pp or 1)} "
                f"(in one process --layout auto searches one replica over --pp pipeline ranks)"
            )
        dp_sizes, pp_sizes, tp_sizes = (1,), None, (1,)
    else:
        splits = [(d, p, world // (d * p)) for d in _divisors(world) for p in _divisors(world // d)]
        if not any(cfg.dp in (None, d) and cfg.pp in (None, p) and cfg.tp in (None, t) for d, p, t in splits):
            raise TrainConfigError(
                f"--layout auto with dp {cfg.dp}, pp {cfg.pp}, tp {cfg.tp}: the job has {world} processes, which is "
                f"not dp x pp x tp; give values whose product is {world}, some of them, or none (the planner then "
                "chooses)"
            )
        dp_sizes = (cfg.dp,) if cfg.dp is not None else None
        tp_sizes = (cfg.tp,) if cfg.tp is not None else None
    check_tp_options(cfg)  # --tp with FSDP: the refusal a manual --tp meets
    if cfg.zero == "fsdp":
        tp_sizes = (1,)  # not run under tp yet: the search keeps to tp 1
    if cfg.zero not in (None, "none") and dp_sizes == (1,):
        raise TrainConfigError(
            f"--zero {cfg.zero} shards the training state over data-parallel replicas, and this job has one "
            f"(dp 1{', one process' if world == 1 else ''}): launch more processes than pipeline ranks under "
            "torchrun, or drop --zero"
        )
    return {
        "dp_sizes": dp_sizes,
        "pp_sizes": pp_sizes,
        "tp_sizes": tp_sizes,
        "schedules": (cfg.schedule,) if cfg.schedule not in (None, "auto") else None,
        "microbatch_sizes": (cfg.micro_batch_size,) if cfg.micro_batch_size is not None else None,
        "zero": (cfg.zero,) if cfg.zero is not None else DEFAULT_ZERO,
    }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolved(cfg: TrainConfig, plan: Plan, world: int, *, source: str = "the plan") -> TrainConfig:
    """``cfg`` with the plan's layout: its ``dp``, ``pp``, ``tp``, ``schedule``, ``micro_batch_size`` and ``zero``.

    A plan from the layout search (``plan.layout``) says all of them; a plain plan (``pipecut plan
    --stages``) its stages, schedule, micro-batches and micro-batch size, with ``tp`` ``--tp``'s
    (default 1), ``dp`` the job's processes over its ``pp x tp`` and the sharding ``--zero``'s.

    Raises:
        PlanWorldError: the plan needs another number of processes than ``world``.
        TrainPlanError: a layout key given, the global batch, the sequence length or the precision
            differs from the plan's.
    """
    lay = plan.layout
    if lay is not None:
        dp, pp, tp, b, zero, batch = lay.dp, lay.pp, lay.tp, lay.microbatch_size, lay.zero, lay.global_batch
    else:
        pp, tp = plan.num_stages // stages_per_rank(plan.schedule), cfg.tp or 1
        dp = 1 if world == 1 else world // (pp * tp) if world % (pp * tp) == 0 else 0
        b = plan.microbatch_size or 1
        zero, batch = cfg.zero or "none", max(dp, 1) * plan.microbatches * b
    _check_world(plan, dp, pp, tp, world, source)
    given = {"dp": dp, "pp": pp, "tp": tp, "schedule": plan.schedule, "micro_batch_size": b, "zero": zero}
    clash = [f"--{k.replace('_', '-')} {getattr(cfg, k)} (the plan's: {v})" for k, v in given.items()
             if getattr(cfg, k) not in (None, v) and not (k == "schedule" and cfg.schedule == "auto")]
    length = _seq_len(plan)
    for key, mine, theirs in (("global-batch", cfg.global_batch, batch), ("seq-len", cfg.seq_len, length),
                              ("precision", cfg.precision, plan.precision)):
        if theirs is not None and mine != theirs:
            clash.append(f"--{key} {mine} (the plan's: {theirs})")
    if clash:
        raise TrainPlanError(
            f"{source} was made for another job: {'; '.join(clash)}. Drop the layout flags (the plan decides "
            f"them) and give the plan's --global-batch, --seq-len and --precision, or make a plan for this job: "
            f"pipecut plan {cfg.model} --devices {max(world, dp * pp * tp)} --global-batch {cfg.global_batch} "
            f"--seq-len {cfg.seq_len} --precision {cfg.precision} --json plan.json"
        )
    assert set(given) == set(LAYOUT_KEYS)  # internal invariant: every layout key comes from the plan
    return dataclasses.replace(cfg, **given)  # type: ignore[arg-type]


def bind_plan(plan: Plan, folder: HFFolder, config: Any, cfg: TrainConfig, *, source: str) -> Plan:
    """``plan`` bound to the folder's model on ``meta`` at the example it was traced with.

    Raises:
        PlanModelError: the plan's inputs are not a causal LM's token ids, or its traced graph is
            not the folder's model's (with the parameter counts and fingerprints).
    """
    shape = plan.microbatch_shapes.get("input_ids")
    fix = (f"make a plan for this model: pipecut plan {cfg.model} --devices N --global-batch {cfg.global_batch} "
           f"--seq-len {cfg.seq_len} --json plan.json")
    if shape is None or len(shape) != 2:
        raise PlanModelError(
            f"{source} takes inputs {dict(plan.microbatch_shapes)}, not a causal LM's token ids (input_ids of "
            f"shape (rows, tokens)): it was made for another model than {cfg.model}; {fix}"
        )
    module = folder.build(meta=True, config=config)
    try:
        return plan.bind(module, folder.example_inputs(seq_len=shape[1], micro_batch_size=shape[0]))
    except PlanMismatchError as e:
        planned = sum(st.params for st in plan.stages)
        have = sum(p.numel() for p in dict(module.named_parameters()).values())
        what = (f"{planned:,} parameters, the folder's model {have:,}" if planned != have else
                f"the same {have:,} parameters as the folder's model, but another graph (its code or config differ)")
        first, last = plan.stages[0].modules[:1], plan.stages[-1].modules[-1:]
        raise PlanModelError(
            f"{source} was made for another model than {cfg.model}: its stages hold {what}; its modules run "
            f"from {', '.join(first) or '?'} to {', '.join(last) or '?'} ({e}); {fix}"
        ) from None


def predicted_step(plan: Plan) -> float | None:
    """Seconds per step the planner predicts: a searched layout's whole step (pipeline, exchange, optimizer),
    else the plan's simulated pipeline step under its schedule (``None`` when the plan has none)."""
    if plan.layout is not None and plan.layout.step_time > 0:
        return plan.layout.step_time
    try:
        return plan.prediction(plan.schedule).step_time
    except MissingPredictionError:
        return None


def describe(plan: Plan, *, dp: int, pp: int, m: int, zero: str | None, how: str, tp: int = 1) -> str:
    """One line: the layout trained (``dp`` replicas of ``pp`` ranks of ``tp`` processes, ``m`` micro-batches
    of the plan's size each), where it comes from (``how``), its predicted step."""
    z = f" {zero}" if zero not in (None, "none") else ""
    recompute = sum(bool(st.recompute) for st in plan.stages)
    again = f" recompute {recompute}/{len(plan.stages)}" if recompute else ""
    step = predicted_step(plan)
    text = f"predicted step {fmt_time(step)}" if step is not None else "no predicted step"
    split = f" x tp{tp}" if tp > 1 else ""
    return f"layout dp{dp} x pp{pp}{split} {plan.schedule} b{plan.microbatch_size} m{m}{z}{again} ({how}), {text}"


# -- the search ---------------------------------------------------------------------------------


def layers_split(config: Any) -> bool:
    """Whether tp splits the layers of a model of ``config``: its plan (``base_model_tp_plan``, or
    pipecut's derived one) splits more than the token embedding. The planner prices tp as Megatron's
    split layers, so ``--layout auto`` searches tp only where that holds (an explicit ``--tp`` is
    checked by ``check_tp_fits`` instead).

    Example:
        >>> from types import SimpleNamespace
        >>> layers_split(SimpleNamespace(model_type="gpt2")), layers_split(SimpleNamespace(model_type="bloom"))
        (True, False)
        >>> layers_split(SimpleNamespace(model_type="lfm2", base_model_tp_plan={"embed_tokens": "embedding_rowwise"}))
        False
    """
    return plan_problem(config) is None and not vocab_only_plan(config)


def _search(cfg: TrainConfig, folder: HFFolder, config: Any, world: int, preset: str, loss_fn: LossFn
            ) -> tuple[Plan, str]:
    """The planner's layout for the job, the same on every rank, and what its devices were priced as."""
    n = world if world > 1 else cfg.pp or (torch.cuda.device_count() if torch.cuda.is_available() else 0) or 1
    space = search_space(cfg, world=world)  # refused before anything is traced
    if space["tp_sizes"] is None and not layers_split(config):
        space["tp_sizes"] = (1,)
    example = folder.example_inputs(seq_len=cfg.seq_len, micro_batch_size=1)
    costing = Costing(precision=cfg.precision, recompute=RECOMPUTE_FLAGS[cfg.recompute])
    if cfg.calibrate is not None:
        cluster, priced_on = _cluster_file(cfg.calibrate, n), f"the cluster in {cfg.calibrate}"
        if cfg.memory_reserve is not None:
            cluster = cluster.with_memory_reserve(cfg.memory_reserve)
    else:
        cluster = Cluster.uniform(n, preset, memory_reserve=cfg.memory_reserve)
        priced_on = f"{n} x {preset}"
    cluster = job_nodes(cluster, world)
    search = LayoutSearch(folder.build(meta=True, config=config), example, cluster=cluster,
                          global_batch=cfg.global_batch, costing=costing)
    if cfg.calibrate is None and cfg.device == "auto" and preset == "cpu":
        try:
            search.use_cluster(_calibrated(cfg, folder, config, cluster, example, costing, loss_fn))
            priced_on = f"{n} x cpu calibrated on the job's ranks"
        except CalibrationError as e:  # every rank fits the same (all-reduced) timings: all fall back together
            log.warning("calibration on the job's ranks failed (%s): the layouts are priced on the %r preset; give "
                        "--device cpu to skip calibration, or --calibrate FILE (pipecut calibrate)", e, preset)
    plan = _agreed(search, search.run(LayoutSpace(**space)))
    return plan, priced_on


def job_nodes(cluster: Cluster, world: int) -> Cluster:
    """``cluster`` with the job's node size, where a tp group may sit: the processes torchrun
    started on this host (``LOCAL_WORLD_SIZE``) instead of the preset's typical node (8 GPUs).

    Only devices that name a node size change: CPU processes (the ``cpu`` preset, a measured host:
    node size 0) keep searching tp only when ``--tp`` asks for it, because on a CPU host the tp
    all-reduces of processes sharing cores cost far more than the cost model says
    (``benchmarks/layout.py --tp 1,2``: docs/tensor-parallel.md, *Measured*). Without torchrun, or
    in one process, ``cluster`` as it is.

    Example:
        >>> import os
        >>> os.environ["LOCAL_WORLD_SIZE"] = "4"
        >>> job_nodes(Cluster.uniform(8, "H100-80GB"), 8).devices[0].node_size
        4
        >>> job_nodes(Cluster.uniform(8, "cpu"), 8).devices[0].node_size
        0
        >>> del os.environ["LOCAL_WORLD_SIZE"]
    """
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if world <= 1 or not local.isdigit() or int(local) < 1:
        return cluster
    size = int(local)
    devices = tuple(dataclasses.replace(d, node_size=size) if d.node_size > 0 else d for d in cluster.devices)
    return cluster if devices == cluster.devices else dataclasses.replace(cluster, devices=devices)


def _calibrated(cfg: TrainConfig, folder: HFFolder, config: Any, cluster: Cluster, example: Any,
                costing: Costing, loss_fn: LossFn) -> Cluster:
    """The cluster fitted to the model with real weights on the job's ranks (``calibrate_job``; collective)."""
    from runtime.overheads import calibrate_job

    with torch.random.fork_rng(devices=[]):  # the same random weights on every rank; the caller's RNG untouched
        torch.manual_seed(cfg.seed)
        model = folder.build(meta=False, config=config)
    vocab = int(getattr(config, "vocab_size", 2))

    def batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, vocab, (rows, cfg.seq_len + 1), generator=torch.Generator().manual_seed(cfg.seed))
        return ids[:, :-1], ids[:, 1:]

    real = LayoutSearch(model, example, cluster=cluster, global_batch=cfg.global_batch, costing=costing)
    fitted = calibrate_job(real, loss_fn, batch)
    dev = fitted.devices[0]
    log.info("calibrated on the job's ranks: %.3g GFLOP/s fp32, %.3g s per op, %.3g s per action, %s cores",
             dev.peak_flops_fp32 / 1e9, dev.op_overhead, dev.action_overhead, fitted.cores)
    return fitted


def _cluster_file(path: str, n: int) -> Cluster:
    """The cluster ``pipecut calibrate`` saved at ``path``, for ``n`` devices."""
    if not Path(path).is_file():
        raise TrainConfigError(f"--calibrate {path} does not exist: measure it with pipecut calibrate --devices {n} "
                               f"--out {path}")
    cluster = Cluster.load(path)
    if len(cluster) < n:
        raise TrainConfigError(f"{path} describes {len(cluster)} devices and the job has {n}: measure again with "
                               f"pipecut calibrate --devices {n} --out {path}")
    return cluster.with_devices(n)


def _agreed(search: LayoutSearch, plan: Plan) -> Plan:
    """Rank 0's layout on every rank: planning is deterministic, but a plan must be the same everywhere."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return plan
    assert plan.layout is not None  # internal invariant: the search's plans carry their layout
    lay = plan.layout
    mine = Option(lay.dp, lay.pp, lay.schedule, lay.microbatch_size, lay.zero, lay.global_batch, lay.tp)
    box: list[Option] = [mine]
    dist.broadcast_object_list(box, src=0)
    if box[0] == mine:
        return plan
    log.warning("rank %d chose %s, rank 0 %s: training rank 0's", dist.get_rank(), mine.label(), box[0].label())
    return search.plan(box[0])


# -- plans from files ----------------------------------------------------------------------------


def _check_world(plan: Plan, dp: int, pp: int, tp: int, world: int, source: str) -> None:
    """Refuse a plan the job's processes cannot run: another ``dp x pp x tp``, or replicas (or tp) in one process."""
    n = dp * pp * tp
    shape = f"{dp} replicas of a {pp}-rank pipeline" + (f" of {tp} processes per rank" if tp > 1 else "")
    if world == 1:
        if dp > 1 or tp > 1:
            raise PlanWorldError(
                f"{source} runs {shape} ({n} processes), and this is one process: launch it with torchrun "
                f"--nproc-per-node {n} -m pipecut train ..."
            )
        return
    if n != world:
        need = (f"{n} processes ({shape})" if plan.layout is not None
                else f"a multiple of its {pp} pipeline ranks" + (f" x {tp} tp processes" if tp > 1 else ""))
        launch = f"torchrun --nproc-per-node {n}" if plan.layout is not None else f"a multiple of {pp * tp} processes"
        raise PlanWorldError(
            f"{source} runs on {need}, and the job has {world}: launch {launch}, or make a plan for {world} "
            f"devices: pipecut plan MODEL --devices {world} --global-batch B --json plan.json"
        )


def _seq_len(plan: Plan) -> int | None:
    """The tokens per row the plan was traced with (``None``: not token ids)."""
    shape = plan.microbatch_shapes.get("input_ids")
    return int(shape[1]) if shape is not None and len(shape) == 2 else None


def _load(path: str) -> Plan:
    try:
        return Plan.load(path)
    except FileNotFoundError:
        raise TrainConfigError(f"--plan {path} does not exist: write one with pipecut plan MODEL --devices N "
                               f"--global-batch B --json {path}") from None


def _recorded(cfg: TrainConfig, folder: HFFolder, config: Any, world: int, out: Path) -> Plan | None:
    """The plan a ``--layout auto`` run recorded in ``out``, when this run resumes it and it still fits."""
    path = out / "plan.json"
    if not checkpoints.complete(out / "checkpoints") or not path.is_file():
        return None
    try:
        plan = Plan.load(path)
        if plan.layout is None:
            raise TrainPlanError("it holds no searched layout (an earlier --layout manual run)")
        resolved(cfg, plan, world, source=str(path))
        plan = bind_plan(plan, folder, config, cfg, source=str(path))
    except (PipecutError, OSError) as e:
        log.warning("%s does not fit this run (%s): searching the layout again; the checkpoint is loaded into it",
                    path, e)
        return None
    return plan
