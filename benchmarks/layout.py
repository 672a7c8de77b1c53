"""Benchmark: every layout of a GPT-2 on 4 gloo processes, its predicted step time against the measured one.

Run (CPU, 4 gloo processes of one thread each; writes ``benchmarks/results/layout.json``)::

    python benchmarks/layout.py                                  # 51 layouts, 5 to 10 minutes on 2 busy cores
    python benchmarks/layout.py --rounds 10 --warmup 2 --consecutive 3 --n-layer 4 --n-embd 128 --n-head 4 \\
        --vocab 2048 --seq 64 --batch 16 --microbatch-sizes 1,2,4 --schedules 1f1b,zbh1,interleaved,zbv,gpipe  # same
    python benchmarks/layout.py --quick --out /tmp/layout.json   # a tiny GPT-2, 5 layouts, 30 s to a minute
    python benchmarks/layout.py --cli-calibrate   # priced on `pipecut calibrate --model ...`'s file: layout_cli.json
    python benchmarks/layout.py --calibrate --tp 1,2 --schedules 1f1b,zbh1,interleaved --timeout 1800  # 48 layouts,
        # 15 of them tp 2: layout_tp.json; 24 minutes at load 7-33 (steps 21 of them), idle: not yet timed
    python benchmarks/layout.py --quick --tp 1,2 --out /tmp/layout_tp.json   # 8 layouts, 3 of them tp 2, a minute

Legend: ``dp`` replicas, ``pp`` ranks per pipeline, ``tp`` processes per pipeline rank (``dp * pp * tp = 4``;
``tp`` 1 unless ``--tp`` names more), ``b`` rows per micro-batch,
``m = B / (dp * b)`` micro-batches per step and replica, ``B`` the global batch (sequences), ``S``
stages (``2 * pp`` for ``'interleaved'`` and ``'zbv'``, else ``pp``).

A *layout* (:class:`Layout`) is ``(dp, pp, schedule, b, zero)``: every one that the global batch
divides into whole micro-batches is run; a one-rank pipeline (``pp = 1``) runs ``'1f1b'`` only
(its schedules are all plain gradient accumulation), and ``zero = 'zero1'`` (ZeRO-style optimizer
sharding, ``DataParallel(shard_optimizer=True)``) only where ``dp > 1``. With ``--tp 1,2`` the layouts
of ``tp = 2`` join them (``dp1 pp2 tp2 ...`` and ``dp2 pp1 tp2 ...``): each pipeline rank is 2
processes, its stages split over them (``TensorParallel(size=2)``, pipecut's GPT-2 plan), the plan
the one the planner prices at tp 2 (``Option(..., tp=2)``: no cut inside a column/row pair). On
the default model, schedules 1f1b, zbh1 and interleaved and ``b`` in 1, 2, 4 give 33 layouts at tp
1 and 15 at tp 2, 48 in all.

How the three columns are made:

* **predicted**: one ``partitioner.LayoutSearch`` per process traces and costs the model once;
  :func:`layout_plan` is its plan for a layout (the exact cut, priced: ``plan.layout``) and
  :func:`predicted_step_time` its predicted step: the simulated pipeline, the data-parallel
  exchange the drain does not hide, the optimizer step. :func:`planner_choice` is what
  ``plan_layout`` chooses over the same space. ``--cluster FILE`` prices on a calibrated cluster
  (``pipecut calibrate --devices 4 --out FILE``: this host's measured matmul speed with 4 processes
  sharing its cores, gloo's links and all-reduce); without it, the roofline ``'cpu'`` preset.
  ``--calibrate`` measures the host so, then fits it to the model on the benchmark's 4 processes
  (``runtime.overheads.calibrate_job``). ``--cli-calibrate`` runs ``pipecut calibrate --model
  benchmarks/layout_model.py:model --devices 4 --global-batch B`` (the same measurement and fit, in
  processes of its own) and prices, and cuts, on its file; the in-benchmark fit is made beside it
  (from the file's links) and its predictions of the same measured steps are reported too.
* **measured**: ONE job of 4 processes (``runtime.transport.launch.spawn``: file rendezvous, one
  thread per process, a deadline, stragglers killed) builds a trainer for every layout, each from
  its own copy of one seeded model, and then runs rounds: each round runs every layout in turn
  (the order rotated each round, a barrier before each step, so ranks never overlap two layouts
  and a noisy machine slows them alike), ``--consecutive`` steps of it in a row, the first not
  timed: it brings the layout's weights and optimizer state back into the caches, as a job
  running one layout has them. A step lasts from the first rank's start to the last rank's end;
  the first ``--warmup`` rounds are not timed; the median of the others is the layout's time.
  What was built is set aside from Python's collector first (``gc.freeze``): a job holds one
  trainer, and full collections scanning all 51 would slow the timed steps.
* **checked**: the first step of every layout returns the loss of the plain model on the same global
  batch (within ``RTOL``), or the run fails: no layout is timed that trains something else.

Reported, for every layout: predicted and measured seconds, their ratio, measured tokens per second,
and the rank of each (1 = fastest); then the issue's three targets: the planner's choice within 10%
of the measured best, the median ``|predicted / measured - 1|`` at most 0.15, and the Spearman rank
correlation of predicted and measured step times at least 0.8. With ``--tp``, each tp size's rows on
their own too (``summary.by_tp``: their median error, median ``pred / meas``, Spearman, measured
and predicted best), and the tp all-reduce the planner prices beside gloo's, timed on the job's
own tp groups (``tp_allreduce``, ``benchmarks/lib/tp_allreduce.py``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# This checkout's packages first (an editable install may point at another one), and lib/.
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from layout_model import CONFIGS, calibrate_with_cli, factory_for  # noqa: E402
from layout_model import build as build_model  # noqa: E402
from lib.common import int_list, load_before, quartiles, run_env, step_times, times_ms, write_result  # noqa: E402
from lib.layout_stats import CHOICE_WITHIN, MEDIAN_ERROR_AT_MOST, SPEARMAN_AT_LEAST, errors, ranks, targets  # noqa: E402
from lib.tp_allreduce import activation_bytes, measure, priced  # noqa: E402
from partitioner import Cluster, LayoutSearch, LayoutSpace, Plan  # noqa: E402
from partitioner.plan.layout import Option  # noqa: E402
from partitioner.schedule.registry import TRAINING_SCHEDULES, stages_per_rank  # noqa: E402
from runtime import DataParallel, Execution, PipelineTrainer, TensorParallel  # noqa: E402
from runtime.overheads import calibrate_job  # noqa: E402
from runtime.parallel.tensor import DERIVED_PLANS  # noqa: E402
from runtime.transport.launch import spawn  # noqa: E402

__all__ = [
    "Layout", "layouts", "option", "layout_plan", "predicted_step_time", "planner_choice", "PREDICTOR", "main",
]

PROCESSES = 4
ZERO = ("none", "zero1")
RTOL = 1e-4  # first-step loss against the plain model's
PREDICTOR = (
    "partitioner.LayoutSearch(model, (one row,), cluster=CLUSTER, global_batch=B): .plan(layout).layout.step_time "
    "(the exact cut, the simulated pipeline, the dp exchange the drain leaves, the optimizer step); choice: "
    ".run(schedules, microbatch_sizes, prune=False).layout"
)
# --quick: a tiny GPT-2 and a few layouts (anything given explicitly on the command line wins).
_QUICK = ["--rounds", "2", "--warmup", "1", "--consecutive", "2",
          *(f for k, v in CONFIGS["model_quick"].items() for f in (f"--{k.replace('_', '-')}", str(v))),
          "--batch", "8", "--microbatch-sizes", "2", "--schedules", "1f1b"]
_MODEL = CONFIGS["model"]
TP_PLAN = DERIVED_PLANS["gpt2"]  # c_attn packed by heads, c_fc by columns, both c_proj by rows


@dataclass(frozen=True)
class Layout:
    """How the 4 processes train one global batch: ``dp`` replicas of a ``pp``-rank pipeline, each
    rank ``tp`` processes wide (its stages split over them; the name shows ``tp`` when it is > 1).

    Example:
        >>> Layout(2, 2, "interleaved", 2, 4, "zero1").name, Layout(2, 2, "interleaved", 2, 4).stages
        ('dp2 pp2 interleaved b2 m4 zero1', 4)
        >>> Layout(1, 2, "1f1b", 2, 8, tp=2).name
        'dp1 pp2 tp2 1f1b b2 m8 none'
    """

    dp: int
    pp: int
    schedule: str
    microbatch_size: int  # b, rows per micro-batch
    microbatches: int  # m, per step and replica
    zero: str = "none"  # 'none' or 'zero1' (optimizer state sharded over dp)
    tp: int = 1  # processes per pipeline rank (tensor parallelism)

    @property
    def name(self) -> str:
        t = f" tp{self.tp}" if self.tp > 1 else ""
        return f"dp{self.dp} pp{self.pp}{t} {self.schedule} b{self.microbatch_size} m{self.microbatches} {self.zero}"

    @property
    def stages(self) -> int:
        """``S``: the stages the plan cuts (two per rank for the interleaved and V placements)."""
        return self.pp * stages_per_rank(self.schedule)


def layouts(
    processes: int, global_batch: int, microbatch_sizes: Sequence[int], schedules: Sequence[str] = TRAINING_SCHEDULES,
    tp_sizes: Sequence[int] = (1,),
) -> list[Layout]:
    """Every layout of ``processes`` ranks (``dp * pp * tp``, ``tp`` among ``tp_sizes``) that trains
    ``global_batch`` rows in whole micro-batches.

    Example:
        >>> [x.name for x in layouts(2, 4, [2], ["1f1b", "gpipe"])]
        ['dp1 pp2 1f1b b2 m2 none', 'dp1 pp2 gpipe b2 m2 none', 'dp2 pp1 1f1b b2 m1 none', 'dp2 pp1 1f1b b2 m1 zero1']
        >>> [x.name for x in layouts(2, 4, [2], ["1f1b"], tp_sizes=[2])]
        ['dp1 pp1 tp2 1f1b b2 m2 none']
    """
    out = []
    for tp in (t for t in tp_sizes if processes % t == 0):
        for dp in (d for d in range(1, processes // tp + 1) if processes // tp % d == 0):
            pp = processes // (tp * dp)
            for b in microbatch_sizes:
                if global_batch % (dp * b):
                    continue
                m = global_batch // (dp * b)
                for schedule in schedules if pp > 1 else schedules[:1]:
                    for zero in ZERO if dp > 1 else ZERO[:1]:
                        out.append(Layout(dp, pp, schedule, b, m, zero, tp))
    return out


# -- the planner's side -----------------------------------------------------------------------------


def option(layout: Layout, global_batch: int) -> Option:
    """The planner's name for ``layout``."""
    return Option(layout.dp, layout.pp, layout.schedule, layout.microbatch_size, layout.zero, global_batch, layout.tp)


def layout_plan(search: LayoutSearch, layout: Layout) -> Plan:
    """The plan that trains ``layout``, priced by the planner (``plan.layout``), on its own copy of the model."""
    with warnings.catch_warnings():  # torch's pytree warns about its own LeafSpec as it is copied
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(search.plan(option(layout, search.global_batch)))


def predicted_step_time(plan: Plan, layout: Layout) -> float:
    """Seconds one step of ``layout`` is predicted to take: pipeline, exchange left, optimizer step."""
    assert plan.layout is not None and plan.layout.label() == option(layout, plan.layout.global_batch).label()
    return plan.layout.step_time


def planner_choice(search: LayoutSearch, space: Sequence[Layout]) -> str:
    """The layout ``plan_layout`` picks over the benchmark's space, by the benchmark's name.

    The search prices every schedule on a one-rank pipeline too (1F1B, ZB-H1 and GPipe are the same
    run there); the benchmark runs that run once, under the space's one schedule for ``pp = 1``. The
    tp sizes are the space's, given explicitly (the ``'cpu'`` preset and a measured host name no node
    size, so the search tries tp 1 alone unless told).
    """
    schedules = sorted({lay.schedule for lay in space}, key=TRAINING_SCHEDULES.index)
    sizes = sorted({lay.microbatch_size for lay in space})
    zero = [z for z in ZERO if any(lay.zero == z for lay in space)]  # the shardings the benchmark runs
    tps = sorted({lay.tp for lay in space})
    plan = search.run(LayoutSpace(schedules=schedules, microbatch_sizes=sizes, zero=zero, tp_sizes=tps, prune=False))
    lay = plan.layout
    assert lay is not None
    single = next((x.schedule for x in space if x.pp == 1), lay.schedule)
    return Layout(lay.dp, lay.pp, single if lay.pp == 1 else lay.schedule, lay.microbatch_size, lay.microbatches,
                  lay.zero, lay.tp).name


# -- the measured side -----------------------------------------------------------------------------------


def _cluster(cfg: dict[str, Any], world: int) -> Cluster:
    """The cluster the planner prices: a calibration file (``--cluster``) or the roofline ``'cpu'`` preset."""
    return Cluster.load(cfg["cluster"]).with_devices(world) if cfg.get("cluster") else Cluster.uniform(world, "cpu")


def _fit(search: LayoutSearch, out: dict[str, float], x: torch.Tensor, y: torch.Tensor) -> Cluster:
    """The cluster fitted, on every rank at once, to the model's own step and the runtime's actions.

    Every rank times a one-stage trainer step of the model at two sizes (``runtime.overheads.
    fit_to_runtime``: the traced graph and the loss, as the runtime runs them) while the others do
    too, so the cores they share are in the figures, and the slowest rank's times are fitted (one
    cluster, one plan everywhere); then the runtime's cost per action, on the model cut into one
    stage per rank by the search and priced by it (``runtime.overheads.measure_action_overhead``),
    and the cores the ranks share (``Cluster.cores``).
    """
    rows = x.shape[0]

    def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        pick = torch.arange(b) % rows
        return x[pick], y[pick]

    cluster = calibrate_job(search, _lm_loss, batch)
    keys = ("peak_flops", "peak_flops_fp32", "mem_bandwidth", "op_overhead", "action_overhead")
    out.update({k: float(getattr(cluster.devices[0], k)) for k in keys})
    out["cores"] = float(cluster.cores or 0)
    return cluster


def calibrate(cfg: dict[str, Any], path: str) -> Cluster:
    """Measure this host as the benchmark's 4 processes get it, at the model's matrix sizes, and save it."""
    from partitioner.cost.gemms import model_gemms
    from partitioner.cost.probes import Probe
    from partitioner.tracing.trace import trace

    x, _ = _data(cfg)
    b = max(cfg["microbatch_sizes"])
    gemms = model_gemms(trace(_model(cfg), (x[:b],)))
    cluster = Cluster.measure(PROCESSES, probe=Probe().with_gemms(gemms) if gemms else Probe(), timeout=600)
    cluster.save(path)
    return cluster


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # (B, T, V), (B, T)
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _model(cfg: dict[str, Any]) -> nn.Module:
    return build_model(**{k: cfg[k] for k in _MODEL})


def _data(cfg: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)  # the same global batch on every rank
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)
    y = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)
    return x, y


def _trainer(plan: Plan, layout: Layout, meshes: dict[tuple[int, int], Any], timeout: float) -> PipelineTrainer:
    """A trainer of ``layout`` on its own copy of the model; replicas on one DeviceMesh per ``(dp, pp)`` shape
    (layouts run one at a time, so those of one shape share its process groups: fewer gloo contexts).
    A tp layout's trainer builds its own ``("dp", "pp", "tp")`` mesh from the sizes (it refuses a given one).
    The tp plan is pipecut's own GPT-2 plan, given: the zoo's model wraps the Hugging Face one
    (``CausalLMLogits``, no ``config`` of its own), so the trainer would not find it by itself."""
    zero1 = layout.zero == "zero1"
    if layout.tp > 1:
        dp = DataParallel(size=layout.dp, shard_optimizer=zero1)
    elif layout.dp > 1:
        if (layout.dp, layout.pp) not in meshes:
            from torch.distributed.device_mesh import init_device_mesh

            meshes[layout.dp, layout.pp] = init_device_mesh("cpu", (layout.dp, layout.pp),
                                                            mesh_dim_names=("dp", "pp"))
        dp = DataParallel(mesh=meshes[layout.dp, layout.pp], shard_optimizer=zero1)
    else:
        dp = DataParallel(size=1)
    return PipelineTrainer(plan, _lm_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                           execution=Execution(schedule=layout.schedule, microbatches=layout.microbatches,
                                               transport="dist", timeout=timeout),
                           data_parallel=dp, tensor_parallel=TensorParallel(size=layout.tp, plan=TP_PLAN))


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    phases = {"start": time.perf_counter()}
    model = _model(cfg)
    x, y = _data(cfg)
    with torch.no_grad():
        want = _lm_loss(model(x), y)
    cluster = _cluster(cfg, world)
    todo = [Layout(**d) for d in cfg["layouts"]]
    trainers: dict[str, PipelineTrainer] = {}
    predicted: dict[str, float] = {}
    meshes: dict[tuple[int, int], Any] = {}
    build_s: dict[str, tuple[float, float]] = {}  # per layout: seconds to plan, to build the trainer
    search = LayoutSearch(copy.deepcopy(model), (x[:1],), cluster=cluster, global_batch=cfg["batch"])
    fitted: dict[str, float] = {}
    beside: dict[str, Any] = {}  # --cli-calibrate: the in-benchmark fit's predictions of the same runs
    if cfg.get("calibrate"):
        search.use_cluster(_fit(search, fitted, x, y))
    elif cfg.get("cli"):
        _fit(search, fitted, x, y)  # from the file's cluster: its links, a fit of this job's own
        beside = {"predicted": {lay.name: search.price(option(lay, cfg["batch"])).step_time for lay in todo},
                  "choice": planner_choice(search, todo) if rank == 0 else ""}
        search.use_cluster(cluster)  # the command line's cluster prices, and cuts, what is run
    for layout in todo:  # the same order on every rank: meshes and trainers are collective
        t0 = time.perf_counter()
        plan = layout_plan(search, layout)  # every layout's own copy of the model
        predicted[layout.name] = predicted_step_time(plan, layout)
        t1 = time.perf_counter()
        trainers[layout.name] = _trainer(plan, layout, meshes, cfg["timeout"])
        build_s[layout.name] = (t1 - t0, time.perf_counter() - t1)
    choice = planner_choice(search, todo) if rank == 0 else ""
    tp_allreduce = {}  # per tp size: the planner's all-reduce beside gloo's on the job's tp groups
    sizes = activation_bytes(cfg["microbatch_sizes"], cfg["seq"], cfg["n_embd"])
    for tp in sorted({lay.tp for lay in todo} - {1}):
        group = next(trainers[lay.name] for lay in todo if lay.tp == tp).mesh.tp_group
        tp_allreduce[tp] = {"bytes": sizes, "measured_s": list(measure(group, sizes).values()),
                            "priced_s": list(priced(search.cluster, tp, sizes).values())}
    # A job holds one trainer; this one holds them all, and Python's full collections would scan
    # every one of them during the timed steps: set what was built aside from the collector.
    gc.collect()
    gc.freeze()
    phases["build"] = time.perf_counter()
    runs: dict[str, Callable[[], torch.Tensor]] = {
        name: (lambda tr=tr: tr.step(*tr.local_batch(x, y))) for name, tr in trainers.items()  # type: ignore[misc]
    }
    names = list(trainers)
    spans: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    first_loss: dict[str, float] = {}
    for rnd in range(cfg["warmup"] + cfg["rounds"]):
        for k in range(len(names)):
            name = names[(rnd + k) % len(names)]  # rotate the order: no layout always runs first
            for rep in range(cfg["consecutive"]):  # the first of a layout's steps in a row warms its caches
                dist.barrier()
                t0 = time.perf_counter()
                loss = runs[name]()
                t1 = time.perf_counter()
                if rnd == 0 and rep == 0:  # the first step: the untouched model's loss on the global batch
                    first_loss[name] = float(loss)
                    if not math.isclose(float(loss), float(want), rel_tol=RTOL):
                        raise AssertionError(f"layout {name!r}: first-step loss {float(loss):.6f} differs from the "
                                             f"plain model's {float(want):.6f} on the same global batch")
                elif rnd >= cfg["warmup"] and (rep or cfg["consecutive"] == 1):
                    spans[name].append((t0, t1))
    dist.barrier()
    gc.unfreeze()
    phases["steps"] = time.perf_counter()
    marks = list(phases.values())
    return {"spans": spans, "predicted": predicted, "choice": choice, "build_s": build_s, "first_loss": first_loss,
            "fitted": fitted, "beside": beside, "tp_allreduce": tp_allreduce,
            "reference_loss": float(want),
            "phases_s": {k: b - a for k, a, b in zip(list(phases)[1:], marks, marks[1:])}}


def _rows(todo: list[Layout], predicted: dict[str, float], times: dict[str, list[float]],
          cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per layout: predicted and measured seconds, their ratio, tokens per second, ranks."""
    measured = {name: statistics.median(ts) for name, ts in times.items()}
    names = [lay.name for lay in todo]
    rank_p = dict(zip(names, ranks([predicted[n] for n in names])))
    rank_m = dict(zip(names, ranks([measured[n] for n in names])))
    rows = []
    for lay in todo:
        ts = times[lay.name]
        q = quartiles(ts)
        meas = measured[lay.name]
        rows.append({**asdict(lay), "name": lay.name, "stages": lay.stages, "predicted_s": predicted[lay.name],
                     "measured_s": meas, "p25_s": q[0], "p75_s": q[2], "n": len(ts),
                     "pred_over_meas": predicted[lay.name] / meas,
                     "tokens_per_s": cfg["batch"] * cfg["seq"] / meas,
                     "rank_predicted": rank_p[lay.name], "rank_measured": rank_m[lay.name]})
    return sorted(rows, key=lambda r: r["measured_s"])


def _print(cfg: dict[str, Any], rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (f"GPT-2 {cfg['n_layer']} layers x {cfg['n_embd']}, vocab {cfg['vocab']}, seq {cfg['seq']}; global batch "
             f"{cfg['batch']}; {PROCESSES} gloo processes x 1 thread on {os.cpu_count()} CPUs; AdamW; median of "
             f"{cfg['rounds']} interleaved rounds after {cfg['warmup']} warm-up")
    table = Table(title=title, title_justify="left")
    for col in ("layout", "S", "predicted s", "measured s", "pred/meas", "tokens/s", "rank pred", "rank meas"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for r in rows:
        mark = " *" if r["name"] == summary["choice"] else ""
        table.add_row(r["name"] + mark, str(r["stages"]), f"{r['predicted_s']:.4f}", f"{r['measured_s']:.4f}",
                      f"{r['pred_over_meas']:.2f}", f"{r['tokens_per_s']:.0f}", f"{r['rank_predicted']:g}",
                      f"{r['rank_measured']:g}")
    console = Console(width=140)
    console.print(table)
    ok = {True: "[green]met[/]", False: "[red]missed[/]"}
    rho = summary["spearman"]
    console.print(f"predictor: {summary['predictor']}")
    console.print(f"planner's choice (*) {summary['choice']}: measured rank {summary['choice_measured_rank']} of "
                  f"{summary['layouts']}, {summary['choice_vs_best']:+.1%} vs the measured best "
                  f"({summary['measured_best']}); target <= +{CHOICE_WITHIN:.0%}: {ok[summary['choice_within_10pct']]}")
    console.print(f"median |predicted / measured - 1|: {summary['median_abs_error']:.3f}; target <= "
                  f"{MEDIAN_ERROR_AT_MOST}: {ok[summary['median_abs_error_ok']]}")
    console.print(f"Spearman rank correlation: {'n/a' if rho is None else f'{rho:.3f}'}; target >= "
                  f"{SPEARMAN_AT_LEAST}: {ok[summary['spearman_ok']]}")
    for tp, e in summary.get("by_tp", {}).items():  # each tp size's rows on their own
        if e["layouts"]:
            r = e["spearman"]
            console.print(f"{tp} rows alone ({e['layouts']}): median |pred/meas - 1| {e['median_abs_error']:.3f}, "
                          f"median pred/meas {e['median_pred_over_meas']:.2f}, Spearman "
                          f"{'n/a' if r is None else f'{r:.3f}'}; measured best {e['measured_best']}, predicted best "
                          f"{e['predicted_best']}")


def _print_beside(summary: dict[str, Any]) -> None:
    """The two calibrations' figures on the same measured steps, side by side."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="the same measured steps, priced by each calibration", title_justify="left")
    for col in ("cluster", "choice", "choice vs best", "median |pred/meas - 1|", "Spearman"):
        table.add_column(col, justify="left" if col in ("cluster", "choice") else "right")
    for label, t in (("pipecut calibrate --model (run)", summary),
                     ("in-benchmark fit (calibrate_job)", summary["in_benchmark_fit"])):
        rho = t["spearman"]
        table.add_row(label, t["choice"], f"{t['choice_vs_best']:+.1%}", f"{t['median_abs_error']:.3f}",
                      "n/a" if rho is None else f"{rho:.3f}")
    Console(width=140).print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds (median over these)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first (>= 1: the first checks the loss)")
    ap.add_argument("--consecutive", type=int, default=3,
                    help="steps of a layout in a row per round; the first is not timed (it warms the caches)")
    for key, value in _MODEL.items():  # the model: benchmarks/layout_model.py's
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=value)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences), the same in every layout")
    ap.add_argument("--microbatch-sizes", type=int_list, default=[1, 2, 4], help="b values to try, e.g. 1,2,4")
    ap.add_argument("--schedules", default=",".join(TRAINING_SCHEDULES), help="schedules to try (pp > 1)")
    ap.add_argument("--tp", type=int_list, default=[1], help="tensor-parallel sizes to try, e.g. 1,2 (each divides "
                    f"the {PROCESSES} processes and the heads); with a size > 1 the result is layout_tp.json")
    ap.add_argument("--quick", action="store_true", help="shorthand for a smoke test: " + " ".join(_QUICK))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    ap.add_argument("--cluster", default=None, help="a cluster JSON to price on (pipecut calibrate --devices 4 "
                    "--out FILE); default: the 'cpu' preset")
    ap.add_argument("--calibrate", action="store_true",
                    help="measure this host right before the run (4 processes at the model's matrix sizes), save it "
                    "beside --out as *.cluster.json and price on it")
    ap.add_argument("--cli-calibrate", action="store_true",
                    help="price on the cluster `pipecut calibrate --model benchmarks/layout_model.py:model --devices 4 "
                    "--global-batch B` writes (beside --out as *.cluster.json), with the in-benchmark fit beside it")
    ap.add_argument("--out", default=None,
                    help="the result (default benchmarks/results/layout.json; layout_cli.json with --cli-calibrate)")
    cli = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(cli)
    if args.quick:
        args = ap.parse_args(_QUICK + cli)
    if args.out is None:
        name = "layout_cli" if args.cli_calibrate else "layout"
        args.out = str(ROOT / "benchmarks" / "results" / f"{name}{'_tp' if max(args.tp) > 1 else ''}.json")
    schedules = [s for s in args.schedules.split(",") if s]
    unknown = sorted(set(schedules) - set(TRAINING_SCHEDULES))
    if unknown or args.rounds < 1 or args.warmup < 1 or args.consecutive < 1:
        ap.error(f"need --rounds >= 1, --warmup >= 1, --consecutive >= 1 and schedules among "
                 f"{', '.join(TRAINING_SCHEDULES)} (unknown: {unknown})")
    bad_tp = [t for t in args.tp if t < 1 or PROCESSES % t or args.n_head % t]
    if bad_tp or not args.tp:
        ap.error(f"--tp {args.tp}: each size must divide the {PROCESSES} processes and the {args.n_head} heads "
                 f"(offending: {bad_tp}); e.g. --tp 1,2")
    todo = layouts(PROCESSES, args.batch, args.microbatch_sizes, schedules, sorted(set(args.tp)))
    if len(todo) < 2:
        ap.error(f"--batch {args.batch} and --microbatch-sizes {args.microbatch_sizes} give {len(todo)} layout(s); "
                 "a ranking needs at least two")
    keys = ("rounds", "warmup", "consecutive", "n_layer", "n_embd", "n_head", "vocab", "seq", "batch",
            "microbatch_sizes", "cluster")
    cfg = {k: getattr(args, k) for k in keys}
    cfg["tp_sizes"] = sorted(set(args.tp))
    cfg.update(schedules=schedules, layouts=[asdict(lay) for lay in todo],
               timeout=min(300.0, args.timeout))  # a peer waited on longer than this has failed

    factory = factory_for(cfg)
    if args.cli_calibrate and (args.calibrate or args.cluster or factory is None):
        ap.error("--cli-calibrate calibrates through `pipecut calibrate` on its own: without --calibrate or "
                 "--cluster, and on benchmarks/layout_model.py's models (the default or --quick's)")

    t0 = time.time()
    cfg["calibrate"], cfg["cli"] = args.calibrate, args.cli_calibrate
    cli_run: dict[str, Any] = {}
    if args.cli_calibrate:
        assert factory is not None  # checked above
        cfg["cluster"] = str(Path(args.out).with_suffix(".cluster.json"))
        cli_run = calibrate_with_cli(factory, PROCESSES, args.batch, cfg["cluster"], quick=args.quick,
                                     timeout=min(900.0, args.timeout))
        print(f"calibrated through the command line in {cli_run['wall_s']:.0f} s: {cli_run['command']}")
    if args.calibrate:
        cfg["cluster"] = str(Path(args.out).with_suffix(".cluster.json"))
        host = calibrate(cfg, cfg["cluster"])
        dev = host.devices[0]
        print(f"calibrated: {dev.peak_flops_fp32 / 1e9:.0f} GFLOP/s fp32, {dev.mem_bandwidth / 1e9:.1f} GB/s, "
              f"op overhead {dev.op_overhead * 1e6:.1f} us, link {host.link_bandwidth[0] / 1e9:.2f} GB/s + "
              f"{host.link_latency[0] * 1e6:.0f} us, all-reduce "
              f"{(host.collective_bandwidth or 0) / 1e9:.2f} GB/s -> {cfg['cluster']}")
    load = load_before(f"the {PROCESSES} processes")
    print(f"{len(todo)} layouts; building a trainer for each on every rank, then {args.warmup} + {args.rounds} rounds")
    ranks_out = spawn(_worker, PROCESSES, cfg, timeout=args.timeout, threads=1)
    print("phases (s, rank 0): " + ", ".join(f"{k} {v:.1f}" for k, v in ranks_out[0]["phases_s"].items()))
    fits = {"fitted to the model on the 4 ranks": ranks_out[0]["fitted"],
            "fitted by pipecut calibrate --model": (cli_run.get("fitted_to") or {}) if args.cli_calibrate else {}}
    for what, f in fits.items():
        if f:
            print(f"{what}: {f['peak_flops_fp32'] / 1e9:.1f} GFLOP/s, {f['mem_bandwidth'] / 1e9:.1f} GB/s, "
                  f"{f['op_overhead'] * 1e6:.1f} us per op, {f['action_overhead'] * 1e3:.2f} ms per action, "
                  f"{f['cores'] or 0:.0f} cores shared")
    times = step_times([r["spans"] for r in ranks_out])
    predicted = ranks_out[0]["predicted"]
    measured = {name: statistics.median(ts) for name, ts in times.items()}
    summary = {"predictor": PREDICTOR, **targets(predicted, measured, ranks_out[0]["choice"])}
    if max(cfg["tp_sizes"]) > 1:  # the tp rows' errors on their own, and the tp 1 rows' beside them
        summary["by_tp"] = {f"tp{t}": errors(predicted, measured, [lay.name for lay in todo if lay.tp == t])
                            for t in cfg["tp_sizes"]}
    rows = _rows(todo, predicted, times, cfg)
    _print(cfg, rows, summary)
    beside = ranks_out[0]["beside"]
    if beside:
        summary["in_benchmark_fit"] = targets(beside["predicted"], measured, beside["choice"])
        for row in rows:
            row["predicted_in_benchmark_fit_s"] = beside["predicted"][row["name"]]
        _print_beside(summary)
    tp_allreduce = {f"tp{tp}": {**v, "measured_s": [max(r["tp_allreduce"][tp]["measured_s"][i] for r in ranks_out)
                                                    for i in range(len(v["bytes"]))]}  # the slowest group's
                    for tp, v in ranks_out[0]["tp_allreduce"].items()}
    for tp, v in tp_allreduce.items():
        print(f"{tp} all-reduce (one per block pair and micro-batch, each way), priced / measured on the tp groups: "
              + ", ".join(f"{n // 1024} KiB {p * 1e6:.0f} / {m * 1e6:.0f} us"
                          for n, p, m in zip(v["bytes"], v["priced_s"], v["measured_s"])))
    result = {
        "benchmark": "layout",
        "command": shlex.join(["python", "benchmarks/layout.py", *cli]),
        "config": {**{k: v for k, v in cfg.items() if k != "layouts"}, "processes": PROCESSES,
                   "threads_per_process": 1, "model": "partitioner.zoo.gpt2 (Hugging Face GPT-2, tied embedding, "
                   "dropout 0)", "loss": "cross_entropy", "optimizer": "AdamW(lr=1e-4)",
                   "tokens_per_step": args.batch * args.seq, "cluster": cfg["cluster"] or "Cluster.uniform(4, 'cpu')"},
        "env": run_env(load, t0),
        "summary": summary,
        "fitted": ranks_out[0]["fitted"],
        "tp_allreduce": tp_allreduce,
        "cli_calibration": cli_run or None,
        "targets": {"choice_within": CHOICE_WITHIN, "median_abs_error_at_most": MEDIAN_ERROR_AT_MOST,
                    "spearman_at_least": SPEARMAN_AT_LEAST},
        "layouts": rows,
        "check": {"reference_loss": ranks_out[0]["reference_loss"], "rtol": RTOL,
                  "first_step_loss": ranks_out[0]["first_loss"]},
        "phases_s": {f"rank {r}": res["phases_s"] for r, res in enumerate(ranks_out)},
        "build_s_rank0": {k: {"plan": round(a, 3), "trainer": round(b, 3)}
                          for k, (a, b) in ranks_out[0]["build_s"].items()},
        "times_ms": times_ms(times),
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
