"""Benchmark: how far the preset ``"cpu"`` roofline is from a measured step, and what calibration changes.

Run (CPU, a minute or two; 2 gloo processes with one thread each; writes
``benchmarks/results/calibration.json``)::

    python benchmarks/calibration.py
    python benchmarks/calibration.py --layers 4 --width 256 --seq 128 --rows 2 --microbatches 4 --steps 10

One small GPT-2 (``partitioner.zoo.gpt2``: vocabulary 1024, no dropout), cut into the same 2 stages
for both plans (stage 1 begins at ``transformer.h.{layers // 2}``), 1F1B over ``m`` micro-batches
of ``rows`` sequences, cross-entropy loss, no optimizer (the plan's step time excludes the update):

* ``preset``: planned for ``Cluster.uniform(2, "cpu")``;
* ``calibrated``: planned for ``Cluster.measure``-d numbers of this host, with the model's own GEMM
  sizes (``Probe().with_gemms(model_gemms(...))``), measured right before the run in 2 processes.

The same pipeline then trains in 2 gloo processes (``PipelineTrainer(transport='dist')``); each
step starts after a barrier and lasts from the first rank's start to the last rank's end. The
machine is shared, so each of ``--rounds`` rounds measures the host and then the run, back to
back. Reported per round: the measured median step, each plan's predicted 1F1B step and predicted /
measured; then the median ratio over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from _common import load_before, run_env, step_times, write_result  # noqa: E402
from partitioner import Cluster, partition  # noqa: E402
from partitioner.cost import calibrate  # noqa: E402
from partitioner.cost.gemms import model_gemms  # noqa: E402
from partitioner.cost.probes import Probe  # noqa: E402
from partitioner.tracing.trace import trace  # noqa: E402
from partitioner.zoo import gpt2  # noqa: E402
from runtime.options import Execution  # noqa: E402
from runtime.trainer import PipelineTrainer  # noqa: E402
from runtime.transport.launch import spawn  # noqa: E402

VOCAB = 1024


def _model(cfg: dict[str, Any]) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model, (ids,) = gpt2(n_layer=cfg["layers"], n_embd=cfg["width"], n_head=4, vocab_size=VOCAB,
                         n_positions=cfg["seq"], batch=cfg["rows"], seq=cfg["seq"])
    return model, ids


def _plan(cfg: dict[str, Any], cluster: Cluster) -> Any:
    model, ids = _model(cfg)
    return partition(model, (ids,), 2, cluster=cluster, microbatches=cfg["microbatches"], schedule="1f1b",
                     split_points=[f"model.transformer.h.{cfg['layers'] // 2}"])


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _worker(rank: int, world: int, cfg: dict[str, Any], cluster: Cluster) -> list[tuple[float, float]]:
    trainer = PipelineTrainer(_plan(cfg, cluster), _loss, None, execution=Execution(schedule="1f1b", transport="dist"))
    g = torch.Generator().manual_seed(1)
    batch = cfg["rows"] * cfg["microbatches"]
    x = torch.randint(0, VOCAB, (batch, cfg["seq"]), generator=g)
    y = torch.randint(0, VOCAB, (batch, cfg["seq"]), generator=g)
    spans = []
    for i in range(cfg["warmup"] + cfg["steps"]):
        trainer.zero_grad()
        dist.barrier()
        t0 = time.perf_counter()
        trainer.forward_backward(x, y)
        t1 = time.perf_counter()
        if i >= cfg["warmup"]:
            spans.append((t0, t1))
    return spans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rows", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="calibrate-then-train rounds")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/calibration.json"))
    cfg = vars(ap.parse_args())
    started, load = time.time(), load_before("the calibration benchmark")

    model, ids = _model(cfg)
    probe = Probe().with_gemms(model_gemms(trace(model, (ids,))))
    preset = next(p.step_time for p in _plan(cfg, Cluster.uniform(2, "cpu")).predictions if p.schedule == "1f1b")
    rounds = []
    for r in range(cfg["rounds"]):  # the machine is shared: measure the host and the run together, each round
        cal = calibrate.measure(2, probe=probe)
        cluster = Cluster.from_calibration(cal)
        calibrated = next(p.step_time for p in _plan(cfg, cluster).predictions if p.schedule == "1f1b")
        per_rank = spawn(_worker, 2, cfg, cluster, timeout=1200)
        measured = step_times([{"step": spans} for spans in per_rank])["step"]
        median = statistics.median(measured)
        rounds.append({"measured_step_s": measured, "measured_median_s": median, "preset_predicted_s": preset,
                       "calibrated_predicted_s": calibrated, "calibration": cal.summary()})
        print(f"round {r}: measured median {median * 1e3:.1f} ms; preset predicts {preset * 1e3:.1f} ms "
              f"({preset / median:.2f}x), calibrated {calibrated * 1e3:.1f} ms ({calibrated / median:.2f}x); "
              f"measured fp32 {cal.compute.flops['float32'] / 1e9:.0f} GFLOP/s per process")
    ratios = {k: statistics.median(rd[f"{k}_predicted_s"] / rd["measured_median_s"] for rd in rounds)
              for k in ("preset", "calibrated")}
    print(f"median predicted / measured over {len(rounds)} rounds: preset {ratios['preset']:.2f}, "
          f"calibrated {ratios['calibrated']:.2f}")
    write_result(cfg["out"], {"config": cfg, "rounds": rounds, "predicted_over_measured": ratios,
                              "env": run_env(load, started)})


if __name__ == "__main__":
    main()
