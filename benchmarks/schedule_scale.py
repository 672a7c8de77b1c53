"""Benchmark of schedule sizes: seconds to build, check, simulate and plan with S stages and m micro-batches.

Run (CPU; about five minutes with the defaults, most of it at 64 x 4096; writes
``benchmarks/results/schedule_scale.json``)::

    python benchmarks/schedule_scale.py
    python benchmarks/schedule_scale.py --stages 4,8 --microbatches 8,16 --out /tmp/scale.json

Per training schedule (``registry.TRAINING_SCHEDULES``) and size, the seconds each step of the
pure schedule layer takes: ``build`` (``registry.stage_schedule``), ``unit_run`` (``grid``),
``validate``, ``peak_inflight``, ``comm_plan``, ``simulate`` (``StageCosts.uniform``) and
``timeline`` (the simulation's ``Timeline``, built on first use: every span and message, with its
bubble and memory curves; ``simulate`` counts its own metrics without it). Each step gets a fresh
schedule, so each pays its own check. Per size, also the whole path a user takes: ``partition`` of an
``nn.Sequential`` of ``2 S`` linear layers on ``Cluster.uniform(S, 'A100-80GB')`` with
``microbatches=m`` (1F1B), ``predict`` of that plan, and ``pipecut simulate plan.json
--microbatches m`` (in this process). Each is linear in the schedule's actions (``S m`` times 2,
or 3 with split backward); docs/schedules.md quotes the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from lib.common import git_state, int_list, load_before, write_result  # noqa: E402

STEPS = ("build", "unit_run", "validate", "peak_inflight", "comm_plan", "simulate", "timeline")


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def schedule_times(name: str, S: int, m: int) -> dict[str, Any]:
    """Seconds of each step of the schedule layer for ``name`` on ``S`` stages, ``m`` micro-batches."""
    from partitioner.schedule.comm import comm_plan
    from partitioner.schedule.grid import unit_run
    from partitioner.schedule.registry import stage_schedule
    from partitioner.schedule.simulate import StageCosts, simulate
    from partitioner.schedule.validation import peak_inflight, validate

    row: dict[str, Any] = {"schedule": name, "stages": S, "microbatches": m}
    row["build"], sched = _timed(lambda: stage_schedule(name, S, m))
    row["actions"] = sum(map(len, sched.actions))
    # A schedule is checked once and keeps the result (validation.validate_numbered): each step
    # below gets a fresh, unchecked copy (built outside the timing), so each pays its own check.
    fresh = lambda: stage_schedule(name, S, m)  # noqa: E731
    row["unit_run"], _ = _timed(lambda: unit_run(sched))
    again = fresh()
    row["validate"], _ = _timed(lambda: validate(again))
    again = fresh()
    row["peak_inflight"], _ = _timed(lambda: peak_inflight(again))
    again = fresh()
    row["comm_plan"], _ = _timed(lambda: comm_plan(again))
    again = fresh()
    row["simulate"], sim = _timed(lambda: simulate(again, StageCosts.uniform(S, output_bytes=1e6)))

    def rebuild() -> None:
        t = sim.timeline  # built on first use: every span and message
        _ = t.bubble_total, t.peak_inflight

    row["timeline"], _ = _timed(rebuild)
    return row


def plan_times(S: int, m: int) -> dict[str, Any]:
    """Seconds to partition a ``2 S``-layer MLP into ``S`` stages for ``m`` micro-batches, predict it,
    and run ``pipecut simulate`` on its JSON."""
    import torch
    from torch import nn

    from partitioner import Cluster, partition
    from partitioner.plan.predict import predict
    from pipecut.cli import main as cli

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(2 * S)])
    row: dict[str, Any] = {"stages": S, "microbatches": m}
    row["partition"], plan = _timed(lambda: partition(
        model, (torch.randn(2, 16),), S, cluster=Cluster.uniform(S, "A100-80GB"), microbatches=m, schedule="1f1b"))
    row["predict"], _ = _timed(lambda: predict(plan.stages, plan.cluster, "1f1b", m))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        plan.save(path)
        with contextlib.redirect_stdout(io.StringIO()):
            row["pipecut_simulate"], code = _timed(lambda: cli(["simulate", str(path), "--microbatches", str(m)]))
    row["pipecut_simulate_exit"] = code
    return row


def measure(stages: list[int], microbatches: list[int], schedules: list[str], *, plans: bool) -> dict[str, Any]:
    """Every schedule at every size, and (``plans``) the planning path at every size."""
    rows, plan_rows = [], []
    for S in stages:
        for m in microbatches:
            for name in schedules:
                rows.append(schedule_times(name, S, m))
                print(f"  {name} S={S} m={m}: " + ", ".join(f"{k} {rows[-1][k]:.2f}s" for k in STEPS), flush=True)
            if plans:
                plan_rows.append(plan_times(S, m))
    return {"schedules": rows, "plans": plan_rows}


def report(result: dict[str, Any]) -> None:
    """Print the measurements as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    table = Table(title="schedule layer, seconds (linear in the actions)")
    for col in ("schedule", "S", "m", "actions", *STEPS, "total"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for r in result["schedules"]:
        total = sum(r[k] for k in STEPS)
        table.add_row(r["schedule"], str(r["stages"]), str(r["microbatches"]), f"{r['actions']:,}",
                      *(f"{r[k]:.3f}" for k in STEPS), f"{total:.2f}")
    console.print(table)
    if result["plans"]:
        plans = Table(title="planning path, seconds (2S-layer MLP, 1F1B)")
        for col in ("S", "m", "partition", "predict", "pipecut simulate"):
            plans.add_column(col, justify="right")
        for r in result["plans"]:
            plans.add_row(str(r["stages"]), str(r["microbatches"]), f"{r['partition']:.2f}",
                          f"{r['predict']:.2f}", f"{r['pipecut_simulate']:.2f}")
        console.print(plans)


def main(argv: list[str] | None = None) -> int:
    """Measure, print, and write the JSON."""
    from partitioner.schedule.registry import TRAINING_SCHEDULES

    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--stages", type=int_list, default=[8, 64], help="stage counts S (default 8,64)")
    ap.add_argument("--microbatches", type=int_list, default=[64, 512, 4096],
                    help="micro-batch counts m (default 64,512,4096)")
    ap.add_argument("--schedules", default=",".join(TRAINING_SCHEDULES), help="comma-separated schedule names")
    ap.add_argument("--no-plan", action="store_true", help="skip partition / predict / pipecut simulate")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "schedule_scale.json"))
    args = ap.parse_args(argv)
    load = load_before("the timings")
    started = time.time()
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    result = measure(args.stages, args.microbatches, schedules, plans=not args.no_plan)
    report(result)
    write_result(args.out, {
        "benchmark": "schedule_scale",
        "command": " ".join(["python benchmarks/schedule_scale.py", *(argv if argv is not None else sys.argv[1:])]),
        "git": git_state(),
        "load_avg_before": load,
        "seconds": round(time.time() - started, 2),
        "results": result,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
