"""Benchmark: how far the preset ``"cpu"`` roofline is from a measured step, and what calibration changes.

Run (CPU, a minute or two; 2 gloo processes with one thread each; writes
``benchmarks/results/calibration.json``)::

    python benchmarks/calibration.py
    python benchmarks/calibration.py --layers 4 --width 256 --seq 128 --rows 2 --microbatches 4 --steps 4 --rounds 6

One small GPT-2 (``partitioner.zoo.gpt2``: vocabulary 1024, no dropout), cut into the same 2 stages
for both plans (stage 1 begins at ``transformer.h.{layers // 2}``), 1F1B over ``m`` micro-batches
of ``rows`` sequences, cross-entropy loss, no optimizer (the plan's step time excludes the update):

* ``preset``: planned for ``Cluster.uniform(2, "cpu")``;
* ``calibrated``: planned for ``Cluster.measure``-d numbers of this host, with the model's own GEMM
  sizes (``Probe().with_gemms(model_gemms(...))``), measured in 2 processes before the run.

The same pipeline then trains in 2 gloo processes (``PipelineTrainer(transport='dist')``); each
step starts after a barrier and lasts from the first rank's start to the last rank's end. The
machine is shared with other work whose load swings within seconds, so the training processes
themselves re-measure the compute (``measure_compute`` on both ranks at once, the model's 4
heaviest GEMMs in fp32, 0.1 s windows) right before each round of ``--steps`` steps; each round's
calibrated prediction uses that round's compute figures and the links measured before the run.
Reported per round: the measured median step, each plan's predicted 1F1B step and predicted /
measured; then the medians over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from lib.common import load_before, run_env, step_times, write_result  # noqa: E402
from partitioner import Cluster, partition  # noqa: E402
from partitioner.cost import calibrate  # noqa: E402
from partitioner.cost.gemms import model_gemms  # noqa: E402
from partitioner.cost.probes import Probe, measure_compute  # noqa: E402
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


def _worker(rank: int, world: int, cfg: dict[str, Any], cluster: Cluster, probe: Probe) -> list[Any]:
    trainer = PipelineTrainer(_plan(cfg, cluster), _loss, None, execution=Execution(schedule="1f1b", transport="dist"))
    g = torch.Generator().manual_seed(1)
    batch = cfg["rows"] * cfg["microbatches"]
    x = torch.randint(0, VOCAB, (batch, cfg["seq"]), generator=g)
    y = torch.randint(0, VOCAB, (batch, cfg["seq"]), generator=g)

    def step() -> tuple[float, float]:
        trainer.zero_grad()
        dist.barrier()
        t0 = time.perf_counter()
        trainer.forward_backward(x, y)
        return t0, time.perf_counter()

    for _ in range(cfg["warmup"]):
        step()
    rounds = []
    for _ in range(cfg["rounds"]):
        # Both ranks probe at once, as Cluster.measure does, right before the steps they predict.
        dist.barrier()
        speed = measure_compute(probe)
        rounds.append((speed, [step() for _ in range(cfg["steps"])]))
    return rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rows", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6, help="probe-then-train rounds")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/calibration.json"))
    cfg = vars(ap.parse_args())
    started, load = time.time(), load_before("the calibration benchmark")

    model, ids = _model(cfg)
    gemms = model_gemms(trace(model, (ids,)))
    cal = calibrate.measure(2, probe=Probe().with_gemms(gemms))  # links, and a first compute figure
    preset = _predict(cfg, Cluster.uniform(2, "cpu"))
    quick = Probe(gemms=tuple(gemms.items()), max_gemms=4, dtypes=("float32",), min_time=0.1)
    per_rank = spawn(_worker, 2, cfg, Cluster.from_calibration(cal), quick, timeout=1800)
    rounds = []
    for r, ranks in enumerate(zip(*per_rank)):
        speed = calibrate.combine([speed for speed, _ in ranks])
        calibrated = _predict(cfg, Cluster.from_calibration(replace(cal, compute=speed)))
        measured = step_times([{"step": spans} for _, spans in ranks])["step"]
        median = statistics.median(measured)
        rounds.append({"measured_step_s": measured, "measured_median_s": median, "preset_predicted_s": preset,
                       "calibrated_predicted_s": calibrated, "fp32_flops": speed.flops["float32"],
                       "mem_bandwidth": speed.memory.bandwidth, "op_overhead": speed.op_overhead})
        print(f"round {r}: measured median {median * 1e3:.1f} ms; preset predicts {preset * 1e3:.1f} ms "
              f"({preset / median:.2f}x), calibrated {calibrated * 1e3:.1f} ms ({calibrated / median:.2f}x); "
              f"fp32 {speed.flops['float32'] / 1e9:.0f} GFLOP/s, {speed.memory.bandwidth / 1e9:.1f} GB/s, "
              f"{speed.op_overhead * 1e6:.1f} us per op, per process")
    ratios = {k: statistics.median(rd[f"{k}_predicted_s"] / rd["measured_median_s"] for rd in rounds)
              for k in ("preset", "calibrated")}
    errors = {k: statistics.median(abs(rd[f"{k}_predicted_s"] / rd["measured_median_s"] - 1) for rd in rounds)
              for k in ("preset", "calibrated")}
    print(f"over {len(rounds)} rounds, median predicted / measured: preset {ratios['preset']:.2f}, calibrated "
          f"{ratios['calibrated']:.2f}; median |predicted / measured - 1|: preset {errors['preset']:.2f}, "
          f"calibrated {errors['calibrated']:.2f}")
    write_result(cfg["out"], {"config": cfg, "calibration": cal.summary(), "rounds": rounds,
                              "predicted_over_measured": ratios, "abs_error": errors, "env": run_env(load, started)})


def _predict(cfg: dict[str, Any], cluster: Cluster) -> float:
    return float(next(p.step_time for p in _plan(cfg, cluster).predictions if p.schedule == "1f1b"))


if __name__ == "__main__":
    main()
