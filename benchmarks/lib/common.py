"""What the benchmark scripts share: the git state a result was measured at, list arguments, step-time statistics."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]


def git_state(paths: tuple[str, ...] = ("partitioner", "runtime", "pipecut")) -> dict[str, Any]:
    """The commit the library was at and its uncommitted files under ``paths`` ({} outside git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", *paths], cwd=ROOT, capture_output=True,
                               text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {"commit": head.stdout.strip(), "dirty": [ln[3:] for ln in dirty.stdout.splitlines()]}


def int_list(text: str) -> list[int]:
    """``'4,8,16' -> [4, 8, 16]`` for comma-separated command-line values."""
    return [int(x) for x in text.split(",") if x.strip()]


def gpt2_size_args(ap: argparse.ArgumentParser, *, n_layer: int, n_embd: int, n_head: int, vocab: int, seq: int,
                   n_positions: int | None = None, seq_help: str | None = None) -> None:
    """The options of a script that builds ``partitioner.zoo.gpt2``'s sizes, with the script's defaults:
    ``--n-layer``, ``--n-embd``, ``--n-head``, ``--n-positions`` (where ``n_positions`` is given), ``--vocab``
    and ``--seq``."""
    ap.add_argument("--n-layer", type=int, default=n_layer)
    ap.add_argument("--n-embd", type=int, default=n_embd)
    ap.add_argument("--n-head", type=int, default=n_head)
    if n_positions is not None:
        ap.add_argument("--n-positions", type=int, default=n_positions)
    ap.add_argument("--vocab", type=int, default=vocab)
    ap.add_argument("--seq", type=int, default=seq, help=seq_help)


def load_before(what: str) -> tuple[float, float, float]:
    """The load average now; prints a note when other work already competes with ``what``."""
    load = os.getloadavg()
    if load[0] > (os.cpu_count() or 1):
        print(f"note: load average {load[0]:.1f} on {os.cpu_count()} CPUs; other work competes with {what}")
    return load


def run_env(load: tuple[float, float, float], started: float, *, git: bool = True) -> dict[str, Any]:
    """Where and how a multi-process benchmark ran: versions, CPUs, load before and after, wall time."""
    env: dict[str, Any] = {
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
        "load_avg_before": load, "load_avg_after": os.getloadavg(), "machine": platform.machine(),
        "wall_s": time.time() - started,
    }
    if git:
        env["git"] = git_state()
    return env


def proc_status() -> dict[str, int]:
    """VmHWM (peak RSS), VmRSS, RssAnon and RssFile of this process, in bytes (Linux)."""
    out: dict[str, int] = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024  # kB
    return out


def write_result(path: str | Path, result: dict[str, Any]) -> Path:
    """Write ``result`` as JSON at ``path`` (folders made) and say so."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return out


def step_times(per_rank: list[dict[str, list[tuple[float, float]]]]) -> dict[str, list[float]]:
    """Per configuration and round, from each rank's ``(start, end)`` spans: the last rank's end
    minus the first rank's start (one ``perf_counter`` clock for the machine)."""
    out: dict[str, list[float]] = {}
    for name in per_rank[0]:
        rounds = zip(*(spans[name] for spans in per_rank))
        out[name] = [max(e for _, e in r) - min(s for s, _ in r) for r in rounds]
    return out


def quartiles(ts: Sequence[float]) -> list[float]:
    """The 25th, 50th and 75th percentiles of one configuration's step times (one time is all three)."""
    return statistics.quantiles(ts, n=4) if len(ts) >= 2 else [ts[0]] * 3


def spread_ms(ts: Sequence[float]) -> dict[str, float]:
    """Median, quartiles and minimum of step times in seconds, as milliseconds, and their count."""
    q = quartiles(ts)
    return {"median_ms": statistics.median(ts) * 1e3, "p25_ms": q[0] * 1e3, "p75_ms": q[2] * 1e3,
            "min_ms": min(ts) * 1e3, "n": len(ts)}


def times_ms(times: Mapping[str, Sequence[float]]) -> dict[str, list[float]]:
    """Every round's step time per configuration, in milliseconds to the microsecond, for the result file."""
    return {k: [round(t * 1e3, 3) for t in v] for k, v in times.items()}


def ratio_table(title: str, ratios: Mapping[str, float]) -> Any:
    """The ratios a timing benchmark prints under its table: a rich ``Table`` of name and value (3 decimals)."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("ratio")
    table.add_column("value", justify="right")
    for name, v in ratios.items():
        table.add_row(name, f"{v:.3f}")
    return table
