"""The ``pipecut`` command line: ``plan`` prints (and saves) a plan, ``simulate`` replays one,
``train`` trains a Hugging Face folder on a token file (docs/train.md).

Examples::

    pipecut plan gpt2-tiny --stages 4
    pipecut plan gpt2-tiny --stages 4 --schedule auto --microbatches auto --json plan.json
    pipecut simulate plan.json --schedule zbv --microbatches 16 --trace out.json
    pipecut plan gpt2-175b --stages 64 --device A100-80GB --granularity module --json plan.json
    pipecut plan gpt2-175b --devices 512 --global-batch 1536 --device A100-80GB --precision bf16 --granularity module
    pipecut plan examples/my_model.py:build --stages 2 --device cpu --dot plan.dot
    pipecut plan path/to/hf-folder --stages 8 --device H100-80GB --seq-len 4096
    pipecut calibrate --model gpt2-tiny --devices 4 --global-batch 16 --out cluster.json
    pipecut plan gpt2-tiny --devices 4 --global-batch 16 --calibrate cluster.json
    pipecut train --model path/to/hf-folder --data tokens.bin --out run --pp 2 --steps 100
    torchrun --standalone --nproc-per-node 4 -m pipecut train --model ... --pp 2 --dp 2
    torchrun --standalone --nproc-per-node 8 -m pipecut train --model ... --layout auto --global-batch 64
    torchrun --standalone --nproc-per-node 8 -m pipecut train --model ... --plan plan.json --global-batch 64
    pipecut --version

Exit codes: 0 done, 2 an error, 3 a device over capacity (docs/partitioning.md, "Exit codes of the
command line").

Tables take the terminal's width (``COLUMNS`` when set); written to a file or a pipe they keep
``str(plan)``'s fixed width, so saved output has every column.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from rich.console import Console
from torch import nn

from partitioner.api import METHODS, partition
from partitioner.cost.devices import DEVICE_PRESETS, Cluster, default_device
from partitioner.cost.gemms import model_gemms
from partitioner.cost.probes import Probe
from partitioner.errors import CliArgumentError, InfeasibleMemoryError, PipecutError
from partitioner.plan.layout import DEFAULT_ZERO, ZERO_OPTIONS
from partitioner.plan.plan import Plan
from partitioner.plan.predict import prediction, simulate_stages
from partitioner.plan.render import TEXT_WIDTH, fmt_bytes, fmt_time, render_text
from partitioner.schedule.registry import TRAINING_SCHEDULES
from partitioner.search import plan_layout
from partitioner.zoo import MODELS, load_model
from pipecut.folder import HFFolder, is_hf_folder, max_positions

__all__ = ["main", "build_parser", "version", "EXIT_ERROR", "EXIT_OVER_CAPACITY"]

# Exit codes (docs/partitioning.md, "Exit codes"): 0 done; 2 an error (a bad argument, model or
# plan file; argparse's usage errors too); 3 the plan does not fit: a device is over capacity (the
# row marked OVER) or no cut fits (InfeasibleMemoryError), so scripts can tell "too big" apart.
EXIT_ERROR = 2
EXIT_OVER_CAPACITY = 3

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
        "model", help=f"a built-in model ({', '.join(MODELS)}), path/to/file.py:factory "
        "where factory() returns (model, example_inputs) for one micro-batch, or a Hugging Face "
        "folder (config.json; built on meta, so any size plans here)"
    )
    plan.add_argument("--stages", type=int, default=None, help="number of pipeline stages (or --devices)")
    plan.add_argument("--devices", type=_count, default=None,
                      help="search the whole layout of this many devices (dp x pp, micro-batch size, schedule, "
                      "ZeRO-1) for --global-batch rows per step, instead of cutting --stages")
    plan.add_argument("--global-batch", type=_count, default=None, help="rows per optimizer step (with --devices)")
    plan.add_argument("--top", type=_count, default=5, help="layouts ranked in the table (with --devices; default 5)")
    plan.add_argument("--zero", default=",".join(DEFAULT_ZERO),
                      help="with --devices: the shardings over the replicas to search, comma-separated, of "
                      f"{', '.join(ZERO_OPTIONS)} (default {','.join(DEFAULT_ZERO)}; fsdp, FSDP2, only when named)")
    plan.add_argument(
        "--device", default=None, help=f"device preset for every stage ({', '.join(DEVICE_PRESETS)}); default: "
        "this machine's (its GPU's preset, else cpu), the same as pipecut train's"
    )
    plan.add_argument("--memory-reserve", default=None, metavar="SIZE",
                      help="memory each device keeps out of the plan, a size ('2GiB', '512MiB') or a share "
                      "('10%%'); default the device's own: 2 GiB + 5%% of a GPU, 0.5 GiB + 10%% of cpu")
    plan.add_argument("--microbatches", type=_count_or_auto, default=8,
                      help="micro-batches per step (default 8), or 'auto'")
    plan.add_argument("--schedule", default=None, choices=(*TRAINING_SCHEDULES, "auto"),
                      help="pipeline schedule (default 1f1b), or 'auto' to simulate them all and keep the fastest "
                      "that fits; with --devices every schedule is searched unless one is named")
    plan.add_argument("--method", default="exact", choices=METHODS)
    plan.add_argument("--no-refine", action="store_true", help="skip the DAG refinement after 'exact'")
    plan.add_argument("--split-points", default=None,
                      help="comma-separated module names where stages begin: full names or their ends "
                      "(h.4 for model.transformer.h.4); without --stages, one stage more than the names")
    plan.add_argument("--granularity", default=None, choices=("node", "module"),
                      help="where stages may be cut (default: between blocks for Hugging Face models, else anywhere)")
    plan.add_argument("--recompute", default="auto", choices=("auto", "on", "off"),
                      help="activation recomputation: 'auto' (only the stages that do not fit memory otherwise; "
                      "default), 'on' (every stage) or 'off'")
    plan.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                      help="mixed precision the plan is costed for (autocast over fp32 weights; default fp32)")
    plan.add_argument("--state-bytes", type=float, default=16.0, help="training-state bytes per parameter")
    plan.add_argument("--link-bandwidth", type=float, default=None, help="bytes/s between neighbouring devices")
    plan.add_argument("--json", dest="json_path", default=None, help="write the plan as JSON here")
    plan.add_argument("--dot", dest="dot_path", default=None, help="write a Graphviz DOT picture here")
    plan.add_argument("--seq-len", type=_count, default=None,
                      help="a Hugging Face folder's example sequence length (default: 1024, or the model's maximum)")
    plan.add_argument("--micro-batch-size", type=_count, default=1,
                      help="a Hugging Face folder's example rows per micro-batch (default 1)")
    plan.add_argument("--trust-remote-code", action="store_true",
                      help="let a Hugging Face folder's own code (auto_map, modeling_*.py) run to build its model; "
                      "off by default: read that code first")
    plan.add_argument("--calibrate", metavar="FILE", default=None,
                      help="plan for the cluster in FILE, fitted to this model on this host by `pipecut calibrate "
                      "--model MODEL --devices N --out FILE` (warns when it was fitted on another model or device "
                      "count); if FILE does not exist, that fit is made first (N processes, a minute or more) and "
                      "saved there")
    _add_calibrate_parser(sub)

    sim = sub.add_parser("simulate", help="simulate a saved plan under a schedule; print the step and write a trace")
    sim.add_argument("plan", help="a plan JSON file written by `pipecut plan ... --json`")
    sim.add_argument("--schedule", default=None, choices=TRAINING_SCHEDULES,
                     help="schedule to simulate (default: the plan's)")
    sim.add_argument("--microbatches", type=_count, default=None, help="micro-batches per step (default: the plan's)")
    sim.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON here")
    sim.add_argument("--gantt", default=None, help="write a Gantt chart PNG here (needs matplotlib)")
    _add_train_parser(sub)
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
    commands = {"plan": _plan, "simulate": _simulate, "train": _train, "calibrate": _calibrate}
    try:
        return commands[args.command](args)
    except InfeasibleMemoryError as e:
        print(f"pipecut: error: {e}", file=sys.stderr)
        return EXIT_OVER_CAPACITY
    except (PipecutError, ImportError, FileNotFoundError, ValueError) as e:
        print(f"pipecut: error: {e}", file=sys.stderr)
        return EXIT_ERROR


def _plan(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    if is_hf_folder(args.model):
        model, inputs = _folder_model(args.model, args.seq_len, args.micro_batch_size,
                                      trust_remote_code=args.trust_remote_code, command="pipecut plan")
    else:
        model, inputs = load_model(args.model)
    split = [s.strip() for s in args.split_points.split(",") if s.strip()] if args.split_points else None
    if split and args.stages is None and args.devices is None:
        args.stages = len(split) + 1  # the cuts say how many stages
    if split and args.devices is not None:
        raise CliArgumentError(
            "--split-points cuts a pipeline of --stages N; --devices searches the layout, whose depth it "
            "chooses itself: give --stages (or only --split-points) instead of --devices"
        )
    if (args.stages is None) == (args.devices is None):
        raise CliArgumentError("give --stages N (cut N stages) or --devices N --global-batch B (search the layout)")
    count = args.devices if args.devices is not None else args.stages
    if args.calibrate:
        cluster = _calibrated(args, count, model)
        if args.memory_reserve is not None:
            cluster = cluster.with_memory_reserve(args.memory_reserve)
    else:
        device = args.device if args.device not in (None, "auto") else default_device()
        if args.device in (None, "auto"):
            print(f"planning for {device}: this machine's device (the default; --device NAME plans for another)")
        cluster = Cluster.uniform(count, device, link_bandwidth=args.link_bandwidth,
                                  memory_reserve=args.memory_reserve)
    if args.devices is not None:
        if args.global_batch is None:
            raise CliArgumentError(
                "--devices searches layouts for a global batch: add --global-batch B (rows per step)"
            )
        plan = plan_layout(
            model, inputs, cluster=cluster, global_batch=args.global_batch, top=args.top,
            schedules=(args.schedule,) if args.schedule not in (None, "auto") else None,
            granularity=args.granularity, state_bytes_per_param=args.state_bytes,
            recompute=_RECOMPUTE[args.recompute], precision=args.precision,
            zero=tuple(z.strip() for z in args.zero.split(",") if z.strip()),
        )
    else:
        plan = partition(
            model, inputs, args.stages, cluster=cluster, microbatches=args.microbatches,
            schedule=args.schedule or "1f1b", method=args.method, refine=not args.no_refine, split_points=split,
            granularity=args.granularity, state_bytes_per_param=args.state_bytes,
            recompute=_RECOMPUTE[args.recompute], precision=args.precision,
        )
    print(render_text(plan, width=_console().width, top=args.top), end="")
    if args.json_path:
        plan.save(args.json_path)
        print(f"plan written to {args.json_path}")
    if args.dot_path:
        plan.to_dot(args.dot_path)
        print(f"DOT written to {args.dot_path}")
    logging.getLogger(__name__).info("total %.2fs", time.perf_counter() - t0)
    over = [st.index for st in plan.stages if st.memory > st.capacity]
    if over:  # a cut that ignores memory (equal_count, split points): written, but not a success
        print(f"pipecut: stage{'s' if len(over) > 1 else ''} {', '.join(map(str, over))} over capacity "
              "(marked OVER): use more stages, --method exact, --recompute on, a smaller --state-bytes or "
              f"a larger --device (exit code {EXIT_OVER_CAPACITY})", file=sys.stderr)
        return EXIT_OVER_CAPACITY
    return 0


def _folder_model(
    path: str, seq_len: int | None, rows: int, *, trust_remote_code: bool, command: str
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A Hugging Face folder's model on meta (no weight memory) and one micro-batch of token ids."""
    folder = HFFolder(path, trust_remote_code=trust_remote_code)
    config = folder.config
    folder.check_causal_lm(config, command=command)
    longest = max_positions(config)
    length = seq_len or min(1024, longest or 1024)
    if longest is not None and length > longest:
        raise CliArgumentError(f"--seq-len {length} is longer than the model's {longest} positions")
    module = folder.build(meta=True, config=config)  # partition takes the Hugging Face model as it is
    return module, folder.example_inputs(seq_len=length, micro_batch_size=rows)


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
    over: list[str] = []
    for r in range(sched.num_ranks):
        need = state[r] + peaks[r]
        capacity = min(plan.stages[s].capacity for s in sched.stages_of(r))
        if need > capacity:
            over.append(f"rank {r} ({fmt_bytes(need)} of {fmt_bytes(capacity)})")
        table.add_row(
            str(r), ",".join(map(str, sched.stages_of(r))), fmt_time(busy[r]), f"{sim.bubble[r]:.1%}",
            str(sim.peak_inflight[r]), fmt_bytes(need) + (" OVER" if need > capacity else ""),
        )
    console.print(table)
    smallest = min(st.capacity for st in plan.stages)
    console.print(
        f"step {fmt_time(sim.step_time)}, bubble {sim.bubble_total:.1%}, "
        f"fullest device {fmt_bytes(pred.memory)} of {fmt_bytes(smallest)}" + (" OVER" if over else "")
    )
    if args.trace:
        save_chrome_trace(sim.timeline, args.trace, name=f"pipecut {schedule} m={m}")
        console.print(f"trace written to {args.trace} (open in ui.perfetto.dev or chrome://tracing)")
    if args.gantt:
        save_gantt_png(sim.timeline, args.gantt, title=f"{schedule}, {m} micro-batches")
        console.print(f"Gantt chart written to {args.gantt}")
    if over:
        print(f"pipecut: over capacity: {', '.join(over)}; re-plan with more stages, fewer micro-batches "
              f"in flight or a schedule that holds fewer (exit code {EXIT_OVER_CAPACITY})", file=sys.stderr)
        return EXIT_OVER_CAPACITY
    return 0


# -- pipecut calibrate / plan --calibrate ------------------------------------------------------


def _add_calibrate_parser(sub: Any) -> None:
    cal = sub.add_parser(
        "calibrate", help="fit the planner's cluster to a model on this host (or measure the host alone); "
        "save it for `plan --calibrate`",
        description="With --model: measure this host as DEVICES one-thread processes get it (matmul FLOP/s at "
        "the model's sizes, memory bandwidth, per-op overhead, gloo p2p and all-reduce), then fit that cluster "
        "to the model as the runtime trains it on DEVICES processes at once (its step's speed and per-op "
        "overhead, the runtime's cost per pipeline action, the cores they share) and save it as JSON. Without "
        "--model: the host measurement alone (docs/partitioning.md, Calibration).",
    )
    cal.add_argument("--devices", type=_count, required=True, help="devices (one process each) to measure and fit")
    cal.add_argument("--backend", default="gloo", choices=("gloo",), help="torch.distributed backend (gloo)")
    cal.add_argument("--processes", type=_count, default=None,
                     help="processes computing at once while the host is measured (default: --devices)")
    cal.add_argument("--model", default=None,
                     help="the model to fit to (a plan MODEL: built-in name, path/to/file.py:factory or a Hugging "
                     "Face folder, built with random weights); without it, only the host is measured")
    cal.add_argument("--global-batch", type=_count, default=None,
                     help="with --model: the job's rows per step, the rows the fit draws from (default: --devices)")
    cal.add_argument("--seq-len", type=_count, default=None,
                     help="a Hugging Face folder's sequence length (default: 1024, or the model's maximum)")
    cal.add_argument("--trust-remote-code", action="store_true",
                     help="let a --model folder's own code (auto_map, modeling_*.py) run; off by default")
    cal.add_argument("--quick", action="store_true",
                     help="tiny probe sizes and 3 timed steps per fit: a rough calibration in seconds")
    cal.add_argument("--timeout", type=float, default=600.0, help="seconds before each phase is stopped")
    cal.add_argument("--out", required=True, help="write the measured (or fitted) cluster (JSON) here")


def _calibrate(args: argparse.Namespace) -> int:
    if not args.model:
        probe = Probe.tiny() if args.quick else Probe()
        _measure_and_save(args.out, args.devices, probe, processes=args.processes, timeout=args.timeout)
        return 0
    _fit_and_save(args.out, args.model, args.devices, global_batch=args.global_batch, seq_len=args.seq_len,
                  trust_remote_code=args.trust_remote_code, quick=args.quick, processes=args.processes,
                  timeout=args.timeout)
    return 0


def _calibrated(args: argparse.Namespace, devices: int, model: nn.Module) -> Cluster:
    """The cluster in ``args.calibrate`` for ``devices`` devices; fitted to the model there first when
    it does not exist (what ``pipecut calibrate --model`` does)."""
    path, link = args.calibrate, args.link_bandwidth
    if link is not None:
        raise CliArgumentError(f"--link-bandwidth {link:g} and --calibrate {path} both set the links; give one")
    if os.path.exists(path):
        cluster = Cluster.load(path)
        print(f"cluster measured earlier, read from {path}")
    else:
        limit = 8 * (os.cpu_count() or 1)
        if devices > limit:
            raise CliArgumentError(
                f"--calibrate fits the model on this host with one process per device, and {devices} devices are "
                f"more than it runs ({limit} at most here): plan another machine's cluster with --device, or "
                "calibrate on it"
            )
        cluster = _fit_and_save(path, args.model, devices, global_batch=args.global_batch, seq_len=args.seq_len,
                                trust_remote_code=args.trust_remote_code)
    if len(cluster) < devices:
        raise CliArgumentError(
            f"{path} describes {len(cluster)} devices but the plan needs {devices}; measure again: "
            f"pipecut calibrate --model {args.model} --devices {devices} --out {path}"
        )
    _check_fitted_to(path, args.model, devices, model)
    return cluster.with_devices(devices)


def _check_fitted_to(path: str, spec: str, devices: int, model: nn.Module) -> None:
    """Warn when the cluster in ``path`` was fitted on another model or device count, or on none."""
    from runtime.calibration import FITTED_TO, fit_mismatch, model_id

    fitted_to = Cluster.load_details(path).get(FITTED_TO)
    refit = f"pipecut calibrate --model {spec} --devices {devices} --out {path}"
    if not fitted_to:
        print(f"pipecut: note: {path} measured this host alone, not fitted to a model; its predictions rank "
              f"layouts poorly on CPU processes (docs/partitioning.md, Calibration): {refit}", file=sys.stderr)
        return
    why = fit_mismatch(fitted_to, model_id=model_id(spec), devices=devices,
                       parameters=sum(p.numel() for p in model.parameters()))
    if why:
        print(f"pipecut: warning: {path}: {why}; its speeds and overheads are that job's. Fit this one: {refit}",
              file=sys.stderr)


def _builder(spec: str, seq_len: int | None, trust_remote_code: bool) -> Callable[[], tuple[nn.Module, Any]]:
    """A picklable factory of ``spec``'s model and one micro-batch (every fitting process calls it)."""
    if is_hf_folder(spec):  # on meta: each process makes its tensors real and initialises them
        return functools.partial(_folder_model, spec, seq_len, 1, trust_remote_code=trust_remote_code,
                                 command="pipecut calibrate")
    return functools.partial(load_model, spec)


def _fit_and_save(
    path: str, spec: str, devices: int, *, global_batch: int | None, seq_len: int | None, trust_remote_code: bool,
    quick: bool = False, processes: int | None = None, timeout: float = 600.0,
) -> Cluster:
    """Measure the host at the model's sizes, fit it to the model on ``devices`` processes, print both, save."""
    from runtime import calibration

    build = _builder(spec, seq_len, trust_remote_code)
    model, inputs = build()
    probe = _model_probe(Probe.tiny() if quick else None, model, inputs)
    del model
    host, cal = _measure_host(devices, probe, processes=processes, timeout=timeout)
    console = _console()
    console.print(f"fitting it to {spec} on {devices} processes (each trains the model as the runtime does)...")
    fit = calibration.fit_model(build, host, model=spec, model_id=calibration.model_id(spec), global_batch=global_batch,
                                repeat=3 if quick else 7, timeout=timeout)
    fit.cluster.save(path, details={**cal.summary(), **fit.details()})
    _print_fit(console, host, fit.cluster, spec)
    console.print(f"fitted in {fit.wall_s:.1f} s ({fit.loss}, {fit.parameters:,} parameters, global batch "
                  f"{fit.global_batch}); cluster written to {path}")
    return fit.cluster


def _print_fit(console: Console, host: Cluster, fitted: Cluster, spec: str) -> None:
    was, now = host.devices[0], fitted.devices[0]
    _print_table(console, ("per process", "host measured", f"fitted to {spec}"), [
        ("matmul fp32", _flops(was.peak_flops_fp32), _flops(now.peak_flops_fp32)),
        ("matmul bf16", _flops(was.peak_flops), _flops(now.peak_flops)),
        ("memory bandwidth", _rate(was.mem_bandwidth), _rate(now.mem_bandwidth)),
        ("op overhead", _secs(was.op_overhead), _secs(now.op_overhead)),
        ("action overhead", _secs(was.action_overhead), _secs(now.action_overhead)),
        ("cores shared", str(host.cores or "-"), str(fitted.cores or "-")),
    ])


def _print_table(console: Console, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    from rich.table import Table

    table = Table(show_edge=False)
    for col in columns:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _model_probe(probe: Probe | None, model: nn.Module, inputs: tuple[Any, ...]) -> Probe:
    """``probe`` (default ``Probe()``) timing the model's own matrix products."""
    from partitioner.tracing.trace import trace

    probe = probe or Probe()
    gemms = model_gemms(trace(model, inputs))
    return probe.with_gemms(gemms) if gemms else probe


def _flops(x: float) -> str:
    return f"{x / 1e9:.1f} GFLOP/s"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{fmt_bytes(x)}/s"


def _secs(x: float | None) -> str:
    return "-" if x is None else fmt_time(x)


def _measure_and_save(path: str, devices: int, probe: Probe, *, processes: int | None = None,
                      timeout: float = 600.0) -> Cluster:
    cluster, cal = _measure_host(devices, probe, processes=processes, timeout=timeout)
    cluster.save(path, details=cal.summary())
    _console().print(f"cluster written to {path}")
    return cluster


def _measure_host(devices: int, probe: Probe, *, processes: int | None, timeout: float) -> tuple[Cluster, Any]:
    """This host measured as ``devices`` processes get it (``calibrate.measure``), printed beside the preset."""
    from partitioner.cost import calibrate

    console = _console()
    console.print(f"measuring {devices} gloo processes of this host ({os.cpu_count()} CPUs)...")
    cal = calibrate.measure(devices, processes=processes, probe=probe, timeout=timeout)
    cluster = Cluster.from_calibration(cal)
    dev, cpu = cluster.devices[0], DEVICE_PRESETS["cpu"]
    rows = [
        ("matmul fp32", _flops(dev.peak_flops_fp32), _flops(cpu.peak_flops_fp32)),
        ("matmul bf16", _flops(dev.peak_flops), _flops(cpu.peak_flops)),
        ("memory bandwidth", _rate(dev.mem_bandwidth), _rate(cpu.mem_bandwidth)),
        ("op overhead", _secs(dev.op_overhead), _secs(cpu.op_overhead)),
    ]
    if devices > 1:
        rows += [
            ("p2p bandwidth", _rate(cluster.link_bandwidth[0]), _rate(cpu.link_bandwidth)),
            ("p2p latency", _secs(cluster.link_latency[0]), _secs(cpu.link_latency)),
            ("all-reduce bus bandwidth", _rate(cluster.collective_bandwidth), "-"),
            ("all-reduce latency per step", _secs(cluster.collective_latency), "-"),
        ]
    _print_table(console, ("per process", "measured", "preset 'cpu'"), rows)
    console.print(f"{cal.processes} processes measured at once in {cal.wall_s:.1f} s")
    return cluster, cal


# -- pipecut train -----------------------------------------------------------------------------

# flag -> (type, help); each is a key of pipecut.train.config.TrainConfig (docs/train.md).
_TRAIN_FLAGS: dict[str, tuple[Any, str]] = {
    "model": (str, "a Hugging Face folder: config.json, and weights to fine-tune (safetensors or pytorch_model.bin)"),
    "data": (str, "training tokens: .npy (1-D ints), .bin (raw uint16, nanoGPT's format), .txt or .jsonl"),
    "out": (str, "the run's folder: plan.json, metrics.jsonl, checkpoints/, final/"),
    "steps": (int, "optimizer steps in all (default 100); rerun with more to continue"),
    "seq-len": (int, "tokens per sequence (default 256)"),
    "global-batch": (int, "sequences per optimizer step over all replicas (default 8)"),
    "micro-batch-size": (int, "sequences per micro-batch (default 1)"),
    "pp": (int, "pipeline ranks (default: world size / dp; 1 in one process)"),
    "dp": (int, "data-parallel replicas, under torchrun (default: world size / pp)"),
    "schedule": (str, "pipeline schedule or 'auto' (default 1f1b)"),
    "zero": (str, "sharding over the replicas (dp >= 2): none (default), zero1 (optimizer state) or fsdp (FSDP2)"),
    "layout": (str, ("manual (default: the flags above) or auto: the planner chooses dp, pp, schedule, micro-batch "
                     "size, recomputation and sharding for --global-batch; the layout flags given constrain it")),
    "plan": (str, "train this saved plan (pipecut plan ... --json, or a run's OUT/plan.json): its layout"),
    "calibrate": (str, "with --layout auto: price the layouts on this cluster JSON (from pipecut calibrate)"),
    "precision": (str, "fp32, bf16 or fp16 (autocast over fp32 weights; default fp32)"),
    "memory-reserve": (str, "memory each device keeps out of the plan: '2GiB', '10%%' (default: the device's own)"),
    "recompute": (str, "activation recomputation: auto (where memory binds), on, off"),
    "lr": (float, "peak learning rate (default 3e-4)"),
    "warmup": (int, "steps of linear warm-up (default 0)"),
    "min-lr": (float, "learning rate at the end of the cosine decay (default lr / 10)"),
    "decay-steps": (int, "the step the decay ends at (default --steps; fix it to extend a run bitwise)"),
    "weight-decay": (float, "AdamW weight decay on matrices (default 0.1)"),
    "max-norm": (float, "clip gradients to this total norm (default 1.0)"),
    "checkpoint-every": (int, "save a checkpoint every N steps (default 100; always at the end)"),
    "keep": (int, "checkpoints kept (default 2)"),
    "eval-every": (int, "evaluate every N steps (default 0: never)"),
    "eval-data": (str, "evaluation tokens (default: another stream of --data)"),
    "eval-batches": (int, "batches per evaluation (default 4)"),
    "seed": (int, "seed of the initialisation and of the data order (default 0)"),
    "data-dtype": (str, "token type of a .bin: uint16 (default), uint32, int32, int64"),
    "device": (str, "device preset the plan is costed for (default: this machine's)"),
    "trust-remote-code": (bool, "let the folder's own code (auto_map, modeling_*.py) run; off by default"),
    "allow-nonfinite-weights": (str, ("comma-separated patterns of weight names that may load holding NaN/inf "
                                     "(e.g. '*.masked_bias'); every other loaded tensor must be finite")),
    "log-every": (int, ("a progress line every N steps, and at the first and last, on stdout when it is not a "
                        "terminal and in OUT/train.log (default: about 20 lines over --steps)")),
}

# Switches (true when given): each is a bool key of TrainConfig.
_TRAIN_SWITCHES: dict[str, str] = {
    "check-finite": "stop at a micro-batch's NaN or infinite loss before the optimizer step",
    "allow-nonfinite-loss": "train on past a NaN or infinite loss or gradient norm (default: stop, exit 2); "
                            "non-finite weights are still never checkpointed",
    "tensorboard": "also write the metrics as TensorBoard event files under OUT/tensorboard (pip install tensorboard)",
}


def _add_train_parser(sub: Any) -> None:
    train = sub.add_parser(
        "train", help="train a Hugging Face folder on a token file as a pipeline; rerun to resume",
        description="Train a Hugging Face causal LM folder on a token file, in one process (a thread per "
        "stage) or under torchrun (dp x pp processes). Running the same command again resumes.",
    )
    train.add_argument("--config", dest="config_file", default=None,
                       help="a TOML file of these settings (flags override it)")
    for flag, (kind, text) in _TRAIN_FLAGS.items():
        if kind is bool:  # a switch: given or not
            train.add_argument(f"--{flag}", action="store_true", default=argparse.SUPPRESS, help=text)
        else:
            train.add_argument(f"--{flag}", type=kind, default=argparse.SUPPRESS, help=text)
    for flag, text in _TRAIN_SWITCHES.items():
        train.add_argument(f"--{flag}", action="store_true", default=argparse.SUPPRESS, help=text)


def _train(args: argparse.Namespace) -> int:
    from pipecut.train import StartReport, read_toml, resolve, train
    from pipecut.train.report import StepLog
    from runtime.metrics import TrainingProgress

    flags = {k: v for k, v in vars(args).items() if k.replace("_", "-") in {**_TRAIN_FLAGS, **_TRAIN_SWITCHES}}
    cfg = resolve(read_toml(args.config_file) if args.config_file else {}, flags)
    t0 = time.perf_counter()
    # The process group starts inside train(); under torchrun, RANK says who prints.
    leader = os.environ.get("RANK", "0") == "0"
    # A terminal gets the live bar; a file or a pipe (a batch job's log) a plain line every --log-every steps,
    # since a bar written there shows only its last frame.
    terminal = Console().is_terminal
    lines: list[StepLog] = []
    bars: list[TrainingProgress] = []

    with contextlib.ExitStack() as stack:

        def started(report: StartReport) -> None:
            if leader:
                print("\n".join(report.lines()), flush=True)
                lines.append(StepLog(steps=cfg.steps, every=cfg.log_interval))  # its clock starts at the first step
            # The bar under the block, its clock from the first step too.
            bars.append(stack.enter_context(TrainingProgress(total=cfg.steps, enabled=leader and terminal)))

        def stepped(metrics: Mapping[str, Any]) -> None:
            bars[0].update(metrics)
            text = lines[0].text(metrics) if lines and not terminal else None
            if text is not None:
                print(text, flush=True)

        result = train(cfg, on_step=stepped, on_start=started)
    if leader:
        done = len(result.metrics)
        last = result.metrics[-1] if result.metrics else None
        start = f" (resumed at step {result.resumed_from})" if result.resumed_from else ""
        loss = f", last loss {last['loss']:.4f}" if last else ""
        written = f"model written to {result.final}" if result.final else "no model written (weights not finite)"
        print(f"trained {done} steps{start} in {time.perf_counter() - t0:.1f} s{loss}; {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
