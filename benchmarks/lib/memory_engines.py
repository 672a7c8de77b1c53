"""``memory.py --engines``: each rank's peak memory under each data-parallel engine on one layout,
and (``--tp``) with tensor parallelism at the same pp, measured, taken apart, and set beside what the
planner predicts.

Legend: ``dp`` replicas, ``pp`` ranks per pipeline, ``m`` micro-batches per replica, ``b`` rows
per micro-batch, ``B`` the global batch.

One layout, 2 dp x 2 pp on 4 gloo processes (1F1B, a GPT-2 with a tied embedding, AdamW), run
four ways, each in 4 fresh processes (``runtime.transport.launch.spawn``) so that each peak is that
configuration's own:

* ``replicate``: ``DataParallel(size=2)``, whole stages on each replica (``zero='none'``);
* ``replicate + ZeRO-1``: ``shard_optimizer=True`` (``zero1``);
* ``fsdp``: ``engine='fsdp', reshard_after_forward=True`` (ZeRO-3, ``fsdp``);
* ``fsdp kept gathered``: ``reshard_after_forward=False``, priced as ``zero1``
  (``partitioner.plan.sharding`` says why);

and, with ``--tp`` (or ``--only``), tensor parallelism at the same pp on the same 4 processes:

* ``tp 2``: 1 dp x 2 pp x 2 tp (``TensorParallel(size=2)``, pipecut's GPT-2 plan: ``c_attn``
  packed by heads, ``c_fc`` by columns, both ``c_proj`` by rows; embeddings, norms and the LM head
  whole on both tp ranks), priced by ``LayoutSearch.plan(Option(..., tp=2))`` (one tp rank's
  stage); ``replicate`` is its tp 1 (``--tp`` runs the two).

Every rank plans the model on ``meta`` with ``partitioner.search.LayoutSearch`` (the plan it
trains is the one priced, so measurement and prediction share the cut), so the trainer
materialises its own stage and nothing else. Then, per rank: the page cache and malloc's free
lists are trimmed and the peak RSS is reset (``/proc/self/clear_refs``, ``5``) to the RSS at that
moment, the baseline; the trainer is built and takes ``--steps`` AdamW steps. Reported:

* ``peak before opt``: the same as each optimizer step starts (the forwards, backwards and
  gradient reductions' peak; VmHWM is reset as each step starts), the highest of the steps;
* ``peak``: the highest VmHWM (after building, and of each step) minus the baseline (every byte
  the engine's step costs the process: training state, activations, gathered weights,
  communication buffers, allocator slack);
* tensors counted exactly after the last step: the parameters held at rest (the local shards
  under FSDP), their gradients (sharded after FSDP's reduce-scatter), the optimizer's state; and,
  under FSDP, the whole gradient a stage accumulated before its one reduce-scatter (counted when the
  executor reports the stage's last backward); and ``stray``, the bytes of real parameters still
  reachable from ``plan.model`` or ``plan.traced.gm`` that are none of the trainer's tensors (0:
  FSDP's trainer puts the whole tensors it sharded on meta, ``release_whole_copies``);
* ``tensor peak``: the highest count of bytes live in PyTorch's CPU allocator during a step (the
  CPU analogue of ``torch.cuda.max_memory_allocated``), counted from the same baseline as the RSS
  peak by replaying the profiler's memory events (``benchmarks/lib/tensor_peak.py``), so blind to
  glibc: the training state live as the step starts (``tensors at step start``, also counted)
  plus what the step allocates above it, which is what the planner prices. At the highest step
  peak, the live blocks grouped by the ``record_function`` ranges they were allocated under
  (``tensor_live_at_peak`` in the JSON: ``[build]`` for what building left, ``[optimizer]``,
  ``pipecut <stage>F`` for forwards, ``FSDP::all_gather``...). The profiler perturbs glibc's heap
  and so the RSS: the full run counts tensors in a second spawn of the same configuration (its
  RSS peak kept as ``traced_peak_bytes``), ``--quick`` in the same processes (``tensor_pass``);
* ``predicted``: the planner's peak for the rank (its stage's ``StagePlan.memory`` from
  ``LayoutSearch.plan``: training state at ``state_per_param`` bytes per parameter plus the
  activations of the micro-batches in flight), and ``Layout.memory`` (the fullest rank's), which
  adds, under FSDP, the gathered units the search reserves on every rank
  (``predicted_gathered_bytes``, not in ``predicted``).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import re
import statistics
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from lib.common import proc_status as _status
from lib.tensor_peak import TensorTrace
from partitioner import Cluster
from partitioner.plan.layout import Option
from partitioner.search import LayoutSearch
from partitioner.zoo import gpt2
from runtime import DataParallel, Execution, Init, PipelineTrainer, TensorParallel
from runtime.parallel.clipping import local_shard
from runtime.parallel.fsdp import FSDPReplicas, _fsdp_params
from runtime.parallel.tensor import DERIVED_PLANS
from runtime.state.materialize import empty_weights

__all__ = ["Engine", "ENGINES", "DP_ENGINES", "TP_ENGINES", "QUICK", "FULL", "run_engine"]

DP, PP, SCHEDULE = 2, 2, "1f1b"


class Engine(NamedTuple):
    """How one configuration trains: ``dp x PP x tp`` = 4 processes."""

    data_parallel: dict[str, Any]  # DataParallel keywords
    cut_for: str  # the sharding the trainer's plan is cut for
    priced_as: str  # the sharding it is priced as
    dp: int = DP
    tp: int = 1


ENGINES: dict[str, Engine] = {
    "replicate": Engine({}, "none", "none"),
    "replicate + ZeRO-1": Engine({"shard_optimizer": True}, "zero1", "zero1"),
    "fsdp": Engine({"engine": "fsdp", "reshard_after_forward": True}, "fsdp", "fsdp"),
    "fsdp kept gathered": Engine({"engine": "fsdp", "reshard_after_forward": False}, "fsdp", "zero1"),
    "tp 2": Engine({}, "none", "none", dp=1, tp=2),
}
DP_ENGINES = ("replicate", "replicate + ZeRO-1", "fsdp", "fsdp kept gathered")  # --engines
TP_ENGINES = ("replicate", "tp 2")  # --engines --tp: tp 1 and tp 2 at the same pp
# --quick (the test suite's smoke run): three engines, three spawns of 4 fresh processes.
QUICK_ENGINES = ("replicate", "replicate + ZeRO-1", "fsdp")
# The model and batch: GPT-2 weights dominate a rank's memory (16.5 M parameters a stage, 264 MB
# of fp32 AdamW state whole) over the activations of a 1-row micro-batch.
# ``tensor_pass``: "separate" counts the tensors in a second spawn of 4 processes, "same" in the one
# measuring the RSS. The profiler's buffers, malloc'd between the tensor buffers of the heap as a
# step runs, keep glibc from returning freed buffers at the heap's top: with glibc's dynamic mmap
# threshold, FSDP's RSS peak rose from about 700 to 850-900 MiB when the same processes counted
# tensors (the same within 2 MiB with MALLOC_MMAP_THRESHOLD_=131072). --quick is a smoke run: one pass.
FULL = {"n_layer": 8, "n_embd": 512, "n_head": 8, "vocab": 8192, "seq": 64, "batch": 8, "micro_batch": 1,
        "steps": 3, "tensor_pass": "separate"}
QUICK = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab": 256, "seq": 16, "batch": 4, "micro_batch": 1,
         "steps": 2, "tensor_pass": "same"}


def _reset_peak() -> int:
    """Free what can be freed, reset VmHWM to the RSS now (Linux's ``clear_refs``), return it."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # glibc keeps freed blocks in its arenas: hand them back
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    _clear_peak()
    return _status()["VmRSS"]


def _clear_peak() -> None:
    """VmHWM := VmRSS (Linux 4.0+)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def _local_bytes(t: torch.Tensor) -> int:
    local = local_shard(t)
    return int(local.numel() * local.element_size())


def _unique(tensors: Iterator[torch.Tensor]) -> list[torch.Tensor]:
    return list({id(t): t for t in tensors}.values())


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # (B, T, V), (B, T)
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def run_engine(rank: int, world: int, cfg: dict[str, Any], name: str, traced: bool = True) -> dict[str, Any]:
    """One rank of configuration ``name``: plan on meta, reset the peak, build the trainer, step, count;
    with ``traced``, count the tensor bytes too (:class:`TensorTrace` over the build and the steps).

    One configuration per process: the trainer materialises its stage into the planned model, which
    a second trainer could not share (and whose tensors would stay in the second's figures).
    """
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # FSDP2 on a stage's outputs
    t0 = time.perf_counter()
    idle = _status()["VmRSS"]
    b, batch = cfg["micro_batch"], cfg["batch"]
    with empty_weights():
        model, _ = gpt2(n_layer=cfg["n_layer"], n_embd=cfg["n_embd"], n_head=cfg["n_head"], vocab_size=cfg["vocab"],
                        n_positions=cfg["seq"], batch=b, seq=cfg["seq"])
    gen = torch.Generator().manual_seed(7)  # the same global batch on every rank
    x = torch.randint(0, cfg["vocab"], (batch, cfg["seq"]), generator=gen)  # (B, T)
    y = torch.randint(0, cfg["vocab"], (batch, cfg["seq"]), generator=gen)
    found = LayoutSearch(model, (x[:b],), cluster=Cluster.uniform(world, "cpu"), global_batch=batch,
                         recompute=False)
    plan_s = time.perf_counter() - t0
    return {"rank": rank, **_measure(found, name, cfg, x, y, traced), "idle_rss": idle, "plan_s": plan_s,
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}  # as this process saw it


def _measure(found: LayoutSearch, name: str, cfg: dict[str, Any], x: torch.Tensor, y: torch.Tensor,
             traced: bool) -> dict[str, Any]:
    dp_kw, cut_zero, priced_zero, dp, tp = ENGINES[name]

    def option(zero: str) -> Option:
        return Option(dp=dp, pp=PP, schedule=SCHEDULE, microbatch_size=cfg["micro_batch"], zero=zero,
                      global_batch=cfg["batch"], tp=tp)

    layout = found.price(option(priced_zero))
    priced = found.plan(option(priced_zero)).stages
    plan = found.plan(option(cut_zero))
    base = _reset_peak()
    # The tensor count starts with the RSS baseline: both measure what building and stepping add.
    trace = TensorTrace() if traced else None

    def span(name: str) -> contextlib.AbstractContextManager[None]:
        return trace.span(name) if trace is not None else contextlib.nullcontext()

    with trace if trace is not None else contextlib.nullcontext():
        with span("build"):
            trainer = PipelineTrainer(
                plan, _lm_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                execution=Execution(schedule=SCHEDULE, transport="dist"), init=Init(seed=0),
                data_parallel=DataParallel(size=dp, **dp_kw),
                # The zoo's GPT-2 wraps the Hugging Face one (no config of its own): pipecut's plan, given.
                tensor_parallel=TensorParallel(size=tp, plan=DERIVED_PLANS["gpt2"] if tp > 1 else None),
            )
        built = _status()
        whole_grads = _count_whole_grads(trainer)
        before_opt: list[int] = []  # VmHWM as each optimizer step starts: the peak of forwards, backwards, reductions
        if trainer.optimizer is not None:
            opt_step = trainer.optimizer.step

            def timed_step(*a: Any, **kw: Any) -> Any:
                before_opt.append(_status()["VmHWM"])
                with span(f"optimizer {len(before_opt) - 1}"):
                    return opt_step(*a, **kw)

            trainer.optimizer.step = timed_step  # type: ignore[method-assign]
        local_x, local_y = trainer.local_batch(x, y)
        losses, step_s = [], []
        peaks = [built["VmHWM"]]
        for i in range(cfg["steps"]):
            dist.barrier()
            _clear_peak()  # each step's own peaks: before its optimizer step, and in all
            t = time.perf_counter()
            with span(f"step {i}"):
                losses.append(float(trainer.step(local_x, local_y)))
            step_s.append(time.perf_counter() - t)
            peaks.append(_status()["VmHWM"])
        after = _status()
    tensors = _tensor_figures(trace) if trace is not None else {}
    params = _unique(p for _, p in trainer.named_parameters())
    opt = trainer.optimizer
    state = [v for s in (opt.state.values() if opt is not None else ()) for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]  # Adam's moments (not its scalar step counts)
    stage = sorted(trainer.stages)
    # Parameters still reachable from the planned model that are none of the trainer's tensors: what a
    # rank keeps beside its stage (under FSDP, the whole tensors materialised before sharding, say).
    stray = {q.untyped_storage().data_ptr(): q.untyped_storage().nbytes() for q in _stray(plan, trainer)}
    res = {
        "dp_rank": trainer.mesh.dp_rank, "pp_rank": trainer.mesh.pp_rank, "tp_rank": trainer.mesh.tp_rank,
        "stages": stage,
        "rss": {"baseline": base, "after_build": built["VmRSS"], "after_steps": after["VmRSS"], "peak": max(peaks)},
        "peak_bytes": max(peaks) - base,
        "after_build_bytes": built["VmRSS"] - base,
        "peak_before_optimizer_bytes": max(before_opt, default=base) - base,
        "param_bytes": sum(_local_bytes(p) for p in params),
        "param_numel_whole": sum(p.numel() for p in params),
        "grad_bytes": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer_bytes": sum(_local_bytes(v) for v in state),
        "stray_param_bytes": sum(stray.values()),
        "whole_grad_bytes_before_reduce": max(whole_grads, default=None),
        **tensors,
        "predicted_bytes": sum(priced[s].memory for s in stage),
        "predicted_state_bytes": sum(priced[s].state_bytes for s in stage),
        "predicted_act_bytes": sum(priced[s].memory - priced[s].state_bytes for s in stage),
        "predicted_fullest_bytes": layout.memory,
        # FSDP's gathered units (two of the largest block and the parameters outside the blocks), which
        # the search reserves on every rank: in Layout.memory (the fullest rank's), not in StagePlan.memory.
        "predicted_gathered_bytes": layout.memory - max(st.memory for st in priced),
        "cut": [st.modules for st in plan.stages], "priced_cut": [st.modules for st in priced],
        "losses": losses, "step_s": step_s,
    }
    return res


def _tensor_figures(trace: TensorTrace) -> dict[str, Any]:
    """The tensor bytes of the build and each step (from the baseline), and what is live at the highest step peak."""
    (build,) = trace.spans("build")
    opt = {sp.name.split()[1]: sp for sp in trace.spans("optimizer ")}
    steps = []
    for sp in trace.spans("step "):
        o = opt.get(sp.name.split()[1])
        before = trace.peak_between(sp.start_ns, o.start_ns)[0] if o is not None else sp.peak
        steps.append({"start": sp.start, "peak": sp.peak, "peak_before_optimizer": before, "end": sp.end,
                      "peak_ns": sp.peak_ns})
    top = max(steps, key=lambda st: st["peak"])
    return {
        "tensor_peak_bytes": top["peak"],  # the highest of the steps
        "tensor_live_at_step_start_bytes": top["start"],  # of that step: the training state, and what else stayed
        "tensor_peak_before_optimizer_bytes": max(st["peak_before_optimizer"] for st in steps),
        "tensor_build_peak_bytes": build.peak, "tensor_after_build_bytes": build.end,
        "tensor_steps": [{k: v for k, v in st.items() if k != "peak_ns"} for st in steps],
        "tensor_live_at_peak": _group(trace.live_at(top["peak_ns"])),
        "tensor_allocations": trace.allocations,
        # Allocations at an address still live: its block freed by a thread the profiler does not see.
        "tensor_reused_addresses": trace.reused,
    }


_SPAN_OP = re.compile(r"^pipecut\.span::(\w+)( \d+)?$")
_STEP_OP = "pipecut.span::step "
_PIPECUT_OP = re.compile(r"^(pipecut \d+[A-Z])\d+$")


def _group(live: list[Any], top: int = 25) -> list[dict[str, Any]]:
    """Live blocks grouped by the ranges they were allocated under, largest groups first (``top`` of them).

    Not gloo's: a ``gloo:recv`` range runs from the receive's start to its wait, and the profiler
    nests whatever ran meanwhile in it.
    """
    groups: dict[tuple[str, ...], list[int]] = {}
    for a in live:
        # [build], [optimizer]; the executor's "pipecut <stage><F|B|W><mb>" without the micro-batch
        ops = tuple(_PIPECUT_OP.sub(r"\1", _SPAN_OP.sub(r"[\1]", op)) for op in a.ops
                    if not op.startswith((_STEP_OP, "gloo:")))
        g = groups.setdefault(ops, [0, 0])
        g[0] += a.nbytes
        g[1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return [{"bytes": b, "count": n, "ops": " > ".join(ops)} for ops, (b, n) in rows[:top]]


def _stray(plan: Any, trainer: PipelineTrainer) -> list[torch.Tensor]:
    """Every real parameter of the planned model and its traced graph that is none of the trainer's
    tensors (nor shares their storage), and any such tensor left in a stage's ``pipecut_fused_params``
    (weight-gradient fusion's list, made before FSDP sharded the stage)."""
    mine = {local_shard(p).untyped_storage().data_ptr() for _, p in trainer.named_parameters()}

    def stray(q: torch.Tensor | None) -> bool:
        return (q is not None and not q.is_meta and not hasattr(q, "to_local")
                and q.untyped_storage().data_ptr() not in mine)

    held = [q for root in (plan.model, plan.traced.gm) for module in root.modules()
            for q in module._parameters.values()]
    held += [q for st in trainer.stages.values() for q in getattr(st.module, "pipecut_fused_params", ())]
    return [q for q in held if stray(q)]


def _count_whole_grads(trainer: PipelineTrainer) -> list[int]:
    """Under FSDP, a list that fills with each stage's whole gradient bytes (accumulated over the
    step's micro-batches) just before its reduce-scatter; empty otherwise."""
    replicas = trainer._replicas
    if not isinstance(replicas, FSDPReplicas):
        return []
    seen: list[int] = []
    done = replicas.averager.stage_done

    def counted(s: int) -> None:
        module = replicas.modules.get(s)
        if module is not None:
            grads = [getattr(fp, "_unsharded_param", None) for fp in _fsdp_params(module)]
            seen.append(sum(_local_bytes(g.grad) for g in grads if g is not None and g.grad is not None))
        done(s)

    replicas.averager.stage_done = counted  # type: ignore[method-assign]
    return seen


# -- the run and its report (in the launching process) ----------------------------------------------

# Fresh interpreters, as torchrun starts ranks: glibc reads MALLOC_MMAP_THRESHOLD_ as a process starts
# (a rank forked from a fork server would have the server's), and each baseline is a whole process's.
_START = "spawn"


def run_all(cfg: dict[str, Any], *, timeout: float, names: Sequence[str] = tuple(ENGINES)) -> dict[str, Any]:
    """The configurations ``names`` of :data:`ENGINES` on ``dp * PP * tp`` (4) fresh processes each; the summary."""
    from runtime.transport.launch import spawn

    phases: dict[str, float] = {}
    ranks: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        t = time.perf_counter()
        world = ENGINES[name].dp * PP * ENGINES[name].tp
        if cfg["tensor_pass"] == "separate":
            rows = spawn(run_engine, world, cfg, name, False, timeout=timeout, threads=1, start_method=_START)
            traced = spawn(run_engine, world, cfg, name, True, timeout=timeout, threads=1, start_method=_START)
            for r, tr in zip(rows, traced):
                assert r["stages"] == tr["stages"], (name, r["stages"], tr["stages"])
                r.update({k: v for k, v in tr.items() if k.startswith("tensor_")}, traced_peak_bytes=tr["peak_bytes"],
                         traced_step_s=tr["step_s"])
        else:
            rows = spawn(run_engine, world, cfg, name, True, timeout=timeout, threads=1, start_method=_START)
        ranks[name] = rows
        phases[name] = time.perf_counter() - t
    return {"config": {**cfg, "dp": DP, "pp": PP, "schedule": SCHEDULE, "optimizer": "AdamW(lr=1e-4)",
                       "engines": {k: {"data_parallel": v.data_parallel, "plan_cut_for": v.cut_for,
                                       "priced_as": v.priced_as, "dp": v.dp, "pp": PP, "tp": v.tp}
                                   for k, v in ENGINES.items() if k in names}},
            "ranks": ranks, "summary": _summary(ranks), "phases_s": phases}


def _summary(ranks: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    base = ranks.get("replicate")
    out: dict[str, Any] = {}
    for name, rows in ranks.items():
        peak = max(r["peak_bytes"] for r in rows)
        pred = max(r["predicted_bytes"] for r in rows)
        tensor = max(r["tensor_peak_bytes"] for r in rows)
        out[name] = {
            "max_peak_bytes": peak, "max_predicted_bytes": pred, "measured_over_predicted": peak / pred,
            "per_rank_measured_over_predicted": [r["peak_bytes"] / r["predicted_bytes"] for r in rows],
            "max_tensor_peak_bytes": tensor, "tensor_peak_over_predicted": tensor / pred,
            "max_predicted_with_gathered_bytes": max(r["predicted_bytes"] + r["predicted_gathered_bytes"]
                                                     for r in rows),
            "per_rank_tensor_peak_over_predicted": [r["tensor_peak_bytes"] / r["predicted_bytes"] for r in rows],
            # A step ends on every rank at about the same time: the slowest rank's, the median of the steps.
            "median_step_s": statistics.median(max(st) for st in zip(*(r["step_s"] for r in rows))),
            "held_bytes_per_rank": [r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"] for r in rows],
        }
        if base:
            out[name]["max_peak_vs_replicate"] = peak / max(r["peak_bytes"] for r in base)
            # Against replicate's rank holding the same stages (tp 2 places them on other ranks).
            same = {tuple(b["stages"]): b for b in base}
            out[name]["param_bytes_vs_replicate"] = [r["param_bytes"] / same[tuple(r["stages"])]["param_bytes"]
                                                     for r in rows]
    return out


def print_table(res: dict[str, Any]) -> None:
    """The rich table: per engine and rank, the peak, the prediction and what the tensors hold."""
    from rich.console import Console
    from rich.table import Table

    def mib(x: float | None) -> str:
        return "-" if x is None else f"{x / 2**20:.1f}"

    cfg = res["config"]
    table = Table(title=(f"Peak memory per rank, dp x {cfg['pp']} pp x tp (layout) {cfg['schedule']} on 4 gloo "
                         "processes: "
                         f"GPT-2 {cfg['n_layer']} layers x {cfg['n_embd']}, vocab {cfg['vocab']}, seq {cfg['seq']}, "
                         f"batch {cfg['batch']} in micro-batches of {cfg['micro_batch']}, {cfg['optimizer']}, "
                         f"{cfg['steps']} steps (MiB)"
                         + (f", MALLOC_MMAP_THRESHOLD_={cfg['malloc_mmap_threshold']}"
                            if cfg.get("malloc_mmap_threshold") is not None else "")), title_justify="left")
    for col in ("engine", "layout", "rank", "stage", "peak", "peak before opt", "tensor peak", "tensors at step start",
                "predicted", "peak / pred", "tensor / pred", "params at rest", "grads after step",
                "whole grad in step", "optimizer", "stray (model)", "after build", "step s"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    for name, rows in res["ranks"].items():
        eng = cfg["engines"][name]
        for r in rows:
            table.add_row(name, f"{eng['dp']}x{eng['pp']}x{eng['tp']}", str(r["rank"]), ",".join(map(str, r["stages"])),
                          mib(r["peak_bytes"]),
                          mib(r["peak_before_optimizer_bytes"]), mib(r["tensor_peak_bytes"]),
                          mib(r["tensor_live_at_step_start_bytes"]),
                          mib(r["predicted_bytes"]), f"{r['peak_bytes'] / r['predicted_bytes']:.2f}",
                          f"{r['tensor_peak_bytes'] / r['predicted_bytes']:.2f}",
                          mib(r["param_bytes"]), mib(r["grad_bytes"]), mib(r["whole_grad_bytes_before_reduce"]),
                          mib(r["optimizer_bytes"]), mib(r["stray_param_bytes"]), mib(r["after_build_bytes"]),
                          f"{statistics.median(r['step_s']):.2f}")
        table.add_section()
    console = Console(width=200)
    console.print(table)
    for name, s in res["summary"].items():
        console.print(f"{name}: largest peak {mib(s['max_peak_bytes'])} MiB "
                      f"({s.get('max_peak_vs_replicate', 1.0):.2f} x replicate's), predicted "
                      f"{mib(s['max_predicted_bytes'])} MiB (measured / predicted {s['measured_over_predicted']:.2f}); "
                      f"largest tensor peak {mib(s['max_tensor_peak_bytes'])} MiB "
                      f"(tensor peak / predicted {s['tensor_peak_over_predicted']:.2f}"
                      + (f"; predicted with FSDP's gathered units {mib(s['max_predicted_with_gathered_bytes'])} MiB"
                         if s["max_predicted_with_gathered_bytes"] > s["max_predicted_bytes"] else "")
                      + "); "
                      f"step {s['median_step_s']:.2f} s (median, slowest rank)",
                      soft_wrap=True)
