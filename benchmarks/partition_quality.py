"""Benchmark: how good are pipecut's cuts? ``exact`` (and ``exact+refine``) against the baselines.

Run (CPU, one thread, no GPU needed: the models are built on ``meta``; about a minute)::

    python benchmarks/partition_quality.py
    python benchmarks/partition_quality.py --models mlp,gpt2,resnet,unet --stages 4,8 \
        --device A100-80GB --microbatches 8 --schedule 1f1b --dtype bfloat16 \
        --out benchmarks/results/partition_quality.json
    python benchmarks/partition_quality.py --quick --models mlp --stages 2   # tiny, seconds

Four models from ``partitioner.zoo`` with costs that vary along the graph (``MODELS`` below):
an MLP chain of uneven widths, GPT-2 medium from a config (the LM head weighs as much as a few
blocks), a ResNet-style CNN (heavy high-resolution stem, cheap deep stages), and a U-Net whose
encoder outputs skip over the bottleneck to the decoder (long skips cross every boundary between
them). Each is built on ``meta`` in ``--dtype`` (bf16 is what the 16 bytes/parameter of training
state assume: bf16 weights and grads, fp32 master weights and Adam moments), traced and costed
ONCE; the graph becomes one ``Problem`` per stage count (``graph.build_graph`` /
``group_units`` / ``to_problem``, exactly as ``partition()`` builds it), and every method runs on
that same ``Problem``:

* ``exact``: pipecut's optimal contiguous cut (time, links and memory);
* ``exact+refine``: then pipecut's local search beyond one topological order;
* ``equal_count``: the same number of units per stage (torchgpipe / DeepSpeed ``'uniform'``);
* ``balanced_params``: min-max parameters per stage (DeepSpeed ``'parameters'``);
* ``equal_size``: PiPPy-style greedy fill to total / p.

Every plan is priced by ``algorithms.evaluate`` under the same cost model. Reported per model,
stage count and method: the bottleneck (largest stage time, forward + backward + transfers, per
micro-batch), its ratio to ``algorithms.lower_bound`` and to exact, bytes cut (bytes crossing all
stage boundaries per micro-batch), whether every stage fits its device's memory, whether
``split_graph`` can build the stages (a cut may not pass a list between stages), and the planning
time (the algorithm alone, best of ``--repeat``). Per model, once: trace and cost times, and the
wall time of one end-to-end ``partition()`` call (trace, cost, cut, split, plan) at the first
stage count, whose bottleneck must equal the one found here (tiny models are traced first, so
one-time start-up costs are not billed to the first model). Exact must never be worse than a
baseline whose plan fits memory: the script raises if it is (that would be a bug).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helpers in lib/
from lib.common import git_state, int_list
from partitioner import Cluster, partition
from partitioner import algorithms as alg
from partitioner.cost.costs import cost_graph
from partitioner.cost.devices import DeviceSpec
from partitioner.cost.graph import build_graph, group_units, to_problem
from partitioner.errors import InfeasibleMemoryError, PartitionError
from partitioner.plan.predict import stage_inflight
from partitioner.plan.split import split_graph
from partitioner.tracing.trace import trace
from partitioner.zoo import MLPChain, ResidualCNN, UNet, gpt2

__all__ = ["BASELINES", "METHODS", "MODELS", "main"]

Built = tuple[nn.Module, tuple[torch.Tensor, ...]]

# Zoo MLPChain's uneven widths x 8, twice over: 18 Linear layers from 128 to 16384 wide.
_MLP_WIDTHS = tuple(8 * w for w in (256, 1024, 128, 2048, 256, 512, 64, 1024, 256)) * 2 + (128,)

# name -> (what it is, full-size builder, --quick builder). Builders run under torch.device('meta').
MODELS: dict[str, tuple[str, Callable[[], Built], Callable[[], Built]]] = {
    "mlp": (
        "MLPChain, 18 Linear+GELU of widths 128..16384, batch 4096",
        lambda: (MLPChain(_MLP_WIDTHS), (torch.randn(4096, _MLP_WIDTHS[0]),)),
        lambda: (MLPChain(), (torch.randn(32, 256),)),
    ),
    "gpt2": (
        "GPT-2 medium config: 24 layers, d 1024, 16 heads, vocab 50257, 8 x 1024 tokens",
        lambda: gpt2(n_layer=24, n_embd=1024, n_head=16, vocab_size=50257, n_positions=1024,
                     batch=8, seq=1024, device="meta"),
        lambda: gpt2(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32,
                     batch=2, seq=32, device="meta"),
    ),
    "resnet": (
        "ResidualCNN width 64 (ResNet-18-like, stride-1 stem), 32 x 3 x 224 x 224",
        lambda: (ResidualCNN(width=64, num_classes=1000), (torch.randn(32, 3, 224, 224),)),
        lambda: (ResidualCNN(width=8), (torch.randn(2, 3, 32, 32),)),
    ),
    "unet": (
        "UNet width 64, 4 levels (long encoder->decoder skips), 8 x 3 x 256 x 256",
        lambda: (UNet(width=64, levels=4), (torch.randn(8, 3, 256, 256),)),
        lambda: (UNet(width=4, levels=2), (torch.randn(1, 3, 32, 32),)),
    ),
}

BASELINES = ("equal_count", "balanced_params", "equal_size")
METHODS: dict[str, Callable[[alg.Problem], alg.Partition]] = {
    "exact": alg.exact,
    "exact+refine": lambda pb: alg.refine(pb, alg.exact(pb)),
    "equal_count": alg.equal_count,
    "balanced_params": alg.balanced_params,
    "equal_size": alg.equal_size,
}
_RTOL = 1e-9  # exact is optimal to 1e-12 relative; evaluate() sums in another order


def _build(name: str, quick: bool, dtype: torch.dtype) -> Built:
    _, full, small = MODELS[name]
    with torch.device("meta"):  # nothing is allocated: tracing and costing run on fake tensors
        model, inputs = (small if quick else full)()
    model = model.to(dtype)
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    return model, inputs


def _warm_up() -> None:
    """Trace and cost two tiny models (fx and export) so that one-time initialisation (imports,
    fake-tensor and dispatcher caches, about half a second) is not billed to the first model."""
    for build in (MODELS["mlp"][2], MODELS["gpt2"][2]):
        with torch.device("meta"):
            model, inputs = build()
        cost_graph(trace(model, inputs))


def _best_of(fn: Callable[[], Any], repeat: int) -> tuple[Any, float]:
    """``fn()``'s result and its least wall time over ``repeat`` calls."""
    best = math.inf
    out = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def _bench_model(
    name: str, args: argparse.Namespace, dtype: torch.dtype
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    model, inputs = _build(name, args.quick, dtype)
    t0 = time.perf_counter()
    traced = trace(model, inputs)
    t1 = time.perf_counter()
    costs = cost_graph(traced)
    t2 = time.perf_counter()
    g = build_graph(traced.gm, costs, traced.module_path)
    units = group_units(g, args.granularity)
    numel = {n: p.numel() for n, p in traced.gm.named_parameters(remove_duplicate=False)}
    info: dict[str, Any] = {
        "model": name,
        "description": MODELS[name][0] if not args.quick else f"--quick: a tiny {name}",
        "params": sum(p.numel() for p in model.parameters()),
        "trace_method": traced.method,
        "nodes": g.number_of_nodes(),
        "units": len(units),
        "trace_s": t1 - t0,
        "cost_s": t2 - t1,
    }
    rows: list[dict[str, Any]] = []
    best_at_first: float | None = None
    for p in args.stages:
        cluster = Cluster.uniform(p, args.device)
        problem = to_problem(
            g, units, cluster, inflight=stage_inflight(args.schedule, p, args.microbatches),
            param_numel=numel, state_bytes_per_param=args.state_bytes_per_param,
        )
        bound = alg.lower_bound(problem)
        results: dict[str, dict[str, Any]] = {}
        for method, fn in METHODS.items():
            try:
                part, secs = _best_of(lambda fn=fn, pb=problem: fn(pb), args.repeat)  # type: ignore[misc]
            except InfeasibleMemoryError as e:  # only exact raises: no contiguous cut fits
                results[method] = {"model": name, "stages": p, "method": method, "error": str(e)}
                continue
            ev = alg.evaluate(problem, part)
            alg.check_assignment(problem, part)
            split_error = _split_error(traced, units, part, p)
            results[method] = {
                "model": name,
                "stages": p,
                "method": method,
                "bottleneck_s": ev.bottleneck,
                "lower_bound_s": bound,
                "ratio_to_lower_bound": ev.bottleneck / bound if bound > 0 else math.nan,
                "bytes_cut": float(sum(ev.boundary_bytes)),
                "boundary_bytes": list(ev.boundary_bytes),
                "stage_time_s": list(ev.time),
                "fits_memory": ev.feasible,
                "splits": split_error is None,
                "split_error": split_error,
                "max_memory_fraction": max(m / c for m, c in zip(ev.memory, problem.capacity)),
                "planning_s": secs,
                "units_per_stage": [len(x) for x in part.stage_units(p)],
            }
        _check_and_relate(results)
        rows.extend(results.values())
        if best_at_first is None and "bottleneck_s" in results["exact+refine"]:
            best_at_first = min(results["exact"]["bottleneck_s"], results["exact+refine"]["bottleneck_s"])

    # One end-to-end partition() (trace, cost, cut, refine, split, plan) at the first stage count.
    p0 = args.stages[0]
    model, inputs = _build(name, args.quick, dtype)
    t0 = time.perf_counter()
    plan = partition(
        model, inputs, p0, cluster=Cluster.uniform(p0, args.device), microbatches=args.microbatches,
        schedule=args.schedule, granularity=args.granularity, state_bytes_per_param=args.state_bytes_per_param,
    )
    info["partition_call_s"] = time.perf_counter() - t0
    info["partition_call_stages"] = p0
    info["partition_call_bottleneck_s"] = plan.bottleneck
    info["partition_call_method"] = plan.method
    if best_at_first is not None and not math.isclose(plan.bottleneck, best_at_first, rel_tol=_RTOL):
        raise AssertionError(
            f"{name}, p={p0}: partition() found bottleneck {plan.bottleneck!r} but exact/exact+refine on "
            f"this script's Problem found {best_at_first!r}; the script no longer builds the Problem "
            "partition() builds"
        )
    return info, rows


def _split_error(traced: Any, units: list[Any], part: alg.Partition, p: int) -> str | None:
    """Whether ``split_graph`` can build the plan's stages (``partition()`` would raise otherwise)."""
    stage_of = {v: part.assignment[u.index] for u in units for v in u.nodes}
    try:
        split_graph(traced.gm, stage_of, p, param_aliases=traced.param_aliases)
    except PartitionError as e:
        return str(e)
    return None


def _check_and_relate(results: dict[str, dict[str, Any]]) -> None:
    """Add ``ratio_to_exact`` and raise if exact loses to a memory-feasible baseline (a bug)."""
    ex = results["exact"]
    for r in results.values():
        if "bottleneck_s" not in r:
            continue
        r["ratio_to_exact"] = r["bottleneck_s"] / ex["bottleneck_s"] if "bottleneck_s" in ex else math.nan
    if "bottleneck_s" not in ex:
        fitting = [m for m in BASELINES if results[m].get("fits_memory")]
        if fitting:
            raise AssertionError(f"{ex['model']}, p={ex['stages']}: exact found no plan but {fitting} fit memory")
        return
    for m in BASELINES:
        b = results[m]
        if b["fits_memory"] and ex["bottleneck_s"] > b["bottleneck_s"] * (1 + _RTOL):
            raise AssertionError(
                f"{b['model']}, p={b['stages']}: exact's bottleneck {ex['bottleneck_s']!r} is worse than "
                f"{m}'s {b['bottleneck_s']!r}; exact is optimal over contiguous cuts, so this is a bug"
            )
    er = results["exact+refine"]
    if er["bottleneck_s"] > ex["bottleneck_s"] * (1 + _RTOL):
        raise AssertionError(f"{ex['model']}, p={ex['stages']}: refine made exact's plan worse")


def _print(console: Console, header: str, infos: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    table = Table(title=f"partition quality -- {header}", title_justify="left")
    for col in ("model", "p", "method", "bottleneck", "x lower bound", "x exact", "bytes cut",
                "fits", "splits", "planning"):
        table.add_column(col, justify="left" if col in ("model", "method") else "right")
    last = None
    for r in rows:
        key = (r["model"], r["stages"])
        if last is not None and key != last:
            table.add_section()
        last = key
        if "error" in r:
            table.add_row(r["model"], str(r["stages"]), r["method"], "no plan fits memory", *[""] * 6)
            continue
        table.add_row(
            r["model"], str(r["stages"]), r["method"], f"{r['bottleneck_s'] * 1e3:.3f} ms",
            f"{r['ratio_to_lower_bound']:.3f}", f"{r['ratio_to_exact']:.3f}", f"{r['bytes_cut'] / 2**20:.1f} MiB",
            "yes" if r["fits_memory"] else f"NO ({r['max_memory_fraction']:.2f}x)",
            "yes" if r["splits"] else "NO",
            f"{r['planning_s'] * 1e3:.2f} ms",
        )
    console.print(table)
    mt = Table(title="per model: trace and cost once, then one end-to-end partition()", title_justify="left")
    for col in ("model", "what", "params", "tracer", "nodes", "units", "trace", "cost", "partition() e2e"):
        mt.add_column(col, justify="left" if col in ("model", "what", "tracer") else "right")
    for i in infos:
        mt.add_row(
            i["model"], i["description"], f"{i['params'] / 1e6:.1f}M", i["trace_method"], str(i["nodes"]),
            str(i["units"]), f"{i['trace_s']:.2f} s", f"{i['cost_s']:.2f} s",
            f"{i['partition_call_s']:.2f} s (p={i['partition_call_stages']})",
        )
    console.print(mt)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--stages", type=int_list, default=[4, 8], help="comma-separated stage counts, e.g. 4,8")
    ap.add_argument("--device", default="A100-80GB", help="device preset; the cluster is p of them in a chain")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "zbh1"))
    ap.add_argument("--granularity", default="node", choices=("node", "module"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--state-bytes-per-param", type=float, default=16.0)
    ap.add_argument("--repeat", type=int, default=3, help="planning time is the best of this many runs")
    ap.add_argument("--quick", action="store_true", help="tiny versions of the models (for tests)")
    ap.add_argument("--out", default="benchmarks/results/partition_quality.json")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown or not names:
        ap.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    if not args.stages or min(args.stages) < 2 or args.repeat < 1:
        ap.error("need --stages of at least 2 and --repeat >= 1")
    DeviceSpec.preset(args.device)  # fail early on a typo
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)

    t_start = time.perf_counter()
    _warm_up()
    infos: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    for name in names:
        info, r = _bench_model(name, args, dtype)
        infos.append(info)
        rows.extend(r)
    header = (
        f"{'/'.join(map(str, args.stages))} x {args.device}, {args.schedule}, {args.microbatches} micro-batches, "
        f"{args.dtype}, granularity {args.granularity}; bottleneck per micro-batch (fwd+bwd+comm of the slowest stage)"
    )
    console = Console(width=None if sys.stdout.isatty() else 150)
    _print(console, header, infos, rows)

    cli = sys.argv[1:] if argv is None else list(argv)
    result = {
        "benchmark": "partition_quality",
        "command": shlex.join(["python", "benchmarks/partition_quality.py", *cli]),
        "sys_argv": list(sys.argv),
        "config": {
            "models": names, "stages": args.stages, "device": args.device, "cluster": "uniform chain",
            "microbatches": args.microbatches, "schedule": args.schedule, "granularity": args.granularity,
            "dtype": args.dtype, "state_bytes_per_param": args.state_bytes_per_param, "repeat": args.repeat,
            "quick": args.quick, "methods": list(METHODS),
        },
        "env": {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                "threads": torch.get_num_threads(), "machine": platform.machine(), "git": git_state(),
                "wall_s": time.perf_counter() - t_start},
        "models": infos,
        "results": rows,
        "checks": {"exact_le_every_fitting_baseline": True, "refine_never_worse": True,
                   "partition_call_matches": True, "rtol": _RTOL},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
