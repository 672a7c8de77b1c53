"""Benchmark: every schedule measured against the simulator, on stages of fixed cost and on a GPT-2.

Run (CPU; about 5 minutes with the defaults: ~2 for the fixed-cost stages in threads, ~2 for
them over 4 gloo processes, ~1 for the GPT-2 over 2 gloo processes)::

    python benchmarks/schedules.py
    python benchmarks/schedules.py --ms 4 8 16 --schedules gpipe 1f1b interleaved zbh1 zbv \
        --cost-ms 40 --steps 5 --transports local dist --out benchmarks/results/schedules.json
    python benchmarks/schedules.py --quick --skip-real          # seconds: p = 2, m = 4, 2 ms costs

Legend: ``p`` ranks, ``m`` micro-batches, ``v`` stages (chunks) per rank, ``S = p v`` stages.

**Fixed costs.** Each stage is one ``SleepBlock`` (``lib/fixed_cost.py``): ``y = sleep_F(x) +
sleep_W(bias)``, where ``sleep_F`` is an autograd Function whose forward sleeps ``F`` and whose
backward sleeps ``B_in`` and passes the gradient through, and ``sleep_W`` is one whose backward
sleeps ``W`` (the bias's gradient). ``time.sleep`` releases the GIL and takes the same time
whatever else the 2 cores are doing, so a stage costs ``F``, ``B_in`` and ``W`` per micro-batch,
not what the shared machine allows. A sleep in a Function returns 0.2-0.5 ms late on this
machine (its overshoot, and code running on a CPU gone cold); each process first measures that
on a block run alone and shortens every sleep by it (``--no-calibrate`` to keep the nominal
sleeps; the JSON records the excess before and after). The split backward
(``runtime.execute.split_backward``) finds the ``+`` as the branch node: ``I`` runs ``sleep_F``'s
backward (``B_in``), ``W`` runs ``sleep_W``'s (``W``), and a fused ``B`` both. The batch requires
grad, so stage 0 also computes an input gradient in ``I`` as every other stage does (otherwise
the executor would leave all of stage 0's backward to ``W``). ``F = B_in = W = --cost-ms`` per
rank (40 ms by default: a two-chunk schedule's chunks sleep 20 ms each). Each block is a leaf
module for tracing, and ``split_points`` put exactly one block in each stage.

The trainer runs in-process (``transport='local'``, one thread per rank) and, with ``dist`` in
``--transports``, over ``p`` gloo processes (``runtime.transport.launch.spawn``). Per ``(schedule, m)``:

* **simulated**: ``simulate(get_schedule(...), StageCosts.uniform(S, F/v, B_in/v, W/v))``, free
  links (hand-overs in one process cost microseconds). ``sim (measured actions)`` is the same
  run with each stage's median measured ``F``/``I``/``W``/``B`` durations instead: the gap
  between it and the measured step is what the simulator's model of the schedule misses; the
  gap between it and ``simulated`` is the executor's per-action overhead.
* **measured step**: the median over ``--steps`` steps after ``--warmup`` of the wall time of
  ``trainer.forward_backward`` (in-process), or from the first rank's start to the last rank's
  end after a barrier (gloo).
* **bubble**: from the recorded actions (``trainer.last_records``). A recorded action includes
  the time its receive waited for a message, which is idle time, so each action's start is
  moved to when its input was produced (the producer's recorded end, on another rank) before
  ``partitioner.schedule.timeline.from_records`` computes ``busy``, ``bubble`` and the idle time per rank
  (``step - busy``). Transfer time after the producer's end still counts as busy.
* **peak held**: per rank, the most (stage, micro-batch) activations held at once, from ``F``
  to its ``B``/``W`` (``Timeline.peak_inflight``), against the schedule's own count
  (``partitioner.schedule.validation.peak_inflight_per_rank``). A chunk holds ``1/v`` of a rank's layers, so
  memory in whole-stage units is ``peak / v``.
* **ZB vs 1F1B**: idle time per rank (mean over ranks; the paper's statement: ZB-H1 idles
  ``(p - 1)(F + B - W)`` against 1F1B's ``(p - 1)(F + B + W)``, a third) and bubble fractions
  (ZB-H1's is more than a third of 1F1B's, its step being shorter). The target uses idle time.

**Real model.** A GPT-2 from a config (``partitioner.zoo.gpt2``), planned for 2 stages on
``Cluster.uniform(2, 'cpu')`` with the cut at the middle block, priced twice: ``profile=True``
(per-node times measured on this CPU, one thread) and the roofline ``cpu`` preset. The profiled
plan trains with each one-stage-per-rank schedule over 2 gloo processes, one thread each;
reported: ``plan.prediction(schedule).step_time`` of both plans against the measured median.
Cross-entropy loss; no optimizer (``forward_backward``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helpers in lib/
from lib.common import git_state
from lib.fixed_cost import ROWS, WIDTH, SleepBlock, calibrate
from lib.schedules_report import print_report, save_traces
from partitioner import Cluster, Plan, partition
from partitioner.errors import PipecutError
from partitioner.schedule.registry import get_schedule, stages_per_rank
from partitioner.schedule.simulate import StageCosts, simulate
from partitioner.schedule.timeline import Timeline, from_records
from partitioner.schedule.validation import peak_inflight_per_rank
from partitioner.zoo import gpt2
from runtime.options import Execution
from runtime.trainer import PipelineTrainer
from runtime.transport.launch import LaunchError, spawn

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbh1", "zbv")
ZERO_BUBBLE = ("zbh1", "zbv")


# -- stages of fixed cost (the blocks: lib/fixed_cost.py) -------------------------------------------


def _fixed_trainer(schedule: str, p: int, m: int, cost_s: float, transport: str) -> PipelineTrainer:
    v = stages_per_rank(schedule)
    S = p * v
    c = cost_s / v  # a chunk holds 1/v of a rank's layers: a rank's work is the same
    chain = nn.Sequential(*(SleepBlock(c, c, c) for _ in range(S)))  # block s is stage s
    plan = partition(chain, (torch.zeros(ROWS, WIDTH),), S, schedule=schedule, microbatches=m,
                     split_points=[str(s) for s in range(1, S)], leaf_modules=[SleepBlock])
    return PipelineTrainer(plan, nn.functional.mse_loss, None,
                           execution=Execution(schedule=schedule, microbatches=m, transport=transport, record=True))


def _fixed_batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    # requires_grad: stage 0 computes an input gradient in I, as the others do (module docstring)
    return torch.randn(m * ROWS, WIDTH, requires_grad=True), torch.zeros(m * ROWS, WIDTH)


def _run_local(schedule: str, p: int, m: int, cost_s: float, steps: int, warmup: int) -> list[dict[str, Any]]:
    """In-process steps: per timed step, its wall time and every rank's records."""
    tr = _fixed_trainer(schedule, p, m, cost_s, "local")
    x, y = _fixed_batch(m)
    out = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        tr.forward_backward(x, y)
        t1 = time.perf_counter()
        if i >= warmup:
            out.append({"wall": t1 - t0, "records": list(tr.last_records)})
    return out


def _dist_fixed_worker(rank: int, world: int, schedule: str, ms: Sequence[int], cost_s: float,
                       steps: int, warmup: int, calibrate_s: float | None) -> dict[str, Any]:
    """Per m, this rank's timed steps (``"runs"``), and its sleep calibration."""
    cal = calibrate(calibrate_s) if calibrate_s else None
    out: dict[int, list[dict[str, Any]]] = {}
    for m in ms:
        tr = _fixed_trainer(schedule, world, m, cost_s, "dist")
        torch.manual_seed(m)
        x, y = _fixed_batch(m)
        out[m] = _timed_dist_steps(tr, x, y, steps, warmup)
    return {"runs": out, "calibration": cal}


def _timed_dist_steps(tr: PipelineTrainer, x: Any, y: Any, steps: int, warmup: int) -> list[dict[str, Any]]:
    """This rank's (start, end) and records per timed step; each step starts after a barrier."""
    out = []
    for i in range(warmup + steps):
        tr.zero_grad()
        dist.barrier()
        t0 = time.perf_counter()  # CLOCK_MONOTONIC: one clock for every process of the host
        tr.forward_backward(x, y)
        t1 = time.perf_counter()
        if i >= warmup:
            out.append({"start": t0, "end": t1, "records": list(tr.last_records)})
    return out


def _merge_ranks(per_rank: Sequence[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per step: first rank's start to last rank's end, and all ranks' records."""
    return [
        {"wall": max(r["end"] for r in step) - min(r["start"] for r in step),
         "records": [x for r in step for x in r["records"]]}
        for step in zip(*per_rank)
    ]


# -- measured and simulated timelines ------------------------------------------------------------


def _kind(record: Any) -> str:
    return str(getattr(record.kind, "value", record.kind))


def busy_timeline(records: Sequence[Any], num_ranks: int) -> Timeline:
    """The records as a timeline of work only: each action starts when its input was produced.

    A recorded action begins before its blocking receive, so its span includes the wait. The
    input of ``F`` on stage ``s`` is ``F`` of ``s - 1``; that of a backward (``B``/``I``) on ``s``
    is the backward of ``s + 1``. Only a producer on another rank is waited for.
    """
    S = 1 + max(x.stage for x in records)
    by_action = {(x.stage, _kind(x), x.mb): x for x in records}
    moved = []
    for x in records:
        k = _kind(x)
        producer = None
        if k == "F" and x.stage > 0:
            producer = by_action.get((x.stage - 1, "F", x.mb))
        elif k in ("B", "I") and x.stage < S - 1:
            producer = by_action.get((x.stage + 1, "I", x.mb)) or by_action.get((x.stage + 1, "B", x.mb))
        start = x.start
        if producer is not None and producer.rank != x.rank:
            start = min(max(x.start, producer.end), x.end)
        moved.append(dataclasses.replace(x, start=start))
    return dataclasses.replace(from_records(moved), num_ranks=num_ranks)


def _idle(t: Timeline) -> tuple[float, ...]:
    """Per rank, seconds idle during the step."""
    return tuple(t.step_time - b for b in t.busy)


def _durations(timelines: Sequence[Timeline]) -> dict[tuple[int, str], list[float]]:
    """Per (stage, action kind), every measured duration."""
    durations: dict[tuple[int, str], list[float]] = {}
    for t in timelines:
        for x in t.spans:
            durations.setdefault((x.stage, x.kind.value), []).append(x.duration)
    return durations


def _action_costs(timelines: Sequence[Timeline], S: int) -> StageCosts:
    """Per stage, the median measured duration of each action kind, as simulator costs."""
    durations = _durations(timelines)

    def med(s: int, k: str) -> float:
        return statistics.median(durations[(s, k)]) if (s, k) in durations else 0.0

    fused = any(k == "B" for _, k in durations)
    return StageCosts(
        forward=tuple(med(s, "F") for s in range(S)),
        backward_input=tuple(med(s, "B") if fused else med(s, "I") for s in range(S)),
        backward_weight=tuple(0.0 if fused else med(s, "W") for s in range(S)),
    )


def _row(schedule: str, p: int, m: int, cost_s: float, transport: str, steps: list[dict[str, Any]] | None,
         error: str | None) -> tuple[dict[str, Any], dict[str, Timeline]]:
    """One (schedule, m, transport): simulated, measured, and the timelines for traces."""
    v = stages_per_rank(schedule)
    S = p * v
    sched = get_schedule(schedule, p, m, **({"v": v} if schedule == "interleaved" else {}))
    sim = simulate(sched, StageCosts.uniform(S, forward=cost_s / v, backward_input=cost_s / v,
                                             backward_weight=cost_s / v))
    want_peak = peak_inflight_per_rank(sched)
    row: dict[str, Any] = {
        "schedule": schedule, "m": m, "p": p, "v": v, "stages": S, "transport": transport,
        "simulated_step_s": sim.step_time, "simulated_bubble": sim.bubble_total,
        "simulated_idle_per_rank_s": statistics.mean(_idle(sim.timeline)),
        "schedule_peak_per_rank": list(want_peak), "schedule_peak_stage_units": max(want_peak) / v,
        "measured": None, "error": error,
    }
    timelines = {"simulated": sim.timeline}
    if steps is None:
        return row, timelines
    busy = [busy_timeline(s["records"], p) for s in steps]
    raw = [from_records(s["records"]) for s in steps]
    walls = [s["wall"] for s in steps]
    calibrated = simulate(sched, _action_costs(busy, S))
    mid = sorted(range(len(walls)), key=walls.__getitem__)[len(walls) // 2]  # the median step
    peaks = [list(t.peak_inflight) for t in raw]
    step = statistics.median(walls)
    row["measured"] = {
        "step_s": step,
        "step_s_all": walls,
        "makespan_s": statistics.median(t.step_time for t in busy),
        "ratio_to_simulated": step / sim.step_time,
        "sim_measured_actions_step_s": calibrated.step_time,
        "ratio_to_sim_measured_actions": step / calibrated.step_time,
        "bubble": statistics.median(t.bubble_total for t in busy),
        "bubble_per_rank": list(busy[mid].bubble),
        "bubble_including_receive_waits": statistics.median(t.bubble_total for t in raw),
        "idle_per_rank_s": statistics.median(statistics.mean(_idle(t)) for t in busy),
        "peak_per_rank": peaks[mid],
        "peak_stage_units": max(peaks[mid]) / v,
        "peak_matches_schedule": all(pk == list(want_peak) for pk in peaks),
        "mean_action_s": {k: statistics.mean(x.duration for t in busy for x in t.spans if x.kind.value == k)
                          for k in sorted({x.kind.value for x in busy[mid].spans})},
    }
    timelines["measured"] = busy[mid]
    return row, timelines


def _zero_bubble_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """ZB-H1 and ZB-V against 1F1B at the same m and transport: idle time, bubble, memory."""
    base = {(r["transport"], r["m"]): r for r in rows if r["schedule"] == "1f1b"}
    out = []
    for r in rows:
        ref = base.get((r["transport"], r["m"]))
        if r["schedule"] not in ZERO_BUBBLE or ref is None:
            continue
        z: dict[str, Any] = {
            "schedule": r["schedule"], "m": r["m"], "transport": r["transport"],
            "idle_ratio_theory": r["simulated_idle_per_rank_s"] / ref["simulated_idle_per_rank_s"],
            "bubble_ratio_theory": r["simulated_bubble"] / ref["simulated_bubble"],
            "memory_theory": [r["schedule_peak_stage_units"], ref["schedule_peak_stage_units"]],
            "measured": None,
        }
        a, b = r["measured"], ref["measured"]
        if a is not None and b is not None:
            idle = a["idle_per_rank_s"] / b["idle_per_rank_s"]
            z["measured"] = {
                "idle_ratio": idle, "bubble_ratio": a["bubble"] / b["bubble"],
                "memory": [a["peak_stage_units"], b["peak_stage_units"]],
                "target_met": idle <= 1 / 3 and a["peak_stage_units"] <= b["peak_stage_units"],
            }
        out.append(z)
    return out


# -- real model ----------------------------------------------------------------------------------


def _gpt2(cfg: dict[str, Any]) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model, (ids,) = gpt2(n_layer=cfg["n_layer"], n_embd=cfg["n_embd"], n_head=cfg["n_head"],
                         batch=cfg["batch"] // cfg["m"], seq=cfg["seq"])
    return model, ids


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())  # (B*T, V), (B*T,)


def _real_plans(cfg: dict[str, Any]) -> dict[str, Plan]:
    """The profiled and the roofline plan, both cut at the middle block."""
    model, ids = _gpt2(cfg)
    cut = f"model.transformer.h.{cfg['n_layer'] // 2}"
    return {
        how: partition(model, (ids,), 2, cluster=Cluster.uniform(2, "cpu"), schedule="1f1b",
                       microbatches=cfg["m"], split_points=[cut], profile=(how == "profile"))
        for how in ("profile", "roofline")
    }


def _real_worker(rank: int, world: int, plan_path: str, cfg: dict[str, Any],
                 schedules: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """Every schedule's trainer in these 2 processes, timed round by round in rotating order."""
    model, ids = _gpt2(cfg)
    plan = Plan.load(plan_path).bind(model, (ids,))
    run = {"microbatches": cfg["m"], "transport": "dist", "record": True}
    trainers = {s: PipelineTrainer(plan, _lm_loss, None, execution=Execution(schedule=s, **run)) for s in schedules}
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 1024, (cfg["batch"], cfg["seq"]), generator=gen)
    y = torch.randint(0, 1024, (cfg["batch"], cfg["seq"]), generator=gen)
    out: dict[str, list[dict[str, Any]]] = {s: [] for s in schedules}
    n = len(schedules)
    for rnd in range(cfg["warmup"] + cfg["steps"]):
        for k in range(n):  # rotate: no schedule always runs first, drift slows them alike
            s = schedules[(rnd + k) % n]
            step = _timed_dist_steps(trainers[s], x, y, 1, 0)[0]
            if rnd >= cfg["warmup"]:
                out[s].append(step)
    return out


def _real_model(cfg: dict[str, Any], schedules: Sequence[str], timeout: float) -> dict[str, Any]:
    torch.set_num_threads(1)  # profile as the workers run: one thread each
    plans = _real_plans(cfg)
    load_before = os.getloadavg()
    measured: dict[str, list[dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="pipecut-bench-") as tmp:
        path = str(Path(tmp) / "plan.json")
        plans["profile"].save(path)
        try:
            per_rank = spawn(_real_worker, 2, path, cfg, list(schedules), timeout=timeout, threads=1)
            measured = {s: _merge_ranks([r[s] for r in per_rank]) for s in schedules}
        except LaunchError:  # one schedule failed: run each alone to tell which
            for s in schedules:
                try:
                    measured[s] = _merge_ranks([r[s] for r in spawn(_real_worker, 2, path, cfg, [s],
                                                                    timeout=timeout, threads=1)])
                except LaunchError as e:
                    errors[s] = _first_error_line(str(e))
    rows = []
    for s in schedules:
        row: dict[str, Any] = {
            "schedule": s, "predicted_profile_s": plans["profile"].prediction(s).step_time,
            "predicted_roofline_s": plans["roofline"].prediction(s).step_time,
            "predicted_bubble_profile": plans["profile"].prediction(s).bubble,
            "measured_s": None, "error": errors.get(s),
        }
        if s in measured:
            walls = [x["wall"] for x in measured[s]]
            busy = [busy_timeline(x["records"], 2) for x in measured[s]]
            step = statistics.median(walls)
            row.update({
                "measured_s": step, "measured_s_all": walls,
                "ratio_to_profile": step / row["predicted_profile_s"],
                "ratio_to_roofline": step / row["predicted_roofline_s"],
                "sim_measured_actions_s": simulate(get_schedule(s, 2, cfg["m"]), _action_costs(busy, 2)).step_time,
                "bubble": statistics.median(t.bubble_total for t in busy),
                "measured_mean_action_s": _mean_actions(busy),
            })
        rows.append(row)
    stages = {how: [{"fwd_s": st.fwd_time, "bwd_s": st.bwd_time, "wgrad_s": st.wgrad_time}
                    for st in plan.stages] for how, plan in plans.items()}
    return {"config": cfg, "cut": f"model.transformer.h.{cfg['n_layer'] // 2}", "stage_costs": stages,
            "load_avg_before": load_before, "load_avg_after": os.getloadavg(), "results": rows}


def _mean_actions(timelines: Sequence[Timeline]) -> dict[str, dict[str, float]]:
    """Per stage, the mean measured duration of each action kind (receive waits removed)."""
    out: dict[str, dict[str, float]] = {}
    for (stage, kind), ds in sorted(_durations(timelines).items()):
        out.setdefault(str(stage), {})[kind] = statistics.mean(ds)
    return out


def _first_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    useful = [ln for ln in lines if "Error" in ln or "error" in ln or "what()" in ln]
    return (useful[-1] if useful else lines[-1] if lines else "failed")[:300]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="p = 2, m = 4, 2 ms costs, 2 steps (for tests)")
    ap.add_argument("--ms", type=int, nargs="+", default=None, help="micro-batch counts (default 4 8 16)")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    ap.add_argument("-p", "--ranks", type=int, default=None, help="ranks p (default 4)")
    ap.add_argument("--cost-ms", type=float, default=None, help="F = B_in = W per rank, ms (default 40)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="sleep exactly the nominal costs (no correction for the sleeps' own excess)")
    ap.add_argument("--transports", nargs="+", default=None, choices=("local", "dist"),
                    help="fixed-cost runs: threads in this process and/or p gloo processes (default both)")
    ap.add_argument("--skip-real", action="store_true", help="skip the GPT-2 over 2 gloo processes")
    ap.add_argument("--skip-fixed", action="store_true", help="skip the fixed-cost stages (only the GPT-2)")
    ap.add_argument("--real-schedules", nargs="+", default=["gpipe", "1f1b", "zbh1"],
                    choices=("gpipe", "1f1b", "zbh1"))
    ap.add_argument("--real-steps", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per group of spawned processes")
    ap.add_argument("--traces", default="benchmarks/results/traces",
                    help="folder for Chrome traces at m = 8 (measured and simulated); '' for none")
    ap.add_argument("--out", default="benchmarks/results/schedules.json")
    args = ap.parse_args(argv)
    q = args.quick
    p = args.ranks or (2 if q else 4)
    ms = args.ms or ([4] if q else [4, 8, 16])
    cost_ms = args.cost_ms or (2.0 if q else 40.0)
    steps = args.steps or (2 if q else 5)
    transports = args.transports or (["local"] if q else ["local", "dist"])
    if p < 2 or min(ms) < 1 or steps < 1 or cost_ms <= 0:
        ap.error("need -p >= 2, every m >= 1, --steps >= 1 and --cost-ms > 0")
    cfg = {"p": p, "ms": ms, "schedules": args.schedules, "cost_ms": cost_ms, "steps": steps,
           "warmup": args.warmup, "transports": transports, "quick": q, "micro_batch": [ROWS, WIDTH],
           "calibrate": not args.no_calibrate}
    cost_s = cost_ms * 1e-3
    t_start = time.perf_counter()
    load_before = os.getloadavg()

    rows: list[dict[str, Any]] = []
    timelines: dict[tuple[str, int, str], dict[str, Timeline]] = {}
    # Calibrated on the smallest sleep the runs use (a two-chunk schedule's chunk).
    cal_s = None if args.no_calibrate else cost_s / max(stages_per_rank(s) for s in args.schedules)
    calibration: dict[str, Any] = {}
    if cal_s and "local" in transports and not args.skip_fixed:
        calibration["local"] = calibrate(cal_s)
    for transport in [] if args.skip_fixed else transports:
        for schedule in args.schedules:
            measured: dict[int, list[dict[str, Any]]] = {}
            errors: dict[int, str] = {}
            if transport == "local":
                for m in ms:
                    try:
                        measured[m] = _run_local(schedule, p, m, cost_s, steps, args.warmup)
                    except (PipecutError, RuntimeError, ValueError) as e:  # the trainer cannot run it: n/a, why
                        errors[m] = f"{type(e).__name__}: {_first_error_line(str(e))}"
            else:
                try:
                    per_rank = spawn(_dist_fixed_worker, p, schedule, ms, cost_s, steps, args.warmup,
                                     cal_s, timeout=args.timeout, threads=1)
                    measured = {m: _merge_ranks([r["runs"][m] for r in per_rank]) for m in ms}
                    calibration.setdefault("dist", {})[schedule] = [r["calibration"] for r in per_rank]
                except LaunchError as e:
                    errors = {m: _first_error_line(str(e)) for m in ms}
            for m in ms:
                row, tls = _row(schedule, p, m, cost_s, transport, measured.get(m), errors.get(m))
                rows.append(row)
                timelines[(schedule, m, transport)] = tls
    zb = _zero_bubble_rows(rows)

    real = None
    if not args.skip_real:
        real_cfg = {"n_layer": 4, "n_embd": 128, "n_head": 4, "seq": 64, "batch": 32, "m": 8,
                    "steps": args.real_steps, "warmup": 2}
        real = _real_model(real_cfg, args.real_schedules, args.timeout)

    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 200)
    print_report(console, cfg, rows, zb, real)
    traces = []
    if args.traces:
        trace_m = 8 if 8 in ms else ms[len(ms) // 2]
        traces = save_traces(Path(args.traces), trace_m, timelines)
    cli = sys.argv[1:] if argv is None else list(argv)
    result = {
        "benchmark": "schedules",
        "command": shlex.join(["python", "benchmarks/schedules.py", *cli]),
        "sys_argv": list(sys.argv),
        "config": cfg,
        "env": {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                "machine": platform.machine(), "git": git_state(), "load_avg_before": load_before,
                "load_avg_after": os.getloadavg(), "wall_s": time.perf_counter() - t_start},
        "sleep_calibration": calibration,
        "fixed": rows,
        "zero_bubble_vs_1f1b": zb,
        "real_model": real,
        "traces": traces,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    console.print(f"wrote {out}" + (f" and {len(traces)} traces in {args.traces}" if traces else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
