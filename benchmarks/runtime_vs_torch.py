"""Benchmark: pipecut's runtime against torch.distributed.pipelining, one process, and itself.

Run (CPU, about a minute; 2 gloo processes with one thread each)::

    python benchmarks/runtime_vs_torch.py
    python benchmarks/runtime_vs_torch.py --steps 40 --warmup 5 --width 1024 --layers 8 \
        --batch 64 --microbatches 8 --out benchmarks/results/runtime_vs_torch.json

One model (``layers`` x Linear(width, width) with GELU between, the zoo's ``MLPChain``), one
split (stage 1 begins at ``layers.{layers // 2}``), one batch, ``m`` micro-batches, MSE loss,
no optimizer (``forward_backward`` + ``zero_grad``: the optimizer step is the same work in every
configuration and would only dilute the differences). Every configuration runs in the same two
processes, interleaved round by round (the order rotates each round), so a noisy machine slows
them alike:

* ``pipecut <schedule> dist``: ``PipelineTrainer(transport='dist')``, one stage per process,
  with its defaults (weight-gradient accumulation fusion on: ``runtime.execute.wgrad_fusion``);
* ``pipecut <schedule> dist unfused``: the same with ``fuse_wgrad=False`` (plain autograd, as
  torch and the single-process baselines use);
* ``torch <schedule>``: ``torch.distributed.pipelining`` ``ScheduleGPipe`` / ``Schedule1F1B``
  over ``PipelineStage``s built from the same two halves of the same model (parameter names
  kept), ``return_outputs=False``, and its default gradient scaling (every gradient divided by
  ``m`` after the last backward);
* ``torch <schedule> loss/m``: the same with ``scale_grads=False`` and each micro-batch's loss
  times ``1/m``, which is exactly pipecut's arithmetic (no pass over the gradients);
* ``single ...``: the whole model in rank 0, one thread, micro-batch accumulation (the same
  micro-batches) and full batch; rank 1 idles in a barrier;
* ``pipecut <schedule> local`` / ``sequential``: both stages in rank 0, one thread per stage vs
  one thread running the stages' actions one after another.

Each step starts after a barrier and lasts from the first rank's start to the last rank's end
(``perf_counter``, one clock for the whole machine), so it covers the whole pipeline and no
trailing barrier. Reported: the median over ``--steps`` rounds after ``--warmup``, the
quartiles, the ratios of medians (throughput ratio = other's median / pipecut's median; above 1
means pipecut is faster), and for pipecut vs torch also the median of the per-round ratios. Before timing, the
loss and every gradient of each pipelined configuration are checked against the single-process
model on the same batch.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lib.common import load_before, ratio_table, run_env, spread_ms, step_times, times_ms, write_result
from partitioner import partition
from partitioner.zoo import MLPChain
from runtime.options import Execution
from runtime.trainer import PipelineTrainer
from runtime.transport.launch import spawn

SCHEDULES = ("gpipe", "1f1b")
TOL = {"rtol": 1e-4, "atol": 1e-6}


class _Half(nn.Module):
    """Layers ``lo..hi-1`` of an ``MLPChain``, names kept (``layers.4.weight``), GELU as the chain has it."""

    def __init__(self, chain: MLPChain, lo: int, hi: int) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): chain.layers[i] for i in range(lo, hi)})
        self.lo, self.hi, self.n = lo, hi, len(chain.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.lo, self.hi):
            x = self.layers[str(i)](x)
            if i < self.n - 1:
                x = nn.functional.gelu(x)
        return x


def _data(cfg: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(cfg["batch"], cfg["width"], generator=gen)
    y = torch.randn(cfg["batch"], cfg["width"], generator=gen)
    return x, y


def _model(cfg: dict[str, Any]) -> MLPChain:
    torch.manual_seed(1234)
    return MLPChain((cfg["width"],) * (cfg["layers"] + 1))


def _pipecut(
    model: nn.Module, cfg: dict[str, Any], schedule: str, transport: str, *, fuse: bool = True
) -> PipelineTrainer:
    mb = cfg["batch"] // cfg["microbatches"]
    plan = partition(
        copy.deepcopy(model), (torch.randn(mb, cfg["width"]),), 2, microbatches=cfg["microbatches"],
        schedule=schedule, split_points=[f"layers.{cfg['layers'] // 2}"],
    )
    return PipelineTrainer(plan, nn.functional.mse_loss, None,
                           execution=Execution(schedule=schedule, transport=transport, fuse_wgrad=fuse))


def _torch_schedule(
    model: MLPChain, cfg: dict[str, Any], schedule: str, rank: int, *, scale_loss: bool
) -> tuple[nn.Module, Any]:
    """torch's schedule for this rank's half; ``scale_loss``: loss / m instead of grads / m."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    m = cfg["microbatches"]
    cut = cfg["layers"] // 2
    lo, hi = (0, cut) if rank == 0 else (cut, cfg["layers"])
    half = _Half(copy.deepcopy(model), lo, hi)
    stage = PipelineStage(half, rank, 2, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    if scale_loss:  # the same arithmetic as pipecut's: each micro-batch's loss times 1/m
        return half, cls(stage, m, loss_fn=functools.partial(_scaled_mse, 1.0 / m), scale_grads=False)
    return half, cls(stage, m, loss_fn=nn.functional.mse_loss)  # torch's default: grads / m at the end


def _scaled_mse(scale: float, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target) * scale


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    torch.set_num_threads(1)
    model = _model(cfg)
    x, y = _data(cfg)
    m = cfg["microbatches"]
    xs, ys = x.chunk(m), y.chunk(m)
    single = copy.deepcopy(model)

    def run_pipecut(tr: PipelineTrainer) -> torch.Tensor:
        tr.zero_grad()
        return tr.forward_backward(x, y)

    def run_torch(half: nn.Module, sched: Any, scale_loss: bool) -> torch.Tensor | None:
        half.zero_grad(set_to_none=True)
        if rank == 0:
            sched.step(x, return_outputs=False)
            return None
        losses: list[torch.Tensor] = []
        sched.step(target=y, losses=losses, return_outputs=False)
        total = torch.stack(losses).detach()
        return total.sum() if scale_loss else total.mean()

    def run_single_accum() -> torch.Tensor:
        single.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for xm, ym in zip(xs, ys):
            loss = nn.functional.mse_loss(single(xm), ym) / m
            loss.backward()
            total += loss.detach()
        return total

    def run_single_full() -> torch.Tensor:
        single.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(single(x), y)
        loss.backward()
        return loss.detach()

    # name -> (runs on both ranks?, step function, the parameters it trains on this rank)
    configs: dict[str, tuple[bool, Callable[[], torch.Tensor | None], Callable[[], Any]]] = {}
    for s in SCHEDULES:
        tr = _pipecut(model, cfg, s, "dist")
        configs[f"pipecut {s} dist"] = (True, functools.partial(run_pipecut, tr), tr.named_parameters)
        tr = _pipecut(model, cfg, s, "dist", fuse=False)
        configs[f"pipecut {s} dist unfused"] = (True, functools.partial(run_pipecut, tr), tr.named_parameters)
        for scale_loss, label in ((False, ""), (True, " loss/m")):
            half, sched = _torch_schedule(model, cfg, s, rank, scale_loss=scale_loss)
            run = functools.partial(run_torch, half, sched, scale_loss)
            configs[f"torch {s}{label}"] = (True, run, half.named_parameters)
    configs["single micro-batched"] = (False, run_single_accum, single.named_parameters)
    configs["single full-batch"] = (False, run_single_full, single.named_parameters)
    for s in SCHEDULES:
        for t in ("local", "sequential"):
            if rank == 0:  # rank 1 only waits in the barriers
                tr = _pipecut(model, cfg, s, t)
                configs[f"pipecut {s} {t}"] = (False, functools.partial(run_pipecut, tr), tr.named_parameters)
            else:
                configs[f"pipecut {s} {t}"] = (False, lambda: None, lambda: iter(()))

    checks = _check(rank, configs, single, run_single_full)
    names = [n for n in configs if not cfg["only"] or any(word in n for word in cfg["only"])]

    # Per configuration, per timed round: (start, end) on this rank, perf_counter seconds (one
    # clock for every process of the machine). A round starts at a barrier; a step lasts from the
    # first rank's start to the last rank's end, so no trailing barrier is timed.
    spans: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    n = len(names)
    for rnd in range(cfg["warmup"] + cfg["steps"]):
        for k in range(n):
            name = names[(rnd + k) % n]  # rotate the order: no configuration always runs first
            both, fn, _ = configs[name]
            dist.barrier()
            t0 = time.perf_counter()
            if both or rank == 0:
                fn()
            t1 = time.perf_counter()
            if rnd >= cfg["warmup"]:
                spans[name].append((t0, t1) if both or rank == 0 else (float("inf"), float("-inf")))
    return {"spans": spans, "checks": checks}


def _check(
    rank: int, configs: dict[str, tuple[bool, Callable[[], torch.Tensor | None], Callable[[], Any]]],
    single: nn.Module, run_single_full: Callable[[], torch.Tensor],
) -> dict[str, Any]:
    """Loss and every gradient of each configuration equal the single-process model's (same batch)."""
    want_loss = run_single_full()
    want = {n: p.grad.clone() for n, p in single.named_parameters() if p.grad is not None}
    out: dict[str, Any] = {}
    for name, (both, fn, params) in configs.items():
        if not both and rank != 0:
            continue
        loss = fn()
        worst = 0.0
        for pname, prm in params():
            assert prm.grad is not None, f"{name}: {pname} has no gradient"
            torch.testing.assert_close(prm.grad, want[pname], **TOL, msg=f"{name}: gradient of {pname} differs")
            worst = max(worst, (prm.grad - want[pname]).abs().max().item())
        if loss is not None:
            torch.testing.assert_close(loss, want_loss, **TOL, msg=f"{name}: loss differs")
        out[name] = {"max_abs_grad_diff": worst, "loss": None if loss is None else float(loss)}
    dist.barrier()
    return out


def _summary(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {name: spread_ms(ts) for name, ts in times.items()}


def _ratios(med: dict[str, float]) -> dict[str, float]:
    r: dict[str, float] = {}
    for s in SCHEDULES:
        pairs = [
            ("pipecut throughput / torch throughput", f"torch {s}", f"pipecut {s} dist"),
            ("pipecut throughput / torch (loss/m) throughput", f"torch {s} loss/m", f"pipecut {s} dist"),
            ("pipecut unfused throughput / torch throughput", f"torch {s}", f"pipecut {s} dist unfused"),
            ("speedup of weight-gradient fusion", f"pipecut {s} dist unfused", f"pipecut {s} dist"),
            ("speedup of pipecut dist over single micro-batched", "single micro-batched", f"pipecut {s} dist"),
            ("speedup of pipecut dist unfused over single micro-batched", "single micro-batched",
             f"pipecut {s} dist unfused"),
            ("speedup of pipecut dist over single full-batch", "single full-batch", f"pipecut {s} dist"),
            ("speedup of torch over single micro-batched", "single micro-batched", f"torch {s}"),
            ("speedup of local (threads) over sequential", f"pipecut {s} sequential", f"pipecut {s} local"),
            ("speedup of local (threads) over single micro-batched", "single micro-batched", f"pipecut {s} local"),
        ]
        for what, slow, fast in pairs:
            if slow in med and fast in med:  # both measured (--only may leave some out)
                r[f"{s}: {what}"] = med[slow] / med[fast]
    return r


def _paired(times: dict[str, list[float]]) -> dict[str, float]:
    """Median over rounds of torch's step time / pipecut's in the same round (drift cancels)."""
    out = {}
    for s in SCHEDULES:
        for other in (f"torch {s}", f"torch {s} loss/m"):
            if other in times and f"pipecut {s} dist" in times:
                r = [a / b for a, b in zip(times[other], times[f"pipecut {s} dist"])]
                out[f"{s}: {other} / pipecut, same round"] = statistics.median(r)
    return out


def _print(cfg: dict[str, Any], summary: dict[str, dict[str, float]], ratios: dict[str, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    mb = cfg["batch"] // cfg["microbatches"]
    title = (f"{cfg['layers']} x Linear({cfg['width']}, {cfg['width']}) + GELU, batch {cfg['batch']} = "
             f"{cfg['microbatches']} micro-batches of {mb}, split at layers.{cfg['layers'] // 2}; "
             f"median of {cfg['steps']} steps after {cfg['warmup']} warm-up")
    table = Table(title=title, title_justify="left")
    for col in ("configuration", "median ms", "p25 ms", "p75 ms", "min ms"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for name, row in summary.items():
        table.add_row(name, *(f"{row[k]:.2f}" for k in ("median_ms", "p25_ms", "p75_ms", "min_ms")))
    rt = ratio_table("ratios of medians (> 1: the first named is faster)", ratios)
    console = Console()
    console.print(table)
    console.print(rt)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per configuration (median over these)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed rounds first")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    ap.add_argument("--only", nargs="*", default=[],
                    help="time only configurations whose name contains one of these words (e.g. dist torch)")
    ap.add_argument("--out", default="benchmarks/results/runtime_vs_torch.json")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.batch % args.microbatches or args.layers < 2:
        ap.error("need --steps >= 1, --layers >= 2, and --batch divisible by --microbatches")
    cfg = {k: getattr(args, k) for k in ("steps", "warmup", "width", "layers", "batch", "microbatches", "only")}

    t0 = time.time()
    load = load_before("the two pipeline processes, which slows the pipelined configurations most")
    ranks = spawn(_worker, 2, cfg, timeout=args.timeout, threads=1)
    times = step_times([r["spans"] for r in ranks])
    summary = _summary(times)
    ratios = _ratios({k: v["median_ms"] for k, v in summary.items()})
    paired = _paired(times)
    _print(cfg, summary, {**ratios, **paired})
    result = {
        "benchmark": "runtime_vs_torch",
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "config": {**cfg, "micro_batch_size": cfg["batch"] // cfg["microbatches"],
                   "split_at": f"layers.{cfg['layers'] // 2}",
                   "processes": 2, "threads_per_process": 1, "loss": "mse", "optimizer": None},
        "env": run_env(load, t0),
        "results": summary,
        "ratios": ratios,
        "paired_ratios": paired,
        "checks": {f"rank {r}": res["checks"] for r, res in enumerate(ranks)},
        "times_ms": times_ms(times),
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
