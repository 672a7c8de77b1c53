"""Benchmark: the plan's memory estimate per stage against what CUDA measures, all stages on one GPU.

Run (one CUDA GPU, about 90 s on an H100; writes ``benchmarks/results/cuda_memory.json``)::

    python benchmarks/cuda_memory.py
    python benchmarks/cuda_memory.py --models gpt2 --transport local --out /tmp/cuda_memory.json
    python benchmarks/cuda_memory.py --quick --device cpu --out /tmp/cm.json   # the code paths, no GPU
    python benchmarks/cuda_memory.py --quick --device cpu --stages 2 --schedules 1f1b --precisions bf16  # 2 of them

Each configuration (model x stages 1, 2 x schedule gpipe, 1f1b x precision fp32, bf16) is
planned for ``Cluster.uniform(p, 'H100-80GB')`` (``partition(..., precision=, recompute=False)``)
from a model built on ``meta``, then ``PipelineTrainer(plan, loss, AdamW, transport=, devices=
[device] * p)`` materialises its stages straight on the device and trains with autocast
(``runtime.precision.MixedPrecision``). Measured, as bytes above what was allocated before the
trainer was built (``torch.cuda.memory_allocated``):

* after build: the weights (fp32, 4 bytes per parameter);
* at rest: after the warm-up step, so AdamW's state and the gradients exist;
* peak: ``torch.cuda.max_memory_allocated`` over ``--steps`` steps after the warm-up.

The prediction is ``StagePlan.memory``: training state (``state_bytes_per_param`` = 16 bytes per
parameter: fp32 weights 4 + gradients 4 + AdamW's two moments 8, plus buffers) and saved
activations x the micro-batches the schedule holds in flight (``StagePlan.inflight``). With
``p`` stages on one GPU the device peak is compared with the *sum* of the stages' predictions
(the stages' peaks need not coincide, so the sum is an upper reading of the prediction); with
one stage it is the per-rank comparison. A parameter tied across stages (GPT-2's embedding and
head) counts in every holder's prediction. Not in the prediction: the loss (GPT-2's logits
through cross-entropy in fp32), the allocator's rounding, CUDA/cuBLAS workspaces, and the
boundary buffers between stages.

``--device cpu`` runs the same planning and training with the CUDA readings left ``null`` (for
tests without a GPU). Legend: ``p`` stages, ``m`` micro-batches.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import math
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# This checkout's packages first (an editable install may point at another one), and lib/.
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from torch import nn  # noqa: E402

from lib.common import load_before, run_env, write_result  # noqa: E402
from partitioner import Cluster, partition  # noqa: E402
from partitioner.plan.plan import Plan  # noqa: E402
from partitioner.zoo import MLPChain, gpt2  # noqa: E402
from runtime import PipelineTrainer, empty_weights  # noqa: E402
from runtime.precision import MixedPrecision  # noqa: E402

__all__ = ["Profile", "FULL", "QUICK", "main"]

_MIB = 2**20
MODELS = ("gpt2", "mlp")
STAGES = (1, 2)
SCHEDULES = ("gpipe", "1f1b")
PRECISIONS = ("fp32", "bf16")


@dataclasses.dataclass(frozen=True)
class Profile:
    """The sizes every configuration is run at."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab: int
    seq: int
    mlp_widths: tuple[int, ...]
    gpt2_rows: int  # rows per micro-batch
    mlp_rows: int
    microbatches: int
    steps: int  # measured steps, after one warm-up step


FULL = Profile(n_layer=8, n_embd=1024, n_head=16, vocab=50257, seq=512, mlp_widths=(1024,) + (4096, 1024) * 4,
               gpt2_rows=4, mlp_rows=4096, microbatches=4, steps=2)
QUICK = Profile(n_layer=2, n_embd=64, n_head=4, vocab=256, seq=32, mlp_widths=(64, 256, 64, 128, 32),
                gpt2_rows=2, mlp_rows=8, microbatches=2, steps=1)


@dataclasses.dataclass(frozen=True)
class Config:
    """One measured run: which model, cut into how many stages, under which schedule and precision."""

    model: str
    stages: int
    schedule: str
    precision: str

    @property
    def name(self) -> str:
        return f"{self.model} p={self.stages} {self.schedule} {self.precision}"


# -- model, batch, plan ---------------------------------------------------------------------------


def _model(cfg: Config, prof: Profile) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The model on ``meta`` (the trainer allocates its stages on the device) and one micro-batch."""
    if cfg.model == "gpt2":
        return gpt2(n_layer=prof.n_layer, n_embd=prof.n_embd, n_head=prof.n_head, vocab_size=prof.vocab,
                    n_positions=prof.seq, batch=prof.gpt2_rows, seq=prof.seq, device="meta")
    with empty_weights():
        model = MLPChain(prof.mlp_widths)
    return model, (torch.empty(prof.mlp_rows, prof.mlp_widths[0], device="meta"),)


def _batch(cfg: Config, prof: Profile, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole batch of ``m`` micro-batches and its targets, on ``device``."""
    gen = torch.Generator().manual_seed(0)
    m = prof.microbatches
    if cfg.model == "gpt2":
        ids = torch.randint(0, prof.vocab, (m * prof.gpt2_rows, prof.seq + 1), generator=gen)  # (B, T + 1)
        return ids[:, :-1].to(device), ids[:, 1:].to(device)
    x = torch.randn(m * prof.mlp_rows, prof.mlp_widths[0], generator=gen)  # (B, widths[0])
    y = torch.randn(m * prof.mlp_rows, prof.mlp_widths[-1], generator=gen)  # (B, widths[-1])
    return x.to(device), y.to(device)


def _loss(model: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if model == "gpt2":
        return lambda logits, y: nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())  # (B*T, V)
    return lambda out, y: nn.functional.mse_loss(out.float(), y)


def _predicted(plan: Plan) -> dict[str, Any]:
    """The plan's memory per stage and its parts, summed over the stages (all on one device here)."""
    stages = [{"stage": st.index, "memory_bytes": st.memory, "state_bytes": st.state_bytes,
               "act_bytes_per_microbatch": st.act_bytes, "held_bytes_per_microbatch": st.held_bytes,
               "inflight": st.inflight, "params": st.params, "recompute": st.recompute, "modules": st.modules}
              for st in plan.stages]
    return {"stages": stages, "memory_bytes": sum(s["memory_bytes"] for s in stages),
            "state_bytes": sum(s["state_bytes"] for s in stages),
            "act_bytes": sum(st.held_bytes * st.inflight for st in plan.stages)}


# -- measuring ------------------------------------------------------------------------------------


class _Meter:
    """CUDA's allocator counters relative to a baseline; every reading is ``None`` off CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.base = 0

    def settle(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def start(self) -> None:
        self.settle()
        self.base = torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def now(self) -> int | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device) - self.base

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> tuple[int | None, int | None]:
        """Peak allocated above the baseline, and peak reserved (absolute: the allocator's cache)."""
        if not self.cuda:
            return None, None
        torch.cuda.synchronize(self.device)
        return (torch.cuda.max_memory_allocated(self.device) - self.base,
                torch.cuda.max_memory_reserved(self.device))


def _warm_cuda(device: torch.device) -> None:
    """One autocast matmul forward and backward, so cuBLAS's workspace (taken from the caching
    allocator, and kept) is in every configuration's baseline rather than in the first one's peak."""
    a = torch.randn(256, 256, device=device, requires_grad=True)
    for dtype in (torch.bfloat16, torch.float32):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            (a @ a).float().sum().backward()
    torch.cuda.synchronize(device)


def _run(cfg: Config, prof: Profile, device: torch.device, transport: str) -> dict[str, Any]:
    """Plan ``cfg``, train it on ``device`` (warm-up + ``prof.steps`` steps) and read the memory."""
    t0 = time.perf_counter()
    model, example = _model(cfg, prof)
    plan = partition(model, example, cfg.stages, microbatches=prof.microbatches, schedule=cfg.schedule,
                     cluster=Cluster.uniform(cfg.stages, "H100-80GB"), precision=cfg.precision, recompute=False)
    plan_s = time.perf_counter() - t0
    meter = _Meter(device)
    meter.start()
    trainer = PipelineTrainer(plan, _loss(cfg.model), lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                              precision=MixedPrecision(cfg.precision), transport=transport,
                              devices=[str(device)] * cfg.stages)
    built = meter.now()
    x, y = _batch(cfg, prof, device)
    losses = [trainer.step(x, y).item()]  # warm-up: AdamW's state is made here
    rest = meter.now()
    meter.reset_peak()
    step_s = []
    for _ in range(prof.steps):
        t1 = time.perf_counter()
        losses.append(trainer.step(x, y).item())  # .item() waits for the device
        step_s.append(time.perf_counter() - t1)
    peak, reserved = meter.peak()
    params = sum(p.numel() for p in trainer.parameters())
    del trainer, model, x, y
    meter.settle()
    pred = _predicted(plan)
    return {
        **dataclasses.asdict(cfg), "name": cfg.name, "transport": transport, "microbatches": prof.microbatches,
        "compared": "per rank" if cfg.stages == 1 else f"device peak vs sum of {cfg.stages} stages",
        "predicted": pred, "trainer_params": params,
        "measured": {"after_build_bytes": built, "at_rest_bytes": rest, "peak_bytes": peak,
                     "peak_reserved_bytes": reserved, "left_after_bytes": meter.now()},
        "peak_over_predicted": None if peak is None else peak / pred["memory_bytes"],
        "at_rest_over_predicted_state": None if rest is None else rest / pred["state_bytes"],
        "losses": losses, "losses_finite": all(math.isfinite(v) for v in losses),
        "plan_s": plan_s, "step_s": step_s,
    }


# -- report ---------------------------------------------------------------------------------------


def _print(rows: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    def mib(b: float | None) -> str:
        return "n/a" if b is None else f"{b / _MIB:,.1f}"

    def ratio(r: float | None) -> str:
        return "n/a" if r is None else f"{r:.2f}"

    table = Table(title=title, title_justify="left")
    for col in ("config", "compared", "predicted MiB", "pred state", "pred act", "inflight", "measured peak MiB",
                "at rest MiB", "after build", "measured / predicted", "rest / pred state", "step s"):
        table.add_column(col, justify="left" if col in ("config", "compared") else "right")
    for r in rows:
        p, ms = r["predicted"], r["measured"]
        table.add_row(r["name"], r["compared"], mib(p["memory_bytes"]), mib(p["state_bytes"]), mib(p["act_bytes"]),
                      "+".join(str(s["inflight"]) for s in p["stages"]), mib(ms["peak_bytes"]),
                      mib(ms["at_rest_bytes"]), mib(ms["after_build_bytes"]), ratio(r["peak_over_predicted"]),
                      ratio(r["at_rest_over_predicted_state"]), f"{min(r['step_s']):.3f}")
    Console(width=220).print(table)


def _configs(models: list[str], stages: list[int], schedules: list[str], precisions: list[str]) -> list[Config]:
    return [Config(m, p, s, prec) for m, p, s, prec in itertools.product(models, stages, schedules, precisions)]


def _choices(given: str, known: tuple[Any, ...]) -> list[Any] | None:
    """``given`` (comma-separated) as values of ``known``; ``None`` if one is not among them."""
    kind = type(known[0])
    try:
        values = [kind(v.strip()) for v in given.split(",") if v.strip()]
    except ValueError:
        return None
    return values if values and not set(values) - set(known) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds; for tests)")
    parser.add_argument("--device", default="cuda", help="'cuda' (default, cuda:0), 'cuda:N' or 'cpu' (no readings)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--stages", default=",".join(map(str, STAGES)), help="comma-separated, of 1, 2")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help=f"comma-separated, of {', '.join(SCHEDULES)}")
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help=f"comma-separated, of {', '.join(PRECISIONS)}")
    parser.add_argument("--transport", default="sequential", choices=("sequential", "local"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cuda_memory.json"))
    cli = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(cli)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print(f"cuda_memory: --device {args.device} but CUDA is not available here (torch {torch.__version__}); "
                  "run it on a CUDA GPU, or pass --device cpu to run the code paths without the readings",
                  file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    elif device.type != "cpu":
        print(f"cuda_memory: --device must be cuda, cuda:N or cpu, got {args.device!r}", file=sys.stderr)
        return 2
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or set(models) - set(MODELS):
        print(f"cuda_memory: --models {args.models!r}: choose from {', '.join(MODELS)}", file=sys.stderr)
        return 2
    axes = {flag: (_choices(getattr(args, flag), known), known)
            for flag, known in (("stages", STAGES), ("schedules", SCHEDULES), ("precisions", PRECISIONS))}
    for flag, (values, known) in axes.items():
        if values is None:
            print(f"cuda_memory: --{flag} {getattr(args, flag)!r}: choose from {', '.join(map(str, known))}",
                  file=sys.stderr)
            return 2
    stages, schedules, precisions = (values for values, _ in axes.values())
    prof = QUICK if args.quick else FULL
    t0 = time.time()
    load = load_before("the benchmark")
    torch.manual_seed(0)
    if device.type == "cuda":
        _warm_cuda(device)
    rows = []
    # A line each as it goes: a run cut short by a time limit still says how far it got.
    for cfg in _configs(models, stages, schedules, precisions):
        rows.append(r := _run(cfg, prof, device, args.transport))
        peak, pred = r["measured"]["peak_bytes"], r["predicted"]["memory_bytes"]
        print(f"{cfg.name}: planned in {r['plan_s']:.1f} s, predicted {pred / _MIB:,.1f} MiB, "
              f"peak {'n/a' if peak is None else f'{peak / _MIB:,.1f}'} MiB ({time.time() - t0:.0f} s so far)",
              flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    try:
        import transformers

        tf_version: str | None = transformers.__version__
    except ImportError:
        tf_version = None
    meta = {"benchmark": "cuda_memory", "command": shlex.join(["python", "benchmarks/cuda_memory.py", *cli]),
            "device": str(device), "device_name": name, "cuda": torch.version.cuda, "transformers": tf_version,
            **run_env(load, t0)}
    _print(rows, f"Plan's memory vs CUDA's on one {name} ({args.transport} transport, AdamW, m={prof.microbatches}, "
                 f"{prof.steps} measured steps after a warm-up; p=2: the device's peak vs the sum of both stages' "
                 "predictions)")
    write_result(args.out, {"meta": meta, "config": {**dataclasses.asdict(prof), "quick": args.quick,
                                                     "transport": args.transport, "models": models,
                                                     "stages": stages, "schedules": schedules,
                                                     "precisions": precisions},
                            "results": rows})
    return 0 if all(r["losses_finite"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
