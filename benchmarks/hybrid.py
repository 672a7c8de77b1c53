"""Benchmark: data x pipeline parallelism on 4 processes, dp x pp = 2 x 2 against 1 x 4 and 4 x 1.

Run (CPU, 4 gloo processes of one thread each; two to four minutes on a 2-core machine; writes
``benchmarks/results/hybrid.json``)::

    python benchmarks/hybrid.py
    python benchmarks/hybrid.py --steps 20 --warmup 4 --n-layer 4 --n-embd 256 --n-head 4 --vocab 2048 \
        --seq 64 --batch 32 --micro-batch 2 --out benchmarks/results/hybrid.json
    python benchmarks/hybrid.py --quick --out /tmp/hybrid.json  # a small MLP (--model mlp), ~15 s in all

One GPT-2 (``partitioner.zoo.gpt2``, tied embedding, cross-entropy over the vocabulary; or with
``--model mlp`` an ``MLPChain`` of equal widths and MSE, as ``--quick`` uses), one global
batch of ``--batch`` sequences and the same micro-batch size (``--micro-batch`` rows) in every
configuration, so every configuration runs the same matmuls: on a CPU a small micro-batch makes
them less efficient, and comparing a 4-row micro-batch with a 2-row one would measure that, not
the parallelism. A replica of ``dp`` runs ``batch / (dp * micro_batch)`` micro-batches. All
configurations use ``PipelineTrainer(transport='dist')``, 1F1B unless named, and one SGD step per step
(``trainer.step(*trainer.local_batch(x, y))``, so the optimizer's work, repeated by every replica,
is counted), and run in the same 4 processes, one ``runtime.transport.launch.spawn``:

* ``a: 2 dp x 2 pp``: a 2-stage plan, ``data_parallel=2``, gradients all-reduced stage by stage
  as each stage's last backward ran (``overlap_grad_reduce=True``, the default);
* ``b: 1 dp x 4 pp``: a 4-stage plan, one pipeline over the 4 ranks (no all-reduce);
* ``c: 4 dp x 1 pp``: a 1-stage plan, ``data_parallel=4``: plain data parallelism through the
  trainer (each rank holds the whole model);
* ``d: 2 dp x 2 pp, all-reduce after``: as ``a`` with ``overlap_grad_reduce=False`` (the
  exchange starts when the whole pipeline has finished: a barrier over its ranks first);
* ``e`` / ``f``: ``a`` / ``d`` with the interleaved schedule (a 4-stage plan, two stages per rank);
* ``g`` / ``h``: ``a`` on FSDP2 (``DataParallel(engine='fsdp')``): each stage's parameters
  sharded over its 2 replicas, gathered for every forward and backward (``g``, ZeRO-3) or kept
  gathered through the step (``h``), gradients reduce-scattered once per step. Their "grad
  all-reduce" column is 0 (FSDP reduce-scatters); "param MiB/rank" shows the shards;
* ``i: 2 dp x 2 pp ZeRO-1``: ``a`` with ``shard_optimizer=True`` on the home-made engine (each
  replica steps half of each stage's parameters and broadcasts them), beside ``h``, which holds
  the same whole weights and gradients during a step.

Why ``e`` and ``f``: with one stage per rank a stage's last backward is its rank's last action, so
in ``a`` only the ranks that finish early (the last ones, under 1F1B) reduce while the others
drain; rank 0 finishes last and its all-reduce stays on the critical path either way. With two
stages per rank, a rank's later stage is done while its first stage still runs backward, and
``e`` sends that stage's gradients then.

``data_parallel`` builds a ``DeviceMesh`` (new process groups, a collective), so every rank builds
the trainers in the same order, and every rank takes part in every configuration. Rounds are
interleaved, one step of each configuration per round and the order rotated each round, so a noisy
machine slows them alike. A step starts after a barrier and lasts from the first rank's start to
the last rank's end (``perf_counter``, one clock for the machine). Reported: the median over
``--steps`` rounds after ``--warmup``, the quartiles, throughput in samples (sequences) and tokens
per second, throughput relative to ``b``, ``d``'s step time over ``a``'s and ``f``'s over ``e``'s
(the overlap's gain), and
the gradient bytes each rank all-reduced per step (counted on ``torch.distributed.all_reduce``
calls in the data-parallel group, checked against the trainable parameter bytes the rank holds).
Before timing, each configuration's loss and every gradient on every rank are checked against the
unpartitioned model on the global batch.

``--predict`` sets the layout search's price beside each measurement, once the ranks are done: the
model traced and costed by ``partitioner.search.LayoutSearch`` for 4 ``'cpu'`` devices, the cluster
fitted to the model's own step on this machine (``fit_to_model``), each configuration priced as
the ``Option`` it runs (``h``, FSDP kept gathered, as ``zero1``: ``partitioner.plan.sharding`` says
why); the predicted throughput relative to ``b`` is reported as ``predicted_vs_b`` (``d`` and ``f``,
whose exchange waits for the whole pipeline, are not priced: the search assumes the overlap).
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# This checkout's packages first (an editable install may point at another one), and lib/.
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from lib.common import gpt2_size_args, load_before, ratio_table, run_env, spread_ms, step_times, times_ms, write_result  # noqa: E402
from partitioner import partition  # noqa: E402
from partitioner.schedule.registry import stages_per_rank  # noqa: E402
from partitioner.zoo import MLPChain, gpt2  # noqa: E402
from runtime import DataParallel, Execution, PipelineTrainer  # noqa: E402
from runtime.parallel.clipping import local_shard  # noqa: E402
from runtime.transport.launch import spawn  # noqa: E402

__all__ = ["CONFIGS", "main", "predicted"]

PROCESSES = 4
BASELINE = "b: 1 dp x 4 pp"
# name -> (dp, pp, overlap_grad_reduce, schedule); dp * pp == PROCESSES. Built in this order on every rank.
CONFIGS: dict[str, tuple[int, int, bool, str]] = {
    "a: 2 dp x 2 pp": (2, 2, True, "1f1b"),
    BASELINE: (1, 4, True, "1f1b"),
    "c: 4 dp x 1 pp": (4, 1, True, "1f1b"),
    "d: 2 dp x 2 pp, all-reduce after": (2, 2, False, "1f1b"),
    "e: 2 dp x 2 pp interleaved": (2, 2, True, "interleaved"),
    "f: 2 dp x 2 pp interleaved, all-reduce after": (2, 2, False, "interleaved"),
    "g: 2 dp x 2 pp FSDP": (2, 2, True, "1f1b"),
    "h: 2 dp x 2 pp FSDP kept gathered": (2, 2, True, "1f1b"),
    "i: 2 dp x 2 pp ZeRO-1": (2, 2, True, "1f1b"),
}
# The configurations run on FSDP2 (DataParallel(engine='fsdp')): name -> reshard_after_forward.
FSDP: dict[str, bool] = {"g: 2 dp x 2 pp FSDP": True, "h: 2 dp x 2 pp FSDP kept gathered": False}
# The configurations whose optimizer the home-made engine shards over the replicas (ZeRO-1).
ZERO1 = ("i: 2 dp x 2 pp ZeRO-1",)
# Stages per rank of a schedule (the interleaved one puts two on each rank).
# The overlap comparisons: (with, without) overlap_grad_reduce.
_OVERLAP = {"1f1b": ("a: 2 dp x 2 pp", "d: 2 dp x 2 pp, all-reduce after"),
            "interleaved": ("e: 2 dp x 2 pp interleaved", "f: 2 dp x 2 pp interleaved, all-reduce after")}
RTOL, ATOL = 1e-4, 1e-5
# --quick: a small MLP, which traces in a fraction of GPT-2's time (anything given explicitly on the command
# line wins: --quick --model gpt2 runs a tiny GPT-2).
_QUICK = ["--model", "mlp", "--steps", "2", "--warmup", "1", "--n-layer", "4", "--n-embd", "32", "--n-head", "2",
          "--vocab", "64", "--seq", "8", "--batch", "16", "--micro-batch", "2"]


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # (B, T, V), (B, T)
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _loss(cfg: dict[str, Any]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return _lm_loss if cfg["model"] == "gpt2" else nn.functional.mse_loss


def _tokens(cfg: dict[str, Any]) -> int:
    """Tokens per sample: a GPT-2 sequence's length; 1 for the MLP's rows."""
    return int(cfg["seq"]) if cfg["model"] == "gpt2" else 1


def _describe(cfg: dict[str, Any]) -> str:
    if cfg["model"] == "gpt2":
        return f"GPT-2 {cfg['n_layer']} layers x {cfg['n_embd']}, vocab {cfg['vocab']}, seq {cfg['seq']}"
    return f"MLP {cfg['n_layer']} x Linear({cfg['n_embd']}, {cfg['n_embd']}) + GELU"


def _model(cfg: dict[str, Any]) -> nn.Module:
    torch.manual_seed(1234)
    if cfg["model"] == "mlp":
        return MLPChain((cfg["n_embd"],) * (cfg["n_layer"] + 1))
    model, _ = gpt2(n_layer=cfg["n_layer"], n_embd=cfg["n_embd"], n_head=cfg["n_head"], vocab_size=cfg["vocab"],
                    n_positions=cfg["seq"], batch=cfg["micro_batch"], seq=cfg["seq"])
    return model


def _data(cfg: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)  # the same global batch on every rank
    if cfg["model"] == "mlp":
        return (torch.randn(cfg["batch"], cfg["n_embd"], generator=gen),
                torch.randn(cfg["batch"], cfg["n_embd"], generator=gen))
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)
    y = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)
    return x, y


def _trainer(
    model: nn.Module, cfg: dict[str, Any], dp: int, pp: int, overlap: bool, schedule: str,
    reshard_after_forward: bool | None = None, *, shard_optimizer: bool = False,
) -> PipelineTrainer:
    m = cfg["batch"] // (dp * cfg["micro_batch"])  # micro-batches per replica
    example = (_data({**cfg, "batch": cfg["micro_batch"]})[0],)
    # A copy per configuration: the stages share the parameters of the model they were cut from.
    plan = partition(copy.deepcopy(model), example, pp * stages_per_rank(schedule), microbatches=m, schedule=schedule)
    replicas = (DataParallel(size=dp, overlap_grad_reduce=overlap, shard_optimizer=shard_optimizer)
                if reshard_after_forward is None
                else DataParallel(size=dp, engine="fsdp", reshard_after_forward=reshard_after_forward))
    return PipelineTrainer(plan, _loss(cfg), lambda ps: torch.optim.SGD(ps, lr=1e-3),
                           execution=Execution(schedule=schedule, transport="dist"), data_parallel=replicas)


@contextmanager
def _counting_all_reduce(group: dist.ProcessGroup | None, calls: list[int]) -> Iterator[None]:
    """Append the bytes of every asynchronous ``dist.all_reduce`` of a bucket in ``group`` to
    ``calls``: the gradient buckets (the replicas' loss, averaged in the same group and, bounded by
    the trainer's timeout, asynchronously too, is a scalar)."""
    real = dist.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, **kw: Any) -> Any:
        if group is not None and kw.get("group") is group and kw.get("async_op") and tensor.dim() > 0:
            calls.append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kw)

    dist.all_reduce = counted
    try:
        yield
    finally:
        dist.all_reduce = real


def _check(tr: PipelineTrainer, x: torch.Tensor, y: torch.Tensor, want_loss: torch.Tensor,
           want: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One forward_backward: loss and gradients equal the plain model's; the all-reduced bytes."""
    calls: list[int] = []
    tr.zero_grad()
    with _counting_all_reduce(tr.mesh.dp_group, calls):
        loss = tr.forward_backward(*tr.local_batch(x, y))
    torch.testing.assert_close(loss, want_loss, rtol=RTOL, atol=ATOL)
    worst = 0.0
    trainable = {}
    sharded = False
    # ZeRO-1: a gradient is reduced to its owner (dist.reduce, not counted), the others drop theirs.
    zero1 = tr.options.data_parallel.shard_optimizer
    owned = {id(p) for p in tr._replicas.owned}
    for name, prm in tr.named_parameters():
        local = local_shard(prm)
        trainable[id(prm)] = local.numel() * local.element_size()  # what this rank holds
        if zero1 and id(prm) not in owned:
            assert prm.grad is None, f"{name}: a gradient kept by a rank that does not own it"
            continue
        assert prm.grad is not None, f"{name} has no gradient"
        grad = prm.grad
        if hasattr(grad, "full_tensor"):  # FSDP: this rank's shard; the check gathers it
            sharded = True
            grad = grad.full_tensor()
        torch.testing.assert_close(grad, want[name], rtol=RTOL, atol=ATOL, msg=f"gradient of {name} differs")
        worst = max(worst, (grad - want[name]).abs().max().item())
    param_bytes = sum(trainable.values())
    grad_bytes = sum(calls)
    if tr.mesh.dp > 1 and not sharded and not zero1:  # every trainable parameter this rank holds is averaged, once
        assert grad_bytes == param_bytes, (grad_bytes, param_bytes)
    tr.zero_grad()
    return {"loss": float(loss), "max_abs_grad_diff": worst, "grad_allreduce_bytes": grad_bytes,
            "buckets": len(calls), "param_bytes": param_bytes, "stages": sorted(tr.stages),
            "dp_rank": tr.mesh.dp_rank, "pp_rank": tr.mesh.pp_rank}


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    phases = {"start": time.perf_counter()}
    model = _model(cfg)
    x, y = _data(cfg)
    ref = copy.deepcopy(model)
    want_loss = _loss(cfg)(ref(x), y)
    want_loss.backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters(remove_duplicate=False) if p.grad is not None}
    want_loss = want_loss.detach()
    del ref
    phases["reference"] = time.perf_counter()

    names = [n for n in CONFIGS if not cfg["only"] or n[0] in cfg["only"] or n == BASELINE]
    trainers = {name: _trainer(model, cfg, *CONFIGS[name], FSDP.get(name), shard_optimizer=name in ZERO1)
                for name in names}  # same order everywhere
    phases["build"] = time.perf_counter()
    checks = {name: _check(tr, x, y, want_loss, want) for name, tr in trainers.items()}
    phases["check"] = time.perf_counter()
    runs: dict[str, Callable[[], torch.Tensor]] = {
        name: functools.partial(lambda tr: tr.step(*tr.local_batch(x, y)), tr) for name, tr in trainers.items()
    }
    spans: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    n = len(names)
    for rnd in range(cfg["warmup"] + cfg["steps"]):
        for k in range(n):
            name = names[(rnd + k) % n]  # rotate the order: no configuration always runs first
            dist.barrier()
            t0 = time.perf_counter()
            runs[name]()
            t1 = time.perf_counter()
            if rnd >= cfg["warmup"]:
                spans[name].append((t0, t1))
    dist.barrier()
    phases["steps"] = time.perf_counter()
    marks = list(phases.values())
    return {"spans": spans, "checks": checks,
            "phases_s": {k: b - a for k, a, b in zip(list(phases)[1:], marks, marks[1:])}}


# The sharding each configuration is priced as (--predict); configurations without overlap are not priced.
_PRICED_AS = {"a: 2 dp x 2 pp": "none", BASELINE: "none", "c: 4 dp x 1 pp": "none",
              "e: 2 dp x 2 pp interleaved": "none", "g: 2 dp x 2 pp FSDP": "fsdp",
              "h: 2 dp x 2 pp FSDP kept gathered": "zero1", "i: 2 dp x 2 pp ZeRO-1": "zero1"}


def predicted(cfg: dict[str, Any], names: list[str], *, fit: bool = True) -> dict[str, float]:
    """The layout search's predicted step time (s) of each of ``names`` it prices (see the module
    docstring, ``--predict``): on the ``'cpu'`` preset fitted to this machine's step of the model,
    or with ``fit=False`` on the preset as it is (what the prices' structure, not their scale,
    depends on: a fit to a tiny model's millisecond steps can fail on a busy machine)."""
    from partitioner import Cluster
    from partitioner.plan.layout import Option
    from partitioner.search import LayoutSearch

    example = (_data({**cfg, "batch": cfg["micro_batch"]})[0],)
    found = LayoutSearch(_model(cfg), example, cluster=Cluster.uniform(PROCESSES, "cpu"), global_batch=cfg["batch"],
                         recompute=False)
    if fit:
        found.use_cluster(found.fit_to_model())
    out = {}
    for name in names:
        if name in _PRICED_AS:
            dp, pp, _, schedule = CONFIGS[name]
            o = Option(dp=dp, pp=pp, schedule=schedule, microbatch_size=cfg["micro_batch"], zero=_PRICED_AS[name],
                       global_batch=cfg["batch"])
            out[name] = found.price(o).step_time
    return out


def _summary(times: dict[str, list[float]], cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, ts in times.items():
        dp, pp, overlap, schedule = CONFIGS[name]
        med = statistics.median(ts)
        out[name] = {"dp": dp, "pp": pp, "overlap_grad_reduce": overlap, "schedule": schedule,
                     "microbatches_per_replica": cfg["batch"] // (dp * cfg["micro_batch"]),
                     **spread_ms(ts), "steps_per_s": 1.0 / med, "samples_per_s": cfg["batch"] / med,
                     "tokens_per_s": cfg["batch"] * _tokens(cfg) / med}
    base = out.get(BASELINE)
    for row in out.values():
        row["throughput_vs_b"] = row["samples_per_s"] / base["samples_per_s"] if base else None
    return out


def _ratios(summary: dict[str, dict[str, Any]]) -> dict[str, float]:
    med = {k: v["median_ms"] for k, v in summary.items()}
    r: dict[str, float] = {}
    for name in summary:
        if name != BASELINE and BASELINE in med:
            r[f"throughput {name} / {BASELINE}"] = med[BASELINE] / med[name]
    for schedule, (a, d) in _OVERLAP.items():
        if a in med and d in med:
            r[f"{schedule} overlap: step time without / with ({d[0]} / {a[0]})"] = med[d] / med[a]
            r[f"{schedule} overlap: ms saved per step ({d[0]} - {a[0]})"] = med[d] - med[a]
    return r


def _paired(times: dict[str, list[float]]) -> dict[str, float]:
    """Medians over rounds of step-time ratios within one round (drift and other jobs' bursts cancel)."""
    def med(slow: str, fast: str) -> float:
        return statistics.median(x / y for x, y in zip(times[slow], times[fast]))

    out = {f"throughput {name} / {BASELINE}, same round": med(BASELINE, name)
           for name in times if name != BASELINE and BASELINE in times}
    for schedule, (a, d) in _OVERLAP.items():
        if a in times and d in times:
            out[f"{schedule} overlap: {d[0]} / {a[0]}, same round"] = med(d, a)
    return out


def _grad_bytes(checks: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Per configuration: the gradient bytes each rank all-reduced per step (rank order)."""
    return {name: [c[name]["grad_allreduce_bytes"] for c in checks] for name in checks[0]}


def _print(cfg: dict[str, Any], summary: dict[str, dict[str, Any]], ratios: dict[str, float],
           grad_bytes: dict[str, list[int]], param_bytes: dict[str, list[int]]) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (f"{_describe(cfg)}; "
             f"{PROCESSES} gloo processes x 1 thread on {os.cpu_count()} CPUs; 1F1B unless named, SGD; every "
             f"configuration: global batch {cfg['batch']} = micro-batches of {cfg['micro_batch']} rows "
             f"(same matmul sizes); median of {cfg['steps']} steps after {cfg['warmup']} warm-up")
    table = Table(title=title, title_justify="left")
    cols = ("configuration", "m/replica", "median ms", "p25 ms", "p75 ms", "min ms", "samples/s", "tokens/s", "vs b",
            "predicted vs b", "grad all-reduce MiB/rank", "param MiB/rank")
    for col in cols:
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for name, row in summary.items():
        mib = sorted({b / 2**20 for b in grad_bytes[name]})
        table.add_row(name, str(row["microbatches_per_replica"]),
                      *(f"{row[k]:.1f}" for k in ("median_ms", "p25_ms", "p75_ms", "min_ms", "samples_per_s")),
                      f"{row['tokens_per_s']:.0f}", f"{row['throughput_vs_b']:.3f}",
                      "-" if row.get("predicted_vs_b") is None else f"{row['predicted_vs_b']:.3f}",
                      " / ".join(f"{v:.2f}" for v in mib),
                      " / ".join(f"{v:.2f}" for v in sorted({b / 2**20 for b in param_bytes[name]})))
    rt = ratio_table("ratios of medians, and medians of same-round ratios (> 1: the first named is faster)", ratios)
    console = Console(width=160)
    console.print(table)
    console.print(rt)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per configuration (median over these)")
    ap.add_argument("--warmup", type=int, default=4, help="untimed rounds first")
    ap.add_argument("--model", choices=("gpt2", "mlp"), default="gpt2",
                    help="partitioner.zoo's gpt2, or an MLPChain of n-layer x Linear(n-embd, n-embd)")
    gpt2_size_args(ap, n_layer=4, n_embd=256, n_head=4, vocab=2048, seq=64)
    ap.add_argument("--batch", type=int, default=32, help="global batch (sequences), the same in every configuration")
    ap.add_argument("--micro-batch", type=int, default=2, help="rows per micro-batch, the same everywhere")
    ap.add_argument("--only", default="", help="configuration letters to run besides b, e.g. 'ad'")
    ap.add_argument("--quick", action="store_true", help="shorthand for a smoke test: " + " ".join(_QUICK))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    ap.add_argument("--predict", action="store_true",
                    help="also price each configuration with the layout search, fitted to this machine")
    ap.add_argument("--out", default="benchmarks/results/hybrid.json")
    cli = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(cli)
    if args.quick:
        args = ap.parse_args(_QUICK + cli)
    keys = ("model", "steps", "warmup", "n_layer", "n_embd", "n_head", "vocab", "seq", "batch", "micro_batch", "only")
    cfg = {k: getattr(args, k) for k in keys}
    if cfg["steps"] < 1 or cfg["n_layer"] < 4 or cfg["batch"] % (PROCESSES * cfg["micro_batch"]):
        ap.error(f"need --steps >= 1, --n-layer >= 4 (a 4-stage plan) and --batch divisible by "
                 f"{PROCESSES} x --micro-batch (every configuration runs whole micro-batches)")

    t0 = time.time()
    load = load_before(f"the {PROCESSES} processes")
    ranks = spawn(_worker, PROCESSES, cfg, timeout=args.timeout, threads=1)
    print("phases (s, rank 0): " + ", ".join(f"{k} {v:.1f}" for k, v in ranks[0]["phases_s"].items()))
    times = step_times([r["spans"] for r in ranks])
    summary = _summary(times, cfg)
    if args.predict:  # after the ranks are done: the fit times the model on this machine
        pred = predicted(cfg, list(summary))
        for name, row in summary.items():
            row["predicted_step_ms"] = pred[name] * 1e3 if name in pred else None
            row["predicted_vs_b"] = pred[BASELINE] / pred[name] if name in pred and BASELINE in pred else None
    ratios = _ratios(summary)
    paired = _paired(times)
    checks = [r["checks"] for r in ranks]
    grad_bytes = _grad_bytes(checks)
    param_bytes = {name: [c[name]["param_bytes"] for c in checks] for name in checks[0]}
    _print(cfg, summary, {**ratios, **paired}, grad_bytes, param_bytes)
    result = {
        "benchmark": "hybrid",
        "command": shlex.join(["python", "benchmarks/hybrid.py", *cli]),
        "config": {**cfg, "processes": PROCESSES, "threads_per_process": 1,
                   "model_description": _describe(cfg) + (" (partitioner.zoo.gpt2, tied embedding)"
                                                          if cfg["model"] == "gpt2" else " (partitioner.zoo.MLPChain)"),
                   "loss": "cross_entropy" if cfg["model"] == "gpt2" else "mse",
                   "optimizer": "SGD(lr=1e-3)", "tokens_per_step": cfg["batch"] * _tokens(cfg),
                   "configurations": {k: {"dp": v[0], "pp": v[1], "overlap_grad_reduce": v[2], "schedule": v[3],
                                          "engine": "fsdp" if k in FSDP else "replicate",
                                          "shard_optimizer": k in ZERO1}
                                      for k, v in CONFIGS.items() if k in summary}},
        "env": run_env(load, t0),
        "results": summary,
        "ratios": ratios,
        "paired_ratios": paired,
        "grad_allreduce_bytes_per_rank": grad_bytes,
        "param_bytes_per_rank": param_bytes,
        "checks": {f"rank {r}": c for r, c in enumerate(checks)},
        "phases_s": {f"rank {r}": res["phases_s"] for r, res in enumerate(ranks)},
        "times_ms": times_ms(times),
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
