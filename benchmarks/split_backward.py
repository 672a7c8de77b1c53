"""Benchmark: split backward (I then W, as zero-bubble schedules run it) against one fused backward.

Run (CPU, one thread, about 10 seconds)::

    python benchmarks/split_backward.py
    python benchmarks/split_backward.py --layers 8 --width 512 --rows 256 --repeat 40 \
        --out benchmarks/results/split_backward.json

One stage: ``layers`` x (Linear(width, width), GELU), its input requiring grad (a middle stage).
Per round, three fresh forwards, each followed by one way of doing its backward, in rotating
order so a noisy machine slows them alike:

* ``fused``: ``torch.autograd.backward(outputs, grads)``, what a ``B`` action runs;
* ``split``: ``runtime.split_backward``: ``backward_input`` (``I``: input gradients, capturing
  the gradient at each weight's branch node) then ``backward_weight`` (``W``: autograd from the
  branch nodes to the weights only);
* ``rewalk``: the naive split: ``I`` as ``autograd.grad(outputs, inputs, retain_graph=True)``,
  ``W`` as ``autograd.grad(outputs, params)``, which walks the activation gradients again.

Reported: medians over ``--repeat`` rounds after ``--warmup`` of each part, and ``(I + W) / B``.
Before timing, the split gradients are checked against the fused ones.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runtime.split_backward import backward_input, backward_weight


def _stage(layers: int, width: int) -> nn.Module:
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.GELU())])


def run(layers: int, width: int, rows: int, repeat: int, warmup: int) -> dict[str, Any]:
    """Time the three ways; returns medians in seconds and the ratios to ``fused``."""
    torch.manual_seed(0)
    model = _stage(layers, width)
    params = list(model.parameters())

    def forward() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(rows, width, requires_grad=True)
        y = model(x)
        return x, y, torch.randn_like(y)

    def fused() -> tuple[float, float]:
        _, y, g = forward()
        t0 = time.perf_counter()
        torch.autograd.backward([y], [g])
        return time.perf_counter() - t0, 0.0

    def split() -> tuple[float, float]:
        x, y, g = forward()
        t0 = time.perf_counter()
        _, pending = backward_input([y], [g], [x], params)
        t1 = time.perf_counter()
        backward_weight(pending)
        return t1 - t0, time.perf_counter() - t1

    def rewalk() -> tuple[float, float]:
        x, y, g = forward()
        t0 = time.perf_counter()
        torch.autograd.grad([y], [x], [g], retain_graph=True)
        t1 = time.perf_counter()
        torch.autograd.grad([y], params, [g])
        return t1 - t0, time.perf_counter() - t1

    _check(model, forward, params)
    ways: dict[str, Callable[[], tuple[float, float]]] = {"fused": fused, "split": split, "rewalk": rewalk}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in ways}
    names = list(ways)
    for i in range(warmup + repeat):
        for k in names[i % 3 :] + names[: i % 3]:
            t = ways[k]()
            if i >= warmup:
                times[k].append(t)
    model.zero_grad()
    out: dict[str, Any] = {}
    for k, ts in times.items():
        first = statistics.median(t[0] for t in ts)
        second = statistics.median(t[1] for t in ts)
        total = statistics.median(t[0] + t[1] for t in ts)
        out[k] = {"I_s": first, "W_s": second, "total_s": total} if k != "fused" else {"B_s": total}
    b = out["fused"]["B_s"]
    for k in ("split", "rewalk"):
        out[k]["ratio_to_B"] = out[k]["total_s"] / b
        out[k]["W_to_half_B"] = out[k]["W_s"] / (b / 2)
    return out


def _check(model: nn.Module, forward: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]], params: list[nn.Parameter]) -> None:
    x, y, g = forward()
    model.zero_grad()
    torch.autograd.backward([y], [g])
    want_x, want = x.grad, [p.grad.clone() for p in params]
    model.zero_grad()
    x2 = x.detach().requires_grad_(True)
    y2 = model(x2)
    (gx,), pending = backward_input([y2], [g], [x2], params)
    backward_weight(pending)
    torch.testing.assert_close(gx, want_x)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w)
    model.zero_grad()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--rows", type=int, default=256, help="rows of the micro-batch")
    ap.add_argument("--repeat", type=int, default=40, help="timed rounds (median over these)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="", help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    load_before = os.getloadavg()
    res = run(args.layers, args.width, args.rows, args.repeat, args.warmup)
    b = res["fused"]["B_s"]
    print(f"{args.layers} x Linear({args.width}, {args.width}) + GELU, {args.rows} rows, {args.threads} thread(s)")
    print(f"  fused B          {b * 1e3:8.2f} ms")
    for k in ("split", "rewalk"):
        r = res[k]
        print(f"  {k:7s} I {r['I_s'] * 1e3:7.2f} ms + W {r['W_s'] * 1e3:7.2f} ms = {r['total_s'] * 1e3:7.2f} ms"
              f"  ({r['ratio_to_B']:.2f} x B)")
    if args.out:
        meta = {"args": vars(args), "torch": torch.__version__, "machine": platform.machine(),
                "cpus": os.cpu_count(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                "wall_s": time.time() - t0}
        Path(args.out).write_text(json.dumps({"meta": meta, "results": res}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
