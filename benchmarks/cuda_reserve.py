"""Benchmark: the GPU memory a plan cannot count, which the planner's memory reserve must cover.

Run (one CUDA GPU, about a minute on an H100; writes ``benchmarks/results/cuda_reserve.json``)::

    python benchmarks/cuda_reserve.py
    python benchmarks/cuda_reserve.py --quick --out /tmp/cuda_reserve.json

The plan prices what a stage's tensors take: weights, gradients, optimizer state, activations.
What a process holds on the device besides them, read from the driver (``torch.cuda.mem_get_info``:
the device's used bytes) minus what PyTorch's caching allocator has reserved:

* **context**: the CUDA context of a process that has made one allocation (the driver's and the
  runtime's own memory, the kernels' modules as they load);
* **libraries**: what the context grows by after cuBLAS, cuBLASLt and autocast matrix products
  forward and backward in fp32 and bf16 (their handles; workspaces come from the allocator);
* **NCCL**: what a one-rank NCCL process group takes once it has run an all-reduce (its
  communicator and buffers; with more ranks NCCL keeps buffers per peer and channel, so this is
  a floor);
* **allocator slack**: the caching allocator's reserved bytes above its allocated bytes at their
  peaks (``max_memory_reserved - max_memory_allocated``) over ``benchmarks/cuda_memory.py``'s
  training runs of GPT-2 (fragmentation and rounding of the blocks it caches).

* **the name's memory**: what the card's ``total_memory`` falls short of its preset's (the
  planner's capacity).

Their sum is the reserve a device needs beside the plan's bytes; the table compares it with the
planner's default reserve for the GPU measured (``partitioner.cost.devices``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cuda_memory  # noqa: E402
from lib.common import load_before, run_env, write_result  # noqa: E402

__all__ = ["main"]

_MIB = 2**20


def _outside(device: torch.device) -> int:
    """Bytes the device has in use that PyTorch's allocator did not reserve (the context, libraries, NCCL)."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) - torch.cuda.memory_reserved(device)


def _nccl_bytes(device: torch.device) -> int:
    """What a one-rank NCCL group adds outside the allocator once it has run an all-reduce."""
    before = _outside(device)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
        try:
            x = torch.ones(16 * _MIB // 4, device=device)
            dist.all_reduce(x)
            dist.barrier()
            after = _outside(device)
            del x
        finally:
            dist.destroy_process_group()
    return after - before


def _slack(quick: bool, device: torch.device) -> list[dict[str, Any]]:
    """Reserved above allocated at the peak, per training run of ``cuda_memory``'s GPT-2 configurations."""
    prof = cuda_memory.QUICK if quick else cuda_memory.FULL
    rows = []
    for cfg in cuda_memory._configs(["gpt2"]):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        r = cuda_memory._run(cfg, prof, device, "sequential")
        peak_alloc = torch.cuda.max_memory_allocated(device)
        peak_reserved = torch.cuda.max_memory_reserved(device)
        rows.append({"name": r["name"], "peak_allocated_bytes": peak_alloc, "peak_reserved_bytes": peak_reserved,
                     "slack_bytes": peak_reserved - peak_alloc})
        print(f"{r['name']}: allocated {peak_alloc / _MIB:,.0f} MiB at peak, reserved {peak_reserved / _MIB:,.0f} MiB",
              flush=True)
    return rows


def measure(device: torch.device, *, quick: bool = False) -> dict[str, Any]:
    """Every reading of the module docstring on ``device``, in bytes, and the reserve they add up to."""
    torch.empty(1, device=device)
    context = _outside(device)
    cuda_memory._warm_cuda(device)
    libraries = _outside(device) - context
    nccl = _nccl_bytes(device) if dist.is_nccl_available() else None
    slack = _slack(quick, device)
    worst = max(r["slack_bytes"] for r in slack)
    total = context + libraries + (nccl or 0) + worst
    return {"context_bytes": context, "libraries_bytes": libraries, "nccl_one_rank_bytes": nccl,
            "allocator_slack_bytes": worst, "needed_reserve_bytes": total,
            "capacity_bytes": torch.cuda.get_device_properties(device).total_memory, "runs": slack}


def _default_reserve() -> tuple[str, float]:
    """This machine's device preset (``default_device``) and the reserve the planner gives it by default."""
    from partitioner.cost.devices import DEVICE_PRESETS, default_device

    preset = default_device()
    return preset, float(DEVICE_PRESETS[preset].memory_reserve)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny training runs (seconds)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cuda_reserve.json"))
    cli = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(cli)
    if not torch.cuda.is_available():
        print(f"cuda_reserve: CUDA is not available here (torch {torch.__version__}): the readings are the "
              "driver's; run it on a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    load = load_before("the benchmark")
    device = torch.device("cuda", torch.cuda.current_device())
    got = measure(device, quick=args.quick)
    name = torch.cuda.get_device_name(device)
    preset, default = _default_reserve()
    from partitioner.cost.devices import DEVICE_PRESETS

    # The preset's memory is the card's name (80 GB); torch sees less: that gap is reserve too.
    shortfall = max(0.0, DEVICE_PRESETS[preset].memory - got["capacity_bytes"]) if preset != "cpu" else 0.0
    got["preset_shortfall_bytes"] = shortfall
    got["needed_reserve_bytes"] += shortfall
    got["preset"], got["default_reserve_bytes"] = preset, default
    lines = [
        ("card's memory short of the preset's", shortfall),
        ("CUDA context", got["context_bytes"]),
        ("cuBLAS/cuBLASLt handles", got["libraries_bytes"]),
        ("NCCL, one rank", got["nccl_one_rank_bytes"]),
        ("allocator slack at peak (worst run)", got["allocator_slack_bytes"]),
        ("needed beside the plan", got["needed_reserve_bytes"]),
        (f"planner's default reserve ({preset})", default),
    ]
    got["covered"] = default >= got["needed_reserve_bytes"]
    print(f"outside the plan's bytes on one {name} ({got['capacity_bytes'] / 2**30:.1f} GiB):")
    for label, b in lines:
        print(f"  {label:<40} {'n/a' if b is None else f'{b / _MIB:>9,.0f} MiB'}")
    print(f"  the default reserve {'covers' if got['covered'] else 'does NOT cover'} what was measured")
    meta = {"benchmark": "cuda_reserve", "command": shlex.join(["python", "benchmarks/cuda_reserve.py", *cli]),
            "device_name": name, "cuda": torch.version.cuda, **run_env(load, t0)}
    write_result(args.out, {"meta": meta, "config": {"quick": args.quick}, "results": got})
    return 0


if __name__ == "__main__":
    sys.exit(main())
