"""How long ``runtime.transport.launch.spawn`` takes to start ranks: from a fork server, or spawned.

Every multi-process benchmark and test starts its ranks with ``spawn``. A spawned rank is a fresh
interpreter that imports torch and pipecut again (3-6 s of CPU each on a small machine); a rank
forked from the fork server (the default, ``start_method="forkserver"``) starts from a process that
has imported them once. Measured side by side in one run, on ``N`` gloo ranks that join the process
group, check they see this process's environment and working directory, and return:

* **first**: the first call of the run (for the fork server, it includes starting the server);
* **later**: the median of the calls after it;
* each rank's resident memory (VmRSS) as it returns, and its peak (VmHWM): a forked rank shares the
  server's pages, so these are what a rank costs before it does anything.

    python benchmarks/launch.py                  # N = 2, 4; 5 calls each
    python benchmarks/launch.py --quick          # N = 2, 2 calls (the smoke test's)

Prints a table and writes ``benchmarks/results/launch.json``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _folder in (ROOT / "benchmarks", ROOT):  # the helpers in lib/, and this checkout's packages
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import pipecut  # noqa: E402, F401  (imported as a user's script does: the fork server preloads what is imported)
from lib.common import int_list, load_before, proc_status, run_env, write_result  # noqa: E402
from runtime.transport.launch import START_METHODS, spawn  # noqa: E402

_MARK = "PIPECUT_LAUNCH_BENCH"  # set anew before every call: each rank must see this call's value


def _rank(rank: int, world: int, mark: str, cwd: str) -> dict[str, Any]:
    """A rank's check that it started as the caller is now, and its memory."""
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    if int(t) != world * (world + 1) // 2:
        raise RuntimeError(f"rank {rank}: the all-reduce gave {int(t)}")
    if os.environ.get(_MARK) != mark or os.getcwd() != cwd:
        raise RuntimeError(f"rank {rank} sees {_MARK}={os.environ.get(_MARK)!r} in {os.getcwd()!r}, "
                           f"not {mark!r} in {cwd!r}")
    return proc_status()


def measure(method: str, world: int, calls: int) -> dict[str, Any]:
    """``calls`` launches of ``world`` ranks with ``method``: each call's seconds and the ranks' memory."""
    seconds: list[float] = []
    status: list[dict[str, int]] = []
    for call in range(calls):
        mark = f"{method}-{world}-{call}"
        os.environ[_MARK] = mark
        t = time.perf_counter()
        status = spawn(_rank, world, mark, os.getcwd(), start_method=method, timeout=300)
        seconds.append(time.perf_counter() - t)
    later = seconds[1:]
    return {
        "method": method, "world": world, "calls_s": seconds, "first_s": seconds[0],
        "later_median_s": statistics.median(later) if later else None,
        "rank_rss_bytes": max(s["VmRSS"] for s in status), "rank_hwm_bytes": max(s["VmHWM"] for s in status),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--worlds", type=int_list, default=[2, 4])
    ap.add_argument("--calls", type=int, default=5, help="launches per method and N (the first is reported apart)")
    ap.add_argument("--quick", action="store_true", help="N = 2, 2 calls")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "launch.json"))
    cli = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(cli)
    if args.quick:
        args.worlds, args.calls = [2], 2
    if args.calls < 2:
        ap.error(f"--calls {args.calls}: at least 2 (the first call is reported apart from the later ones)")
    t0 = time.time()
    load = load_before("the launches")
    # spawn first: the fork server is started by forkserver's first call, inside its measurement.
    rows = [measure(method, world, args.calls) for method in reversed(START_METHODS) for world in args.worlds]
    by = {(r["method"], r["world"]): r for r in rows}
    ratios = {f"N={w}": by["spawn", w]["later_median_s"] / by["forkserver", w]["later_median_s"] for w in args.worlds}

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"starting N gloo ranks with runtime.transport.launch.spawn ({args.calls} calls each)")
    for col in ("start method", "N", "first call", "later calls (median)", "rank RSS", "rank peak RSS"):
        table.add_column(col, justify="left" if col == "start method" else "right")
    for r in rows:
        table.add_row(r["method"], str(r["world"]), f"{r['first_s']:.2f} s", f"{r['later_median_s']:.3f} s",
                      f"{r['rank_rss_bytes'] / 2**20:.0f} MiB", f"{r['rank_hwm_bytes'] / 2**20:.0f} MiB")
    console = Console()
    console.print(table)
    for name, ratio in ratios.items():
        console.print(f"{name}: a later spawn call takes {ratio:.1f}x a fork-server call")
    write_result(args.out, {"benchmark": "launch", "command": shlex.join(["python", "benchmarks/launch.py", *cli]),
                            "rows": rows, "spawn_over_forkserver": ratios, **run_env(load, t0)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
