"""Why data parallelism averages gradients with an all-reduce, not through a parameter server.

Measures, on N gloo processes over loopback, the time to average a gradient of G bytes across
the N replicas two ways, side by side in one run:

* **all-reduce**: ``dist.all_reduce`` (gloo's ring/halving-doubling), what pipecut's data
  parallelism does (``runtime/parallel/data_parallel.py``);
* **parameter server**: every worker sends its gradient to rank 0 (the server), which sums them
  and sends the average back to each (point-to-point ``isend``/``irecv``), the classic
  one-server scheme.

It also prints the bandwidth model of both for larger jobs: per step, a ring all-reduce moves
``2 (N - 1) / N * G`` bytes over every rank's link, whatever N, while one server's link moves
``(N - 1) * G`` in (push) and then out (pull), so its time grows with N; sharding the server over
``S`` workers divides that by ``S``, and with ``S = N`` matches the all-reduce, which is then
what it has become (a reduce-scatter and an all-gather).

    python benchmarks/sync_vs_ps.py                 # N = 2, 4; G = 4, 16 MiB
    python benchmarks/sync_vs_ps.py --quick         # a smoke run

Prints a table and writes ``benchmarks/results/sync_vs_ps.json``.
"""

from __future__ import annotations

import argparse
import json
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

from lib.common import git_state, int_list  # noqa: E402
from runtime.transport.launch import spawn  # noqa: E402


def _parameter_server(grad: torch.Tensor) -> torch.Tensor:
    """Average ``grad`` over the world through rank 0: gather by sends, sum, send back."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        dist.send(grad, 0)
        out = torch.empty_like(grad)
        dist.recv(out, 0)
        return out
    bufs = [torch.empty_like(grad) for _ in range(world - 1)]
    works = [dist.irecv(b, src) for src, b in enumerate(bufs, start=1)]
    for w in works:
        w.wait()
    total = grad.clone()
    for b in bufs:
        total += b
    total /= world
    sends = [dist.isend(total, dst) for dst in range(1, world)]
    for w in sends:
        w.wait()
    return total


def _all_reduce(grad: torch.Tensor) -> torch.Tensor:
    out = grad.clone()
    dist.all_reduce(out)
    return out / dist.get_world_size()


def _worker(rank: int, world: int, sizes_mib: list[int], repeat: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(rank)
    for mib in sizes_mib:
        grad = torch.randn(mib * 2**20 // 4, generator=gen)
        want = _all_reduce(grad)
        torch.testing.assert_close(_parameter_server(grad), want)  # the same average
        for name, fn in (("all_reduce", _all_reduce), ("parameter_server", _parameter_server)):
            times = []
            for _ in range(repeat):
                dist.barrier()
                t = time.perf_counter()
                fn(grad)
                times.append(time.perf_counter() - t)
            out[f"{mib}/{name}"] = statistics.median(times)
    return out


def model(n: int, gbytes: float, link_gbps: float, servers: int = 1) -> dict[str, float]:
    """Seconds per exchange of ``gbytes`` GB over ``n`` replicas on full-duplex links of
    ``link_gbps`` Gb/s, bandwidth only.

    Ring all-reduce: every link carries ``2 (n - 1) / n`` of the gradient. Parameter server with
    ``servers`` of the ``n`` workers each holding ``1 / servers`` of the parameters: a push (each
    server receives its shard from the ``n - 1`` others) then a pull (it sends them back), each
    phase as long as its busiest link: ``max((n - 1) / servers, 1)`` gradients.
    """
    bw = link_gbps / 8  # GB/s
    ring = 2 * (n - 1) / n * gbytes / bw
    ps = 2 * max((n - 1) / servers, 1.0) * gbytes / bw
    return {"all_reduce_s": ring, "parameter_server_s": ps, "ratio": ps / ring}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int_list, default=[2, 4])
    parser.add_argument("--sizes-mib", type=int_list, default=[4, 16])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="N = 2, G = 1 MiB, 2 repeats")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sync_vs_ps.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.worlds, args.sizes_mib, args.repeat = [2], [1], 2
    from rich.console import Console
    from rich.table import Table

    rows = []
    for world in args.worlds:
        res = spawn(_worker, world, args.sizes_mib, args.repeat, timeout=600)
        for mib in args.sizes_mib:
            # The slowest rank's median decides the step.
            ar = max(r[f"{mib}/all_reduce"] for r in res)
            ps = max(r[f"{mib}/parameter_server"] for r in res)
            rows.append({"world": world, "mib": mib, "all_reduce_s": ar, "parameter_server_s": ps, "ratio": ps / ar})
    table = Table(title="averaging a gradient over N gloo processes (loopback, measured, median)")
    for col in ("N", "gradient", "all-reduce", "parameter server", "server / all-reduce"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["world"]), f"{r['mib']} MiB", f"{1e3 * r['all_reduce_s']:.1f} ms",
                      f"{1e3 * r['parameter_server_s']:.1f} ms", f"{r['ratio']:.2f}")
    modelled = [{"n": n, "servers": s, **model(n, 1.0, 100.0, s)} for n in (8, 64, 256) for s in sorted({1, 8, n})]
    mtable = Table(title="bandwidth model: 1 GB of gradients, 100 Gb/s links")
    for col in ("N", "servers", "all-reduce", "parameter server", "server / all-reduce"):
        mtable.add_column(col, justify="right")
    for m in modelled:
        mtable.add_row(str(m["n"]), str(m["servers"]), f"{m['all_reduce_s']:.2f} s",
                       f"{m['parameter_server_s']:.2f} s", f"{m['ratio']:.1f}")
    console = Console()
    console.print(table)
    console.print(mtable)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"measured": rows, "model": modelled, "git": git_state(),
                                          "threads": torch.get_num_threads()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
