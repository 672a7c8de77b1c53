"""Benchmark: plan a 175B-parameter GPT-2 (GPT-3 size) for 64 x 80 GB GPUs on a 2-core CPU.

Run (CPU, one thread, no GPU and no weights: the model is built on ``meta``; about 20 s)::

    python benchmarks/plan_scale.py
    python benchmarks/plan_scale.py --n-layer 96 --n-embd 12288 --n-head 96 --n-positions 2048 \
        --vocab 50257 --seq 2048 --micro-batch 1 --devices 64 --device A100-80GB --schedule 1f1b \
        --microbatches 8 --dtype bfloat16 --granularity node,module --sweep 8,16,24,32,64 \
        --out benchmarks/results/plan_scale.json
    python benchmarks/plan_scale.py --quick      # a 2-layer toy on 4 devices, for tests

What it does, each step timed: build the model from a config on ``meta``; ``trace`` it (one flat
graph with fake-tensor shapes); ``cost_graph`` it; then, for each ``--granularity``, the
partition step as ``partition()`` runs it (``build_graph``, ``group_units``, ``to_problem``,
``exact``, ``refine``), with the plan's bottleneck, lower bound and memory per stage. Then one
end-to-end ``partition()`` call at the first granularity (trace to ``Plan``, the wall time a user
waits), whose stage table is printed. Peak RSS is ``getrusage(RUSAGE_SELF).ru_maxrss``.
``--sweep`` re-cuts the costed graph for other micro-batch counts to show which fit memory.
Targets on a 2-core machine: partition() end to end under 30 s, peak RSS under 4 GiB, the
partition step under 1 s.

The memory model (``problem.py``): stage ``s`` holds its parameters' training state
(``--state-bytes-per-param``, 16 = bf16 weights and grads + fp32 master weights and Adam moments,
hence ``--dtype bfloat16`` by default) plus its saved activations times the micro-batches in
flight: ``min(m, p - s)`` under 1F1B. With ``m >= p`` the first stage therefore holds ``p``
micro-batches of its ``1/p`` share of the layers, i.e. about one whole micro-batch of the model's
activations, whatever ``p`` is: the sweep shows where that stops fitting.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helpers in lib/
from lib.common import git_state, gpt2_size_args, int_list
from partitioner import Cluster, partition
from partitioner import algorithms as alg
from partitioner.cost.costs import cost_graph
from partitioner.cost.devices import DeviceSpec
from partitioner.cost.graph import build_graph, group_units, to_problem
from partitioner.errors import InfeasibleMemoryError, PartitionError
from partitioner.plan.predict import stage_inflight
from partitioner.tracing.trace import trace
from partitioner.zoo import gpt2

__all__ = ["TARGETS", "main"]

_GIB = 2**30
# name -> (limit, unit): what this benchmark promises on a 2-core machine.
TARGETS = {"partition_call_s": (30.0, "s"), "peak_rss_gib": (4.0, "GiB"), "partition_step_s": (1.0, "s")}
_QUICK = ["--n-layer", "2", "--n-embd", "256", "--n-head", "4", "--n-positions", "256", "--vocab", "1024",
          "--seq", "256", "--devices", "4", "--microbatches", "4", "--sweep", "2,4,8"]
_RTOL = 1e-9


def _rss_gib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / _GIB if sys.platform == "darwin" else peak * 1024 / _GIB


def _cut(g: Any, units: list[Any], cluster: Cluster, held: tuple[int, ...], numel: dict[str, int],
         sbpp: float) -> dict[str, Any]:
    """The partition step of ``partition()`` after ``build_graph``: units, Problem, exact, refine."""
    t0 = time.perf_counter()
    problem = to_problem(g, units, cluster, inflight=held, param_numel=numel, state_bytes_per_param=sbpp)
    t1 = time.perf_counter()
    out: dict[str, Any] = {"units": len(units), "to_problem_s": t1 - t0, "lower_bound_s": alg.lower_bound(problem)}
    try:
        part = alg.exact(problem)
    except InfeasibleMemoryError as e:
        out.update(exact_s=time.perf_counter() - t1, refine_s=0.0, fits=False, error=str(e),
                   needed_gib=[x / _GIB for x in e.needed],
                   closest_max_fraction=max(n / a for n, a in zip(e.needed, e.available)))
        return out
    t2 = time.perf_counter()
    better = alg.refine(problem, part)
    t3 = time.perf_counter()
    ev, evr = alg.evaluate(problem, part), alg.evaluate(problem, better)
    if evr.bottleneck < ev.bottleneck:  # what partition() keeps
        part, ev = better, evr
    state = [0.0] * problem.p
    act = [0.0] * problem.p
    for i, s in enumerate(part.assignment):
        state[s] += problem.state_bytes[i]
        act[s] += problem.act_bytes[i]
    out.update(
        exact_s=t2 - t1, refine_s=t3 - t2, fits=ev.feasible, method=part.method,
        bottleneck_s=ev.bottleneck, bottleneck_stage=ev.bottleneck_stage,
        units_per_stage=[len(x) for x in part.stage_units(problem.p)],
        memory_gib=[m / _GIB for m in ev.memory],
        state_gib=[x / _GIB for x in state],
        activation_gib=[held[s] * act[s] / _GIB for s in range(problem.p)],
        capacity_gib=[c / _GIB for c in problem.capacity],
        max_memory_fraction=max(m / c for m, c in zip(ev.memory, problem.capacity)),
        bytes_cut=float(sum(ev.boundary_bytes)),
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpt2_size_args(ap, n_layer=96, n_embd=12288, n_head=96, n_positions=2048, vocab=50257, seq=2048,
                   seq_help="tokens per sequence")
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    ap.add_argument("--devices", type=int, default=64, help="one pipeline stage per device")
    ap.add_argument("--device", default="A100-80GB", help="device preset (e.g. A100-80GB, H100-80GB)")
    ap.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "zbh1"))
    ap.add_argument("--microbatches", type=int, default=8, help="m, micro-batches per optimizer step")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--state-bytes-per-param", type=float, default=16.0)
    ap.add_argument("--granularity", default="node,module",
                    help="comma-separated; the first is also used for the end-to-end partition() call")
    ap.add_argument("--sweep", type=int_list, default=[8, 16, 24, 32, 64],
                    help="micro-batch counts to re-cut for (first granularity); empty to skip")
    ap.add_argument("--quick", action="store_true", help="shorthand for a 2-layer toy: " + " ".join(_QUICK))
    ap.add_argument("--out", default="benchmarks/results/plan_scale.json")
    cli = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(cli)
    if args.quick:  # the toy's values, then anything given explicitly on the command line wins
        args = ap.parse_args(_QUICK + cli)
    grans = [x.strip() for x in args.granularity.split(",") if x.strip()]
    if not grans or any(x not in ("node", "module") for x in grans):
        ap.error("--granularity takes node and/or module")
    if args.devices < 1 or args.microbatches < 1:
        ap.error("need --devices >= 1 and --microbatches >= 1")
    DeviceSpec.preset(args.device)  # fail early on a typo
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    console = Console(width=None if sys.stdout.isatty() else 170)
    p, m = args.devices, args.microbatches
    cluster = Cluster.uniform(p, args.device)
    times: dict[str, float] = {}
    rss: dict[str, float] = {}

    t_start = time.perf_counter()
    model, (ids,) = gpt2(
        n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab_size=args.vocab,
        n_positions=args.n_positions, batch=args.micro_batch, seq=args.seq, device="meta",
    )
    model = model.to(dtype)
    n_params = sum(x.numel() for x in model.parameters())
    times["build_s"] = time.perf_counter() - t_start
    t0 = time.perf_counter()
    traced = trace(model, (ids,))
    times["trace_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    costs = cost_graph(traced)
    times["cost_s"] = time.perf_counter() - t0
    rss["after_cost_gib"] = _rss_gib()
    numel = {n: x.numel() for n, x in traced.gm.named_parameters(remove_duplicate=False)}

    t0 = time.perf_counter()
    g = build_graph(traced.gm, costs, traced.module_path)
    times["build_graph_s"] = time.perf_counter() - t0
    held = stage_inflight(args.schedule, p, m)
    cuts: dict[str, dict[str, Any]] = {}
    for gran in grans:
        t0 = time.perf_counter()
        units = group_units(g, gran)
        group_s = time.perf_counter() - t0
        if len(units) < p:
            cuts[gran] = {"units": len(units), "error": f"{len(units)} units cannot fill {p} stages"}
            continue
        r = _cut(g, units, cluster, held, numel, args.state_bytes_per_param)
        r["group_units_s"] = group_s
        r["build_graph_s"] = times["build_graph_s"]
        r["partition_step_s"] = times["build_graph_s"] + group_s + r["to_problem_s"] + r["exact_s"] + r["refine_s"]
        cuts[gran] = r
    rss["after_partition_step_gib"] = _rss_gib()

    # What the memory model says per token: one micro-batch's activations, and the state, in total.
    units0 = group_units(g, "node")
    whole = to_problem(g, units0, Cluster.uniform(1, args.device), inflight=(1,), param_numel=numel,
                       state_bytes_per_param=args.state_bytes_per_param)
    memory_model = {
        "state_gib_total": sum(whole.state_bytes) / _GIB,
        "state_gib_per_device_if_even": sum(whole.state_bytes) / p / _GIB,
        "activation_gib_per_microbatch_whole_model": sum(whole.act_bytes) / _GIB,
        "capacity_gib_per_device": cluster.devices[0].memory / _GIB,
        "inflight_per_stage": list(held),
    }

    sweep: list[dict[str, Any]] = []
    for mm in args.sweep:
        r = _cut(g, group_units(g, grans[0]), cluster, stage_inflight(args.schedule, p, mm), numel,
                 args.state_bytes_per_param)
        sweep.append({"microbatches": mm, "ideal_bubble": (p - 1) / (mm + p - 1),
                      **{k: r[k] for k in ("fits", "bottleneck_s", "max_memory_fraction", "closest_max_fraction",
                                           "exact_s") if k in r}})

    # The user's view: one call, trace to Plan.
    plan = None
    t0 = time.perf_counter()
    try:
        plan = partition(
            model, (ids,), p, cluster=cluster, microbatches=m, schedule=args.schedule,
            granularity=grans[0], state_bytes_per_param=args.state_bytes_per_param,
        )
        call_error = None
    except PartitionError as e:  # no plan fits memory, or (a library bug) the cut cannot be split
        call_error = f"{type(e).__name__}: {e}"
    times["partition_call_s"] = time.perf_counter() - t0
    rss["peak_gib"] = _rss_gib()
    times["script_s"] = time.perf_counter() - t_start
    first = cuts.get(grans[0], {})
    if plan is not None and "bottleneck_s" in first and not math.isclose(
        plan.bottleneck, first["bottleneck_s"], rel_tol=_RTOL
    ):
        raise AssertionError(
            f"partition() found bottleneck {plan.bottleneck!r} but the timed steps found {first['bottleneck_s']!r}: "
            "this script no longer runs the steps partition() runs"
        )

    # -- report ------------------------------------------------------------------------------
    title = (
        f"GPT-2 {args.n_layer} layers, d {args.n_embd}, {args.n_head} heads, vocab {args.vocab} "
        f"({n_params / 1e9:.1f}B params, {args.dtype}), micro-batch {args.micro_batch} x {args.seq} tokens, "
        f"{p} x {args.device}, {args.schedule}, m = {m}"
    )
    if plan is not None:
        console.print(str(plan), end="")
    else:
        console.print(f"partition() found no plan: {call_error}")
    tt = Table(title=f"plan_scale: {title}", title_justify="left")
    for col in ("step", "time", "target"):
        tt.add_column(col, justify="left" if col == "step" else "right")
    tt.add_row("build the model on meta (first call imports transformers)", f"{times['build_s']:.2f} s", "")
    tt.add_row(f"trace ({traced.method}, {g.number_of_nodes()} compute nodes)", f"{times['trace_s']:.2f} s", "")
    tt.add_row(f"cost ({len(costs)} nodes)", f"{times['cost_s']:.2f} s", "")
    for gran, r in cuts.items():
        tt.add_row(f"partition step, granularity={gran} (table below)",
                   f"{r['partition_step_s']:.3f} s" if "partition_step_s" in r else r.get("error", ""),
                   f"< {TARGETS['partition_step_s'][0]:g} s")
    tt.add_row(f"partition() end to end, granularity={grans[0]} (trace, cost, cut, split, plan)",
               f"{times['partition_call_s']:.2f} s", f"< {TARGETS['partition_call_s'][0]:g} s")
    tt.add_row("whole script (all of the above and the sweep)", f"{times['script_s']:.2f} s", "")
    tt.add_row("peak RSS (ru_maxrss)", f"{rss['peak_gib']:.2f} GiB", f"< {TARGETS['peak_rss_gib'][0]:g} GiB")
    console.print(tt)

    st = Table(title=f"partition step (what partition() runs after cost), {p} stages, m = {m}", title_justify="left")
    for col in ("granularity", "units", "build_graph", "group_units", "to_problem", "exact", "refine", "total"):
        st.add_column(col, justify="left" if col == "granularity" else "right")
    rt = Table(title="the cuts: bottleneck per micro-batch; memory per stage as the Problem counts it (a tied "
                     "parameter charged on every layer that holds it)", title_justify="left")
    for col in ("granularity", "plan", "fits", "bottleneck", "lower bound", "ratio", "memory per stage",
                "stage 0: state + act", "last: state + act"):
        rt.add_column(col, justify="left" if col in ("granularity", "plan") else "right")
    for gran, r in cuts.items():
        if "to_problem_s" not in r:
            rt.add_row(gran, r.get("error", ""), *[""] * 7)
            continue
        st.add_row(gran, str(r["units"]), *(f"{r[k] * 1e3:.0f} ms" for k in (
            "build_graph_s", "group_units_s", "to_problem_s", "exact_s", "refine_s", "partition_step_s")))
        if "bottleneck_s" not in r:
            rt.add_row(gran, "none fits", f"closest plan needs {r['closest_max_fraction']:.2f}x", *[""] * 6)
            continue
        mem = r["memory_gib"]
        rt.add_row(
            gran, r["method"], "yes" if r["fits"] else "NO", _ms(r["bottleneck_s"]), _ms(r["lower_bound_s"]),
            f"{r['bottleneck_s'] / r['lower_bound_s']:.3f}",
            f"{min(mem):.1f}..{max(mem):.1f} of {r['capacity_gib'][0]:.0f} GiB",
            f"{r['state_gib'][0]:.1f} + {r['activation_gib'][0]:.1f} GiB",
            f"{r['state_gib'][-1]:.1f} + {r['activation_gib'][-1]:.1f} GiB",
        )
    console.print(st)
    console.print(rt)
    if sweep:
        sw = Table(title=f"sweep: the same graph cut for other micro-batch counts (granularity={grans[0]}, "
                         f"{p} x {args.device}, {args.schedule})", title_justify="left")
        for col in ("m", "fits", "bottleneck", "max memory / capacity", "ideal bubble (p-1)/(m+p-1)", "exact"):
            sw.add_column(col, justify="right")
        for row in sweep:
            fits = row["fits"]
            sw.add_row(
                str(row["microbatches"]), "yes" if fits else "no", _ms(row.get("bottleneck_s")),
                f"{row['max_memory_fraction']:.2f}" if "max_memory_fraction" in row
                else f"closest plan needs {row['closest_max_fraction']:.2f}",
                f"{row['ideal_bubble']:.0%}", f"{row['exact_s'] * 1e3:.0f} ms",
            )
        console.print(sw)
    if plan is not None:
        worst = max(plan.stages, key=lambda st_: st_.memory / st_.capacity)
        console.print(
            f"plan (a tied parameter counted on every stage that holds it): memory per stage "
            f"{min(st_.memory for st_ in plan.stages) / _GIB:.1f}..{worst.memory / _GIB:.1f} GiB, "
            f"fullest stage {worst.index} at {worst.memory / worst.capacity:.0%} of {worst.capacity / _GIB:.0f} GiB",
            soft_wrap=True,
        )
    mmod = memory_model
    console.print(
        f"memory model: training state {mmod['state_gib_total']:.0f} GiB in all "
        f"({mmod['state_gib_per_device_if_even']:.1f} GiB per device if spread evenly); one micro-batch's "
        f"saved activations of the whole model {mmod['activation_gib_per_microbatch_whole_model']:.1f} GiB; "
        f"{mmod['capacity_gib_per_device']:.0f} GiB per device; {args.schedule} holds "
        f"{held[0]}..{held[-1]} micro-batches per stage (first..last)",
        soft_wrap=True,
    )

    targets = {
        "partition_call_s": times["partition_call_s"],
        "peak_rss_gib": rss["peak_gib"],
        **{f"partition_step_s[{g_}]": r["partition_step_s"] for g_, r in cuts.items() if "partition_step_s" in r},
    }
    result = {
        "benchmark": "plan_scale",
        "command": shlex.join(["python", "benchmarks/plan_scale.py", *cli]),
        "sys_argv": list(sys.argv),
        "config": {
            "model": "GPT-2 (Hugging Face GPT2LMHeadModel from a config, tied embeddings) on meta",
            "n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "n_positions": args.n_positions,
            "vocab": args.vocab, "seq": args.seq, "micro_batch": args.micro_batch, "dtype": args.dtype,
            "params": n_params, "devices": p, "device": args.device, "schedule": args.schedule, "microbatches": m,
            "state_bytes_per_param": args.state_bytes_per_param, "granularity": grans, "quick": args.quick,
        },
        "env": {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                "threads": torch.get_num_threads(), "machine": platform.machine(), "git": git_state()},
        "graph": {"trace_method": traced.method, "compute_nodes": g.number_of_nodes(), "costed_nodes": len(costs)},
        "times_s": times,
        "rss_gib": rss,
        "cuts": cuts,
        "memory_model": memory_model,
        "sweep": sweep,
        "partition_call": {
            "granularity": grans[0], "error": call_error,
            **({} if plan is None else {
                "method": plan.method, "bottleneck_s": plan.bottleneck, "lower_bound_s": plan.lower_bound,
                "predictions": [{"schedule": pr.schedule, "step_time_s": pr.step_time, "bubble": pr.bubble}
                                for pr in plan.predictions],
                "stages": [{"index": st.index, "modules": st.modules, "nodes": len(st.nodes), "params": st.params,
                            "memory_gib": st.memory / _GIB, "capacity_gib": st.capacity / _GIB,
                            "inflight": st.inflight, "time_s": st.time} for st in plan.stages],
            }),
        },
        "targets": {
            k: {"value": v, "limit": TARGETS[k.split("[")[0]][0], "unit": TARGETS[k.split("[")[0]][1],
                "met": v < TARGETS[k.split("[")[0]][0]}
            for k, v in targets.items()
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    console.print(f"wrote {out}")
    return 0 if plan is not None else 1


def _ms(x: float | None) -> str:
    return "" if x is None else f"{x * 1e3:.1f} ms"


if __name__ == "__main__":
    raise SystemExit(main())
