"""The ``pipecut`` command line: ``plan`` prints (and saves) a plan, ``simulate`` replays one.

Examples::

    pipecut plan gpt2-tiny --stages 4
    pipecut plan gpt2-tiny --stages 4 --schedule auto --microbatches auto --json plan.json
    pipecut simulate plan.json --schedule zbv --microbatches 16 --trace out.json
    pipecut plan gpt2-175b --stages 64 --device A100-80GB --granularity module --json plan.json
    pipecut plan examples/my_model.py:build --stages 2 --device cpu --dot plan.dot
    pipecut --version

Tables take the terminal's width (``COLUMNS`` when set); written to a file or a pipe they keep
``str(plan)``'s fixed width, so saved output has every column.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import sys
import time
from collections.abc import Sequence

from rich.console import Console

from partitioner.api import METHODS, partition
from partitioner.cost.devices import DEVICE_PRESETS, Cluster
from partitioner.errors import CliArgumentError, PipecutError
from partitioner.plan.plan import Plan
from partitioner.plan.predict import prediction, simulate_stages
from partitioner.plan.render import TEXT_WIDTH, fmt_bytes, fmt_time, render_text
from partitioner.schedule.registry import TRAINING_SCHEDULES
from partitioner.zoo import MODELS, load_model

__all__ = ["main", "build_parser", "version"]

_RECOMPUTE: dict[str, bool | str] = {"auto": "auto", "on": True, "off": False}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``pipecut``."""
    parser = argparse.ArgumentParser(
        prog="pipecut", description="Cut a PyTorch model into pipeline stages and show the plan."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log each step's timing")
    parser.add_argument("--version", action="version", version=f"pipecut {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="trace, cost and partition a model; print the stage table")
    plan.add_argument(
        "model", help=f"a built-in model ({', '.join(MODELS)}) or path/to/file.py:factory "
        "where factory() returns (model, example_inputs) for one micro-batch"
    )
    plan.add_argument("--stages", type=int, required=True, help="number of pipeline stages")
    plan.add_argument(
        "--device", default="A100-80GB", help=f"device preset for every stage ({', '.join(DEVICE_PRESETS)})"
    )
    plan.add_argument("--microbatches", type=_count_or_auto, default=8,
                      help="micro-batches per step (default 8), or 'auto'")
    plan.add_argument("--schedule", default="1f1b", choices=(*TRAINING_SCHEDULES, "auto"),
                      help="pipeline schedule, or 'auto' to simulate them all and keep the fastest that fits")
    plan.add_argument("--method", default="exact", choices=METHODS)
    plan.add_argument("--no-refine", action="store_true", help="skip the DAG refinement after 'exact'")
    plan.add_argument("--split-points", default=None, help="comma-separated module names where stages begin")
    plan.add_argument("--granularity", default="node", choices=("node", "module"))
    plan.add_argument("--recompute", default="auto", choices=("auto", "on", "off"),
                      help="activation recomputation: 'auto' (only the stages that do not fit memory otherwise; "
                      "default), 'on' (every stage) or 'off'")
    plan.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                      help="mixed precision the plan is costed for (autocast over fp32 weights; default fp32)")
    plan.add_argument("--state-bytes", type=float, default=16.0, help="training-state bytes per parameter")
    plan.add_argument("--link-bandwidth", type=float, default=None, help="bytes/s between neighbouring devices")
    plan.add_argument("--json", dest="json_path", default=None, help="write the plan as JSON here")
    plan.add_argument("--dot", dest="dot_path", default=None, help="write a Graphviz DOT picture here")

    sim = sub.add_parser("simulate", help="simulate a saved plan under a schedule; print the step and write a trace")
    sim.add_argument("plan", help="a plan JSON file written by `pipecut plan ... --json`")
    sim.add_argument("--schedule", default=None, choices=TRAINING_SCHEDULES,
                     help="schedule to simulate (default: the plan's)")
    sim.add_argument("--microbatches", type=_count, default=None, help="micro-batches per step (default: the plan's)")
    sim.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON here")
    sim.add_argument("--gantt", default=None, help="write a Gantt chart PNG here (needs matplotlib)")
    return parser


def version() -> str:
    """The installed distribution's version; from a source tree that is not installed, the package's own.

    Example:
        >>> import pipecut
        >>> version() == pipecut.__version__
        True
    """
    try:
        return importlib.metadata.version("pipecut")
    except importlib.metadata.PackageNotFoundError:
        import pipecut  # only here: the CLI itself needs none of what the package re-exports

        return pipecut.__version__


def _console() -> Console:
    """A console as wide as the terminal (rich reads ``COLUMNS``, else asks the terminal); into a
    file or a pipe, with no ``COLUMNS``, ``str(plan)``'s fixed width rather than rich's 80, so
    saved output keeps every column."""
    console = Console(highlight=False, markup=False)  # a path or model name is shown as written
    if "COLUMNS" not in os.environ and not console.is_terminal:
        console = Console(highlight=False, markup=False, width=TEXT_WIDTH)
    return console


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return _plan(args) if args.command == "plan" else _simulate(args)
    except (PipecutError, ImportError, FileNotFoundError, ValueError) as e:
        print(f"pipecut: error: {e}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    model, inputs = load_model(args.model)
    cluster = Cluster.uniform(args.stages, args.device, link_bandwidth=args.link_bandwidth)
    split = [s.strip() for s in args.split_points.split(",")] if args.split_points else None
    plan = partition(
        model, inputs, args.stages, cluster=cluster, microbatches=args.microbatches,
        schedule=args.schedule, method=args.method, refine=not args.no_refine, split_points=split,
        granularity=args.granularity, state_bytes_per_param=args.state_bytes,
        recompute=_RECOMPUTE[args.recompute], precision=args.precision,
    )
    print(render_text(plan, width=_console().width), end="")
    if args.json_path:
        plan.save(args.json_path)
        print(f"plan written to {args.json_path}")
    if args.dot_path:
        plan.to_dot(args.dot_path)
        print(f"DOT written to {args.dot_path}")
    logging.getLogger(__name__).info("total %.2fs", time.perf_counter() - t0)
    return 0


def _count_or_auto(text: str) -> int | str:
    return text if text == "auto" else _count(text, "or 'auto'")


def _count(text: str, alternative: str = "") -> int:
    """A positive count (``--microbatches``), or a usage error saying what was given."""
    expected = f"a positive integer{' ' + alternative if alternative else ''}"
    try:
        value = int(text)
    except ValueError:
        raise CliArgumentError(f"expected {expected}, got {text!r}") from None
    if value < 1:
        raise CliArgumentError(f"expected {expected}, got {value}")
    return value


def _simulate(args: argparse.Namespace) -> int:
    from rich.table import Table

    from partitioner.schedule.timeline import save_chrome_trace, save_gantt_png

    plan = Plan.load(args.plan)
    schedule = args.schedule or plan.schedule
    m = plan.microbatches if args.microbatches is None else args.microbatches
    sched, sim = simulate_stages(plan.stages, plan.cluster, schedule, m)
    pred = prediction(plan.stages, schedule, m, sched, sim)  # the step simulated once, not twice
    console = _console()
    console.print(
        f"{args.plan}: {plan.num_stages} stages on {sched.num_ranks} ranks, schedule {schedule}, "
        f"{m} micro-batches (event simulator)"
    )
    table = Table(show_edge=False)
    for col in ("rank", "stages", "busy", "bubble", "micro-batches held", "peak memory"):
        table.add_column(col, justify="right")
    state = [0.0] * sched.num_ranks
    for s, r in enumerate(sched.stage_to_rank):
        state[r] += plan.stages[s].state_bytes
    busy = sim.busy
    peaks = sim.peak_bytes or (0.0,) * sched.num_ranks
    for r in range(sched.num_ranks):
        table.add_row(
            str(r), ",".join(map(str, sched.stages_of(r))), fmt_time(busy[r]), f"{sim.bubble[r]:.1%}",
            str(sim.peak_inflight[r]), fmt_bytes(state[r] + peaks[r]),
        )
    console.print(table)
    console.print(
        f"step {fmt_time(sim.step_time)}, bubble {sim.bubble_total:.1%}, "
        f"fullest device {fmt_bytes(pred.memory)} of {fmt_bytes(min(st.capacity for st in plan.stages))}"
    )
    if args.trace:
        save_chrome_trace(sim.timeline, args.trace, name=f"pipecut {schedule} m={m}")
        console.print(f"trace written to {args.trace} (open in ui.perfetto.dev or chrome://tracing)")
    if args.gantt:
        save_gantt_png(sim.timeline, args.gantt, title=f"{schedule}, {m} micro-batches")
        console.print(f"Gantt chart written to {args.gantt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
