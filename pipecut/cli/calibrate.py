"""``pipecut calibrate``: fit the planner's cluster to a model on this host's processes (or measure
the host alone), and ``pipecut plan --calibrate FILE``'s reading of it (docs/partitioning.md,
*Calibration*). The work is ``runtime.calibration`` and ``partitioner.cost.calibrate``'s; this
module parses, prints and saves.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from torch import nn

from partitioner.cost.devices import DEVICE_PRESETS, Cluster
from partitioner.cost.gemms import model_gemms
from partitioner.cost.probes import Probe
from partitioner.errors import CliArgumentError
from partitioner.plan.render import fmt_bytes, fmt_time
from partitioner.zoo import load_model
from pipecut.cli.common import folder_model, make_console, positive_count
from pipecut.folder import is_hf_folder

__all__ = ["add_calibrate_parser", "calibrate_command", "calibrated"]


def add_calibrate_parser(sub: Any) -> None:
    cal = sub.add_parser(
        "calibrate", help="fit the planner's cluster to a model on this host (or measure the host alone); "
        "save it for `plan --calibrate`",
        description="With --model: measure this host as DEVICES one-thread processes get it (matmul FLOP/s at "
        "the model's sizes, memory bandwidth, per-op overhead, gloo p2p and all-reduce), then fit that cluster "
        "to the model as the runtime trains it on DEVICES processes at once (its step's speed and per-op "
        "overhead, the runtime's cost per pipeline action, the cores they share) and save it as JSON. Without "
        "--model: the host measurement alone (docs/partitioning.md, Calibration).",
    )
    cal.add_argument("--devices", type=positive_count, required=True,
                     help="devices (one process each) to measure and fit")
    cal.add_argument("--backend", default="gloo", choices=("gloo",), help="torch.distributed backend (gloo)")
    cal.add_argument("--processes", type=positive_count, default=None,
                     help="processes computing at once while the host is measured (default: --devices)")
    cal.add_argument("--model", default=None,
                     help="the model to fit to (a plan MODEL: built-in name, path/to/file.py:factory or a Hugging "
                     "Face folder, built with random weights); without it, only the host is measured")
    cal.add_argument("--global-batch", type=positive_count, default=None,
                     help="with --model: the job's rows per step, the rows the fit draws from (default: --devices)")
    cal.add_argument("--seq-len", type=positive_count, default=None,
                     help="a Hugging Face folder's sequence length (default: 1024, or the model's maximum)")
    cal.add_argument("--trust-remote-code", action="store_true",
                     help="let a --model folder's own code (auto_map, modeling_*.py) run; off by default")
    cal.add_argument("--quick", action="store_true",
                     help="tiny probe sizes and 3 timed steps per fit: a rough calibration in seconds")
    cal.add_argument("--timeout", type=float, default=600.0, help="seconds before each phase is stopped")
    cal.add_argument("--out", required=True, help="write the measured (or fitted) cluster (JSON) here")


def calibrate_command(args: argparse.Namespace) -> int:
    if not args.model:
        probe = Probe.tiny() if args.quick else Probe()
        _measure_and_save(args.out, args.devices, probe, processes=args.processes, timeout=args.timeout)
        return 0
    _fit_and_save(args.out, args.model, args.devices, global_batch=args.global_batch, seq_len=args.seq_len,
                  trust_remote_code=args.trust_remote_code, quick=args.quick, processes=args.processes,
                  timeout=args.timeout)
    return 0


def calibrated(args: argparse.Namespace, devices: int, model: nn.Module) -> Cluster:
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
        return functools.partial(folder_model, spec, seq_len, 1, trust_remote_code=trust_remote_code,
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
    console = make_console()
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
    make_console().print(f"cluster written to {path}")
    return cluster


def _measure_host(devices: int, probe: Probe, *, processes: int | None, timeout: float) -> tuple[Cluster, Any]:
    """This host measured as ``devices`` processes get it (``calibrate.measure``), printed beside the preset."""
    from partitioner.cost import calibrate

    console = make_console()
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
