"""What checksumming a checkpoint costs (issue 31): hash throughput, and save / verify times.

Three measurements, each the best of ``--repeat`` runs, on one process:

* **algorithms**: GiB/s of ``zlib.crc32`` (what pipecut's manifest uses), ``zlib.adler32``,
  ``hashlib.sha256`` and ``hashlib.blake2b`` over one in-memory buffer (one core);
* **checkpoint**: a DCP checkpoint of ``--gib`` GiB of float32 tensors written by ``dcp.save``
  (4 writer threads, so 4 ``.distcp`` files); then ``digest_files`` of it on 1 and 4 threads (what
  a save adds), ``verify_manifest`` (what a load adds) and ``dcp.load`` for scale;
* **export**: the same tensors as one safetensors file (``save_file``), digested per tensor.

Files are read back from the page cache (just written), so these are hashing, not disk, speeds;
a cold read is bounded by the disk.

    python benchmarks/integrity.py              # 1 GiB
    python benchmarks/integrity.py --quick      # 64 MiB, a smoke run

Prints a table and writes ``benchmarks/results/integrity.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helpers in lib/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages first

from lib.common import load_before, run_env, write_result
from runtime.state.integrity import digest_files, verify_manifest, write_manifest

GIB = 1 << 30


def _best(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def algorithms(nbytes: int, repeat: int) -> dict[str, float]:
    """GiB/s of each algorithm over one buffer of ``nbytes``."""
    buf = memoryview(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy().tobytes())
    fns: dict[str, Callable[[], Any]] = {
        "crc32": lambda: zlib.crc32(buf), "adler32": lambda: zlib.adler32(buf),
        "sha256": lambda: hashlib.sha256(buf).digest(), "blake2b": lambda: hashlib.blake2b(buf).digest(),
    }
    return {name: nbytes / GIB / _best(fn, repeat) for name, fn in fns.items()}


def _tensors(nbytes: int) -> dict[str, torch.Tensor]:
    """``nbytes`` of float32 in 64 MiB tensors (a large model's layer matrices)."""
    per = min(nbytes, 64 << 20) // 4
    return {f"model.layers.{i}.weight": torch.randn(per) for i in range(max(1, nbytes // (per * 4)))}


def checkpoint(root: Path, tensors: dict[str, torch.Tensor], repeat: int) -> dict[str, float]:
    """Seconds of a DCP save, its digest (1 and 4 threads), verification and a load."""
    import torch.distributed.checkpoint as dcp

    folder = root / "ckpt"
    writer = dcp.FileSystemWriter(str(folder), thread_count=4)
    save = _best(lambda: (shutil.rmtree(folder, ignore_errors=True),
                          dcp.save(tensors, storage_writer=writer, no_dist=True)), 1)
    names = [p.name for p in folder.iterdir()]
    one = _best(lambda: digest_files(folder, names, threads=1), repeat)
    four = _best(lambda: digest_files(folder, names, threads=4), repeat)
    write_manifest(folder, digest_files(folder, names))
    verify = _best(lambda: verify_manifest(folder), repeat)
    into = {k: torch.empty_like(v) for k, v in tensors.items()}
    load = _best(lambda: dcp.load(into, checkpoint_id=str(folder), no_dist=True), 1)
    return {"files": len(names), "save_s": save, "digest_1thread_s": one, "digest_4threads_s": four,
            "verify_s": verify, "load_s": load}


def export(root: Path, tensors: dict[str, torch.Tensor], repeat: int) -> dict[str, float]:
    """Seconds of writing one safetensors file and of its per-tensor digest."""
    from safetensors.torch import save_file

    file = root / "model.safetensors"
    save = _best(lambda: save_file(tensors, str(file)), 1)
    digest = _best(lambda: digest_files(root, [file.name]), repeat)
    return {"save_s": save, "digest_s": digest}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="64 MiB, one run: a smoke test")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "integrity.json"))
    args = parser.parse_args(argv)
    nbytes = (64 << 20) if args.quick else int(args.gib * GIB)
    repeat = 1 if args.quick else args.repeat
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist, on purpose
    started, load = time.time(), load_before("hashing")
    algos = algorithms(min(nbytes, 256 << 20), repeat)
    tensors = _tensors(nbytes)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    root = Path(tempfile.mkdtemp(prefix="pipecut-integrity-"))
    try:
        ckpt = checkpoint(root, tensors, repeat)
        exp = export(root, tensors, repeat)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gib = total / GIB
    print("hash throughput, one core (GiB/s): " + ", ".join(f"{k} {v:.2f}" for k, v in algos.items()))
    print(f"{'checkpoint of ' + f'{gib:.2f} GiB':<34} {'seconds':>8} {'GiB/s':>7}")
    rows = [("dcp.save (4 writer threads)", ckpt["save_s"]), ("digest, 1 thread", ckpt["digest_1thread_s"]),
            ("digest, 4 threads", ckpt["digest_4threads_s"]), ("verify_manifest (load adds)", ckpt["verify_s"]),
            ("dcp.load", ckpt["load_s"]), ("safetensors save_file", exp["save_s"]),
            ("safetensors digest, per tensor", exp["digest_s"])]
    for name, s in rows:
        print(f"{name:<34} {s:>8.3f} {gib / s:>7.2f}")
    result = {"bytes": total, "algorithms_gib_s": algos, "checkpoint": ckpt, "export": exp,
              "env": run_env(load, started)}
    if not args.quick or args.out != parser.get_default("out"):
        write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
