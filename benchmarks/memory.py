"""Benchmark: train a model several times larger than any rank may hold, each rank loading only its stages.

Run (CPU, 8 gloo ranks of one thread each; about 5 minutes on a 2-core machine; needs about 16 GiB
of free memory and 7 GB of disk; writes ``benchmarks/results/memory.json``)::

    python benchmarks/memory.py
    python benchmarks/memory.py --ranks 8 --layers 96 --width 4096 --dtype float32 --microbatches 16 \
        --rows 1 --out benchmarks/results/memory.json
    python benchmarks/memory.py --ranks 2 --layers 4 --shard-mib 64 --out /tmp/memory.json  # a minute
    python benchmarks/memory.py --engines   # the engines (below): ~5 minutes, results/memory_fsdp.json
    python benchmarks/memory.py --engines --quick --out /tmp/memory_fsdp.json   # a tiny GPT-2, 2-3 minutes
    python benchmarks/memory.py --engines --only "fsdp;replicate" --mmap-threshold 131072 --out /tmp/m.json
    python benchmarks/memory.py --engines --tp   # tp 1 against tp 2 at pp 2: 6 minutes at load 30, memory_tp.json
    python benchmarks/memory.py --engines --tp --quick --out /tmp/memory_tp.json   # a tiny GPT-2, about a minute

``--engines`` measures something else, each rank's peak under each data-parallel engine on one
layout (2 dp x 2 pp, GPT-2, AdamW: replicated, ZeRO-1, FSDP2 resharding after forward and kept
gathered, and FSDP2 with the whole stage weights it leaves alive dropped) beside the planner's
prediction: ``benchmarks/lib/memory_engines.py`` says how. ``--tp`` runs tensor parallelism against it
at the same pp instead: ``replicate`` (2 dp x 2 pp, tp 1) and ``tp 2`` (1 dp x 2 pp x 2 tp), per rank
its peak, tensor peak, prediction and step time side by side. ``--only`` names the engines to run
(``;``-separated); ``--mmap-threshold`` fixes glibc's mmap threshold in the ranks
(``MALLOC_MMAP_THRESHOLD_``): the default dynamic one rises after large frees, so freed tensor
buffers stay in the heap and count in the RSS peak (the tensor peak is blind to it). The rest of
this docstring is about the default run.

The model is ``layers`` x ``Linear(width, width)`` (96 x 64 MiB = 6 GiB in fp32 by default), built
under ``runtime.empty_weights()`` (parameters on ``meta``) by the script and by every rank. In order,
each step in a fresh process (``runtime.transport.launch.spawn``), so that each VmHWM is that step's own:

1. the checkpoint: sharded safetensors written layer group by layer group, values drawn per layer
   from ``--seed``, so the writer holds one shard at a time, never the model;
2. today's figure: one process builds the model for real and partitions it, as every rank did
   before ranks could materialise only their stages (measured; plus that rank's gradients);
3. the pipeline: ``--ranks`` processes each partition the meta model, build
   ``PipelineTrainer(plan, mse, SGD, transport='dist', weights=checkpoint)`` (which materialises
   its own stages and reads only their tensors), check the loaded values against the writer's
   checksums, and take one optimizer step (1F1B, ``--microbatches`` of ``--rows`` rows).

Per rank: the stages and parameter bytes it holds, the plan's estimate for its stages (training
state at ``state_bytes_per_param`` = 2 x the dtype's size, weights and gradients of SGD without
momentum, plus saved activations x micro-batches in flight), peak RSS (VmHWM of
``/proc/self/status``) after loading and after the step, the load time (the trainer's
construction: cut the stages, materialise them, read the checkpoint; the read alone as ``read``)
and the step time. An idle rank (torch imported, process group joined) holds about 0.25 GiB and
planning adds about 0.1 GiB: that is what the 0.5 GiB of the first target allows for. Targets,
checked (exit status 1 when missed):

* every rank's peak <= 1.2 x its stages' estimate + 0.5 GiB;
* the model's bytes >= 3 x the largest rank's peak.

Why 8 ranks and 6 GiB on this 2-core, 24 GiB machine. With SGD a rank holds its share of the
weights and as much again in gradients, so a rank's peak is about ``2 M / p + b`` (``M`` the
model's bytes, ``p`` ranks, ``b`` ~0.33 GiB for an idle rank that has planned); ``M >= 3 x peak``
needs ``p > 6`` (4 ranks can reach only ``M / peak < 2``). All ranks run at once, so their peaks
add up to ``2 M + p b``, which must stay under ~18 GiB beside other jobs: ``M <= 7.6 GiB`` at
``p = 8``. 96 layers (6 GiB, ~15 GiB in all) leave room, with ``M / peak`` about 3.3. Loading
adds a transient of its own: the checkpoint's pages the rank reads stay mapped (``safe_open``)
until loading ends, so the peak after loading is also about ``b + 2 x`` the rank's weights; the
table shows it, measured as the RSS dropped when the checkpoint closed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# This checkout's packages first (an editable install may point at another one), and lib/.
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from lib.common import git_state, load_before, run_env, write_result  # noqa: E402
from lib.common import proc_status as _status  # noqa: E402
from lib.memory_engines import DP_ENGINES, ENGINES, FULL, QUICK, QUICK_ENGINES, TP_ENGINES, print_table, run_all  # noqa: E402
from partitioner import partition  # noqa: E402
from partitioner.plan.plan import Plan  # noqa: E402
from runtime import Execution, Init, PipelineTrainer  # noqa: E402
from runtime.state.materialize import empty_weights  # noqa: E402
from runtime.state.weights import LoadReport  # noqa: E402
from runtime.transport.launch import spawn  # noqa: E402

__all__ = ["Config", "main", "run"]

_GIB = 2**30
_MIB = 2**20
_INDEX = "model.safetensors.index.json"
# The targets: a rank's peak <= _SLACK * estimate + _ALLOWANCE; model bytes >= _RATIO * largest peak.
_SLACK = 1.2
_ALLOWANCE = 0.5 * _GIB
_RATIO = 3.0
# The most the ranks may hold at once (their estimates plus an idle process each) before the
# script refuses to start them: the machine is shared, and running out of memory takes it down.
_IDLE_GUESS = 0.5 * _GIB
_MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"


@dataclasses.dataclass(frozen=True)
class Config:
    """What to run; passed to every spawned process."""

    ranks: int
    layers: int
    width: int
    dtype: str
    microbatches: int
    rows: int
    seed: int
    lr: float
    shard_bytes: int
    timeout: float
    checkpoint: str = ""
    sums: tuple[float, ...] = ()  # per checkpoint key, in key order: float64 sum of the writer's values

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)  # type: ignore[no-any-return]

    @property
    def layer_bytes(self) -> int:
        return (self.width * self.width + self.width) * self.torch_dtype.itemsize

    @property
    def model_bytes(self) -> int:
        return self.layers * self.layer_bytes

    @property
    def state_bytes_per_param(self) -> float:
        return 2.0 * self.torch_dtype.itemsize  # weights + gradients (SGD, no momentum)


# -- the model, its values and its plan ---------------------------------------------------------


def _build(cfg: Config) -> nn.Sequential:
    """``layers`` x Linear(width, width); no nonlinearity: the values keep their scale (see _layer)."""
    return nn.Sequential(*[nn.Linear(cfg.width, cfg.width, dtype=cfg.torch_dtype) for _ in range(cfg.layers)])


def _keys(cfg: Config) -> list[str]:
    return [f"{i}.{k}" for i in range(cfg.layers) for k in ("weight", "bias")]


def _layer(cfg: Config, i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s checkpoint values, from its own generator: any process can redraw one layer.

    Weights are uniform with variance ``1 / width``, so the activations keep their scale through
    the stack (the loss stays finite whatever the depth).
    """
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + i)
    a = math.sqrt(3.0 / cfg.width)
    w = torch.empty(cfg.width, cfg.width, dtype=cfg.torch_dtype).uniform_(-a, a, generator=gen)
    b = torch.empty(cfg.width, dtype=cfg.torch_dtype).uniform_(-a, a, generator=gen)
    return {f"{i}.weight": w, f"{i}.bias": b}


def _example(cfg: Config) -> torch.Tensor:
    return torch.zeros(cfg.rows, cfg.width, dtype=cfg.torch_dtype)  # (rows, width): one micro-batch


def _plan(model: nn.Module, cfg: Config) -> Plan:
    return partition(model, (_example(cfg),), cfg.ranks, microbatches=cfg.microbatches, schedule="1f1b",
                     state_bytes_per_param=cfg.state_bytes_per_param)


def _estimate(plan: Plan, stages: tuple[int, ...]) -> dict[str, Any]:
    """The plan's memory estimate for ``stages``: state + activations x micro-batches in flight."""
    sts = [plan.stages[s] for s in stages]
    return {
        "memory_bytes": sum(st.memory for st in sts),
        "state_bytes": sum(st.state_bytes for st in sts),
        "act_bytes_per_microbatch": sum(st.act_bytes for st in sts),
        "inflight": [st.inflight for st in sts],
        "modules": [st.modules for st in sts],
        "params": sum(st.params for st in sts),
    }


# -- measuring ------------------------------------------------------------------------------------


def _mem_available() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class _LoadReports(logging.Handler):
    """Keeps the LoadReport that ``runtime.state.weights`` logs: the trainer loads inside its constructor."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reports: list[LoadReport] = []

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        self.reports.extend(a for a in args if isinstance(a, LoadReport))


# -- the three steps, each in its own process ---------------------------------------------------


def _write_checkpoint(rank: int, world: int, cfg: Config, directory: str) -> dict[str, Any]:
    """Sharded safetensors of the model, one shard of layers in memory at a time.

    Not ``runtime.save_safetensors``: it takes every tensor in one mapping, i.e. the whole model
    in memory, which is what this benchmark must never need.
    """
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    per_shard = max(1, round(cfg.shard_bytes / cfg.layer_bytes))  # 1 GiB: 16 layers of 4096
    groups = [range(i, min(i + per_shard, cfg.layers)) for i in range(0, cfg.layers, per_shard)]
    names = [f"model-{j + 1:05d}-of-{len(groups):05d}.safetensors" for j in range(len(groups))]
    weight_map: dict[str, str] = {}
    sums: dict[str, float] = {}
    for name, group in zip(names, groups):
        shard: dict[str, torch.Tensor] = {}
        for i in group:
            shard.update(_layer(cfg, i))
        for key, t in shard.items():
            sums[key] = torch.sum(t, dtype=torch.float64).item()
            weight_map[key] = name
        save_file(shard, os.path.join(directory, name), metadata={"format": "pt"})
        del shard
    index = {"metadata": {"total_size": cfg.model_bytes}, "weight_map": weight_map}
    Path(directory, _INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return {"files": len(names), "bytes": cfg.model_bytes, "write_s": time.perf_counter() - t0,
            "peak_rss_bytes": _status()["VmHWM"], "sums": [sums[k] for k in _keys(cfg)]}


def _whole_model(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    """What a rank held before it could materialise only its stages: the real model, then the plan."""
    idle = _status()
    t0 = time.perf_counter()
    model = _build(cfg)
    built = _status()
    t1 = time.perf_counter()
    _plan(model, cfg)
    return {"idle": idle, "after_build": built, "after_partition": _status(),
            "build_s": t1 - t0, "partition_s": time.perf_counter() - t1}


def _train_rank(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    """One rank: plan the meta model, load its stages from the checkpoint, take one step."""
    idle = _status()
    t0 = time.perf_counter()
    with empty_weights():
        model = _build(cfg)
    plan = _plan(model, cfg)
    planned = _status()
    t1 = time.perf_counter()
    reports = _LoadReports()
    wlog = logging.getLogger("runtime.state.weights")
    wlog.addHandler(reports)
    wlog.setLevel(logging.INFO)
    trainer = PipelineTrainer(
        plan, nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=cfg.lr, momentum=0.0),
        execution=Execution(schedule="1f1b", transport="dist", timeout=cfg.timeout),
        init=Init(weights=cfg.checkpoint, seed=cfg.seed),
    )
    t2 = time.perf_counter()
    wlog.removeHandler(reports)
    loaded = _status()
    stages = tuple(sorted(trainer.stages))
    named = dict(trainer.named_parameters())
    held = sum(p.numel() * p.element_size() for p in named.values())
    # Nothing of other ranks' stages was allocated: the model's real tensors are exactly this rank's.
    real = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    want = dict(zip(_keys(cfg), cfg.sums))
    wrong = [n for n, p in named.items() if not math.isclose(torch.sum(p.detach(), dtype=torch.float64).item(),
                                                             want[n], rel_tol=1e-9, abs_tol=1e-6)]
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    n = cfg.microbatches * cfg.rows
    x = torch.randn(n, cfg.width, generator=gen).to(cfg.torch_dtype)  # (m * rows, width)
    y = torch.randn(n, cfg.width, generator=gen).to(cfg.torch_dtype)
    dist.barrier()  # the step is timed from a common start
    t3 = time.perf_counter()
    loss = trainer.step(x, y)
    t4 = time.perf_counter()
    stepped = _status()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in named.values() if p.grad is not None)
    report = reports.reports[0] if reports.reports else None
    return {
        "rank": rank, "stages": list(stages), "estimate": _estimate(plan, stages),
        "param_bytes": held, "real_param_bytes_in_model": real, "grad_bytes": grads,
        "loaded_values_wrong": wrong, "loss": loss.item(),
        "rss": {"idle": idle, "after_partition": planned, "after_load": loaded, "after_step": stepped},
        "times_s": {"partition": t1 - t0, "load": t2 - t1, "read": report.seconds if report else None,
                    "step": t4 - t3},
        "read": None if report is None else {"bytes": report.bytes_read, "tensors": len(report.names),
                                             "files": [os.path.basename(f) for f in report.files]},
    }


# -- the run ------------------------------------------------------------------------------------------


def run(cfg: Config, *, tmpdir: str | None = None, keep: bool = False) -> dict[str, Any]:
    """Write the checkpoint, measure the whole-model figure, train one step on ``cfg.ranks`` ranks.

    Raises:
        MemoryError: the machine has too little memory available for the ranks (nothing started).
    """
    t0 = time.perf_counter()
    with empty_weights():
        meta = _build(cfg)
    plan = _plan(meta, cfg)
    need = sum(st.memory for st in plan.stages) + cfg.ranks * _IDLE_GUESS
    have = _mem_available()
    if need > have:
        raise MemoryError(
            f"{cfg.ranks} ranks need about {need / _GIB:.1f} GiB (the plan's estimates + {_IDLE_GUESS / _GIB:.1f} "
            f"GiB per process) and {have / _GIB:.1f} GiB are available; try later, or fewer --layers"
        )
    directory = tempfile.mkdtemp(prefix="pipecut-memory-", dir=tmpdir)
    phases = {"plan_s": time.perf_counter() - t0}
    try:
        t = time.perf_counter()
        # Fresh interpreters, as torchrun starts ranks: each figure is a whole process's peak RSS (VmHWM).
        writer = spawn(_write_checkpoint, 1, cfg, directory, timeout=cfg.timeout, start_method="spawn")[0]
        phases["checkpoint_s"] = time.perf_counter() - t
        cfg = dataclasses.replace(cfg, checkpoint=directory, sums=tuple(writer.pop("sums")))
        if cfg.model_bytes + _IDLE_GUESS > _mem_available():
            raise MemoryError(f"building the whole model needs {cfg.model_bytes / _GIB:.1f} GiB; "
                              f"{_mem_available() / _GIB:.1f} GiB are available")
        t = time.perf_counter()
        whole = spawn(_whole_model, 1, cfg, timeout=cfg.timeout, start_method="spawn")[0]
        phases["whole_model_s"] = time.perf_counter() - t
        if need > _mem_available():
            raise MemoryError(f"{cfg.ranks} ranks need about {need / _GIB:.1f} GiB and "
                              f"{_mem_available() / _GIB:.1f} GiB are available")
        t = time.perf_counter()
        ranks = spawn(_train_rank, cfg.ranks, cfg, timeout=cfg.timeout, threads=1, start_method="spawn")
        phases["ranks_s"] = time.perf_counter() - t
    finally:
        if keep:
            print(f"checkpoint kept in {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)
    res = _summarise(cfg, plan, writer, whole, ranks, directory if keep else None)
    res["phases_s"] = phases
    return res


def _summarise(cfg: Config, plan: Plan, writer: dict[str, Any], whole: dict[str, Any],
               ranks: list[dict[str, Any]], kept: str | None) -> dict[str, Any]:
    for r in ranks:
        est = r["estimate"]["memory_bytes"]
        peak = r["rss"]["after_step"]["VmHWM"]
        r["peak_bytes"] = peak
        r["limit_bytes"] = _SLACK * est + _ALLOWANCE
        r["peak_over_limit"] = peak / r["limit_bytes"]
        r["peak_over_estimate"] = peak / est
        # Mapped checkpoint pages, unmapped when loading ended: the peak after loading minus the RSS then.
        r["load_transient_bytes"] = r["rss"]["after_load"]["VmHWM"] - r["rss"]["after_load"]["VmRSS"]
        # What this rank held before: the whole model built for real (measured in one process) plus
        # the gradients of its own stages (which the measurement, taking no step, does not allocate).
        r["whole_model_rank_bytes"] = whole["after_partition"]["VmHWM"] + r["param_bytes"]
    peaks = [r["peak_bytes"] for r in ranks]
    max_peak = max(peaks)
    idle = [r["rss"]["idle"]["VmRSS"] for r in ranks]
    checks = {
        "rank_peak_within_estimate": {
            "rule": f"peak <= {_SLACK} x estimate + {_ALLOWANCE / _GIB:g} GiB on every rank",
            "worst_ratio": max(r["peak_over_limit"] for r in ranks),
            "met": all(r["peak_over_limit"] <= 1.0 for r in ranks),
        },
        "model_over_largest_peak": {
            "rule": f"model bytes >= {_RATIO:g} x the largest rank's peak",
            "ratio": cfg.model_bytes / max_peak,
            "met": cfg.model_bytes / max_peak >= _RATIO,
        },
        "loaded_values_match": {"met": not any(r["loaded_values_wrong"] for r in ranks)},
        "only_own_stages_allocated": {"met": all(r["real_param_bytes_in_model"] == r["param_bytes"] for r in ranks)},
        "loss_finite": {"met": all(math.isfinite(r["loss"]) for r in ranks)},
    }
    whole_peak = whole["after_partition"]["VmHWM"]
    return {
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("sums", "checkpoint")},
        "model": {"description": f"{cfg.layers} x Linear({cfg.width}, {cfg.width}), {cfg.dtype}",
                  "params": cfg.layers * (cfg.width * cfg.width + cfg.width), "bytes": cfg.model_bytes,
                  "schedule": "1f1b", "optimizer": f"SGD(lr={cfg.lr}, momentum=0)",
                  "state_bytes_per_param": cfg.state_bytes_per_param, "checkpoint_kept": kept},
        "plan": [{"stage": st.index, "modules": st.modules, "params": st.params, "memory_bytes": st.memory,
                  "state_bytes": st.state_bytes, "act_bytes": st.act_bytes, "inflight": st.inflight}
                 for st in plan.stages],
        "checkpoint": writer,
        "whole_model": {
            **whole,
            "measured_peak_bytes": whole_peak,
            "per_rank_bytes_largest": max(r["whole_model_rank_bytes"] for r in ranks),
            # A rank's RSS once planned (meta model), the whole model's weights, its stages' gradients.
            "analytic_per_rank_bytes": max(r["rss"]["after_partition"]["VmRSS"] + cfg.model_bytes + r["param_bytes"]
                                           for r in ranks),
            "all_ranks_bytes": sum(r["whole_model_rank_bytes"] for r in ranks),
        },
        "ranks": ranks,
        "summary": {
            "idle_rank_rss_bytes": statistics.mean(idle),
            "max_peak_bytes": max_peak,
            "sum_of_peaks_bytes": sum(peaks),
            "model_over_max_peak": cfg.model_bytes / max_peak,
            "whole_model_over_max_peak": max(r["whole_model_rank_bytes"] for r in ranks) / max_peak,
            "max_load_s": max(r["times_s"]["load"] for r in ranks),
            "step_s": max(r["times_s"]["step"] for r in ranks),
        },
        "checks": checks,
    }


# -- reporting ------------------------------------------------------------------------------------


def _print(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def gib(x: float) -> str:
        return f"{x / _GIB:.2f}"

    cfg, model = res["config"], res["model"]
    table = Table(title=f"Memory per rank: {model['description']} ({gib(model['bytes'])} GiB) on {cfg['ranks']} "
                        f"ranks, {cfg['microbatches']} x {cfg['rows']} rows, {model['optimizer']}")
    for col in ("rank", "stages", "layers", "params GiB", "estimate GiB", "limit GiB", "peak after load",
                "load transient", "peak GiB", "peak / limit", "whole-model GiB", "load s", "read s", "step s"):
        table.add_column(col, justify="left" if col in ("stages", "layers") else "right")
    for r in res["ranks"]:
        table.add_row(
            str(r["rank"]), ",".join(map(str, r["stages"])), "; ".join(r["estimate"]["modules"]),
            gib(r["param_bytes"]), gib(r["estimate"]["memory_bytes"]), gib(r["limit_bytes"]),
            gib(r["rss"]["after_load"]["VmHWM"]), gib(r["load_transient_bytes"]), gib(r["peak_bytes"]),
            f"{r['peak_over_limit']:.2f}", gib(r["whole_model_rank_bytes"]), f"{r['times_s']['load']:.1f}",
            f"{r['times_s']['read'] or 0.0:.1f}", f"{r['times_s']['step']:.1f}",
        )
    console = Console(width=170)
    console.print(table)
    s, w, ck = res["summary"], res["whole_model"], res["checkpoint"]
    lines = [
        f"idle rank (torch imported, process group joined): {gib(s['idle_rank_rss_bytes'])} GiB RSS",
        (f"checkpoint: {ck['files']} safetensors shard(s), {gib(ck['bytes'])} GiB written in {ck['write_s']:.1f} s, "
        f"writer's peak {gib(ck['peak_rss_bytes'])} GiB"),
        (f"today's whole model per rank: one process building the real model and partitioning it peaks at "
        f"{gib(w['measured_peak_bytes'])} GiB (measured; build {w['build_s']:.1f} s), + its stages' gradients = "
        f"{gib(w['per_rank_bytes_largest'])} GiB for the largest rank "
        "(analytic: a planned rank's RSS + model + gradients = "
        f"{gib(w['analytic_per_rank_bytes'])} GiB); all {cfg['ranks']} ranks at once would need "
        f"{gib(w['all_ranks_bytes'])} GiB"),
        (f"now: largest rank's peak {gib(s['max_peak_bytes'])} GiB ({s['whole_model_over_max_peak']:.1f} x less), "
        f"all ranks {gib(s['sum_of_peaks_bytes'])} GiB; load (materialise + read) up to {s['max_load_s']:.1f} s, "
        f"step {s['step_s']:.1f} s, loss {res['ranks'][0]['loss']:.4f}"),
    ]
    for name, c in res["checks"].items():
        value = c.get("worst_ratio", c.get("ratio"))
        lines.append(f"check {name}: {'met' if c['met'] else 'MISSED'}"
                     + (f" ({c['rule']}; {value:.2f})" if value is not None else ""))
    for line in lines:
        console.print(line, soft_wrap=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8, help="p: processes, one pipeline stage each")
    ap.add_argument("--layers", type=int, default=96)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--microbatches", type=int, default=0, help="m (default 2 x ranks)")
    ap.add_argument("--rows", type=int, default=1, help="rows per micro-batch")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-mib", type=int, default=1024, help="checkpoint shard size")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for each spawned step")
    ap.add_argument("--tmpdir", default=None, help="where the checkpoint is written (default: the system's)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint")
    ap.add_argument("--out", default=None,
                    help="the JSON written (default benchmarks/results/memory.json, with --engines memory_fsdp.json)")
    ap.add_argument("--engines", action="store_true",
                    help="instead: each rank's peak under each data-parallel engine on 2 dp x 2 pp (AdamW)")
    ap.add_argument("--quick", action="store_true", help="with --engines: a tiny GPT-2, 2 steps, three engines")
    ap.add_argument("--only", default=None, metavar="NAMES",
                    help="with --engines: only these engines, ';'-separated (one name holds a comma), e.g. "
                         "'fsdp;replicate'")
    ap.add_argument("--tp", action="store_true",
                    help="with --engines: tp 1 against tp 2 at the same pp ('replicate;tp 2'; the result "
                         "memory_tp.json)")
    ap.add_argument("--mmap-threshold", type=int, default=None, metavar="BYTES",
                    help="with --engines: MALLOC_MMAP_THRESHOLD_ for the spawned processes (a fixed glibc mmap "
                         "threshold; default: unset, glibc's dynamic one)")
    cli = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(cli)
    if args.engines:
        return _engines(args, cli)
    args.out = args.out or str(ROOT / "benchmarks" / "results" / "memory.json")
    cfg = Config(ranks=args.ranks, layers=args.layers, width=args.width, dtype=args.dtype,
                 microbatches=args.microbatches or 2 * args.ranks, rows=args.rows, seed=args.seed, lr=args.lr,
                 shard_bytes=args.shard_mib * _MIB, timeout=args.timeout)
    t0 = time.time()
    available = _mem_available()
    load_before = os.getloadavg()
    try:
        res = run(cfg, tmpdir=args.tmpdir, keep=args.keep)
    except MemoryError as e:
        print(f"not run: {e}", file=sys.stderr)
        return 2
    _print(res)
    meta = {"benchmark": "memory", "command": shlex.join(["python", "benchmarks/memory.py", *cli]),
            "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "mem_available_bytes_before": available, "load_avg_before": load_before,
            "load_avg_after": os.getloadavg(), "wall_s": time.time() - t0, "git": git_state()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, **res}, indent=2) + "\n")
    return 0 if all(c["met"] for c in res["checks"].values()) else 1


def _engines(args: argparse.Namespace, cli: list[str]) -> int:
    """``--engines``: run ``benchmarks/lib/memory_engines.py``'s configurations, print, write the JSON."""
    names = TP_ENGINES if args.tp else QUICK_ENGINES if args.quick else DP_ENGINES
    if args.only is not None:
        names = tuple(n.strip() for n in args.only.split(";") if n.strip())
        unknown = [n for n in names if n not in ENGINES]
        if unknown or not names:
            print(f"--only: unknown engine(s) {unknown or names!r}; known: {'; '.join(ENGINES)}", file=sys.stderr)
            return 2
    t0 = time.time()
    load = load_before("the 4 processes")
    # glibc reads MALLOC_MMAP_THRESHOLD_ as a process starts: the spawned ranks inherit it, this one is unchanged.
    saved = os.environ.get(_MMAP_ENV)
    threshold = str(args.mmap_threshold) if args.mmap_threshold is not None else saved  # None: glibc's dynamic one
    if threshold is not None:
        os.environ[_MMAP_ENV] = threshold
    try:
        res = run_all(dict(QUICK if args.quick else FULL), timeout=args.timeout, names=names)
    finally:
        if saved is None:
            os.environ.pop(_MMAP_ENV, None)
        else:
            os.environ[_MMAP_ENV] = saved
    res["config"]["malloc_mmap_threshold"] = threshold
    print_table(res)
    meta = {"benchmark": "memory_engines", "command": shlex.join(["python", "benchmarks/memory.py", *cli]),
            "env": {_MMAP_ENV: threshold},
            **run_env(load, t0)}
    default = "memory_tp.json" if args.tp else "memory_fsdp.json"
    write_result(args.out or ROOT / "benchmarks" / "results" / default, {"meta": meta, **res})
    return 0


if __name__ == "__main__":
    sys.exit(main())
