"""Benchmark: split backward (I then W, as zero-bubble schedules run it) against one fused backward.

Run (CPU, one thread, about 10 seconds)::

    python benchmarks/split_backward.py
    python benchmarks/split_backward.py --layers 8 --width 512 --rows 256 --repeat 40 \
        --out benchmarks/results/split_backward.json

One stage: ``layers`` x (Linear(width, width), GELU), its input requiring grad (a middle stage).
Per round, three fresh forwards, each followed by one way of doing its backward, in rotating
order so a noisy machine slows them alike:

* ``fused``: ``torch.autograd.backward(outputs, grads)``, what a ``B`` action runs;
* ``split``: ``runtime.execute.split_backward``: ``backward_input`` (``I``: input gradients, capturing
  the gradient at each weight's branch node) then ``backward_weight`` (``W``: autograd from the
  branch nodes to the weights only);
* ``rewalk``: the naive split: ``I`` as ``autograd.grad(outputs, inputs, retain_graph=True)``,
  ``W`` as ``autograd.grad(outputs, params)``, which walks the activation gradients again;
* ``fused+wgrad`` / ``split+wgrad``: ``fused`` and ``split`` on the same stage rewritten by
  ``runtime.execute.wgrad_fusion`` (what the trainer runs by default): each Linear adds its weight
  gradient into ``.grad`` with ``addmm_``, and under split backward ``I`` only records that GEMM
  for ``W`` to run.

Reported: medians over ``--repeat`` rounds after ``--warmup`` of each part, and ``(I + W) / B``.
Before timing, the split gradients are checked against the fused ones.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from runtime.execute.split_backward import backward_input, backward_weight
from runtime.execute.wgrad_fusion import fuse_weight_grad_accumulation, fused_params


def _stage(layers: int, width: int) -> nn.Module:
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.GELU())])


Way = Callable[[], tuple[float, float]]
Forward = Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _ways(model: nn.Module, rows: int, width: int, fused: list[nn.Parameter]) -> tuple[Forward, Way, Way]:
    """A fresh forward of ``model``, and its fused backward and its split backward, each timed."""
    params = list(model.parameters())

    def forward() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(rows, width, requires_grad=True)
        y = model(x)
        return x, y, torch.randn_like(y)

    def whole() -> tuple[float, float]:
        _, y, g = forward()
        t0 = time.perf_counter()
        torch.autograd.backward([y], [g])
        return time.perf_counter() - t0, 0.0

    def split() -> tuple[float, float]:
        x, y, g = forward()
        t0 = time.perf_counter()
        _, pending = backward_input([y], [g], [x], params, fused)
        t1 = time.perf_counter()
        backward_weight(pending)
        return t1 - t0, time.perf_counter() - t1

    return forward, whole, split


def run(layers: int, width: int, rows: int, repeat: int, warmup: int) -> dict[str, Any]:
    """Time the five ways; returns medians in seconds and the ratios to their fused ``B``."""
    torch.manual_seed(0)
    model = _stage(layers, width)
    params = list(model.parameters())
    forward, fused, split = _ways(model, rows, width, [])

    def rewalk() -> tuple[float, float]:
        x, y, g = forward()
        t0 = time.perf_counter()
        torch.autograd.grad([y], [x], [g], retain_graph=True)
        t1 = time.perf_counter()
        torch.autograd.grad([y], params, [g])
        return t1 - t0, time.perf_counter() - t1

    fmodel = fx.symbolic_trace(copy.deepcopy(model))
    fuse_weight_grad_accumulation(fmodel, min_numel=1)
    fw = list(fused_params(fmodel))
    forward_w, fused_wgrad, split_wgrad = _ways(fmodel, rows, width, fw)

    _check(model, forward, params)
    _check(fmodel, forward_w, list(fmodel.parameters()), fw)
    ways: dict[str, Way] = {
        "fused": fused, "split": split, "rewalk": rewalk, "fused+wgrad": fused_wgrad, "split+wgrad": split_wgrad,
    }
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in ways}
    names = list(ways)
    for i in range(warmup + repeat):
        for k in names[i % len(names) :] + names[: i % len(names)]:
            t = ways[k]()
            if i >= warmup:
                times[k].append(t)
    model.zero_grad()
    fmodel.zero_grad()
    out: dict[str, Any] = {}
    for k, ts in times.items():
        first = statistics.median(t[0] for t in ts)
        second = statistics.median(t[1] for t in ts)
        total = statistics.median(t[0] + t[1] for t in ts)
        out[k] = {"B_s": total} if k.startswith("fused") else {"I_s": first, "W_s": second, "total_s": total}
    for k, base in (("split", "fused"), ("rewalk", "fused"), ("split+wgrad", "fused+wgrad")):
        b = out[base]["B_s"]
        out[k]["ratio_to_B"] = out[k]["total_s"] / b
        out[k]["W_to_half_B"] = out[k]["W_s"] / (b / 2)
    out["fused+wgrad"]["ratio_to_plain_B"] = out["fused+wgrad"]["B_s"] / out["fused"]["B_s"]
    return out


def _check(
    model: nn.Module, forward: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    params: list[nn.Parameter], fused: list[nn.Parameter] | None = None,
) -> None:
    x, y, g = forward()
    model.zero_grad()
    torch.autograd.backward([y], [g])
    want_x, want = x.grad, [p.grad.clone() for p in params]
    model.zero_grad()
    x2 = x.detach().requires_grad_(True)
    y2 = model(x2)
    (gx,), pending = backward_input([y2], [g], [x2], params, fused or ())
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
    print(f"{args.layers} x Linear({args.width}, {args.width}) + GELU, {args.rows} rows, {args.threads} thread(s)")
    for k in ("fused", "split", "rewalk", "fused+wgrad", "split+wgrad"):
        r = res[k]
        if k.startswith("fused"):
            print(f"  {k:11s} B {r['B_s'] * 1e3:8.2f} ms")
            continue
        base = "fused+wgrad" if k.endswith("wgrad") else "fused"
        print(f"  {k:11s} I {r['I_s'] * 1e3:7.2f} ms + W {r['W_s'] * 1e3:7.2f} ms = {r['total_s'] * 1e3:7.2f} ms"
              f"  ({r['ratio_to_B']:.2f} x {base} B)")
    if args.out:
        meta = {"args": vars(args), "torch": torch.__version__, "machine": platform.machine(),
                "cpus": os.cpu_count(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                "wall_s": time.time() - t0}
        Path(args.out).write_text(json.dumps({"meta": meta, "results": res}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
