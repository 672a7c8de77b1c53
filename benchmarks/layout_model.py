"""The layout benchmark's GPT-2 as ``file.py:factory`` models for the command line, and the benchmark's
calibration through that command line (``benchmarks/layout.py --cli-calibrate``).

Run (what ``--cli-calibrate`` runs; the fitted cluster is then ``--cluster`` for the benchmark or
``--calibrate`` for ``pipecut plan``)::

    pipecut calibrate --model benchmarks/layout_model.py:model --devices 4 --global-batch 16 --out cluster.json
    pipecut plan benchmarks/layout_model.py:model --devices 4 --global-batch 16 --calibrate cluster.json

``model`` is the benchmark's default GPT-2 (4 layers, width 128, 4 heads, vocabulary 2048,
sequence 64), ``model_quick`` its ``--quick`` one; each returns the model and one row of token ids,
built as the benchmark builds it (the same seed, so the same weights).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # this checkout's packages, however the file is loaded
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from partitioner.zoo import gpt2  # noqa: E402

__all__ = ["CONFIGS", "build", "model", "model_quick", "factory_for", "calibrate_with_cli"]

# factory name -> the benchmark's model flags (--n-layer, --n-embd, --n-head, --vocab, --seq)
CONFIGS: dict[str, dict[str, int]] = {
    "model": {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab": 2048, "seq": 64},
    "model_quick": {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab": 128, "seq": 16},
}


def build(*, n_layer: int, n_embd: int, n_head: int, vocab: int, seq: int) -> nn.Module:
    """The benchmark's GPT-2 (Hugging Face, tied embedding, dropout 0), seeded: the same weights every call."""
    torch.manual_seed(1234)
    built, _ = gpt2(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab, n_positions=seq, batch=1,
                    seq=seq)
    return built


def _factory(name: str) -> tuple[nn.Module, tuple[torch.Tensor]]:
    cfg = CONFIGS[name]
    ids = torch.randint(0, cfg["vocab"], (1, cfg["seq"]), generator=torch.Generator().manual_seed(7))
    return build(**cfg), (ids,)


def model() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The benchmark's default GPT-2 and one row of token ids."""
    return _factory("model")


def model_quick() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The benchmark's ``--quick`` GPT-2 and one row of token ids."""
    return _factory("model_quick")


def factory_for(cfg: dict[str, Any]) -> str | None:
    """The factory whose model is the one ``cfg`` (the benchmark's settings) describes, or ``None``.

    Example:
        >>> factory_for({"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab": 2048, "seq": 64, "batch": 16})
        'model'
    """
    return next((name for name, c in CONFIGS.items() if all(cfg.get(k) == v for k, v in c.items())), None)


def calibrate_with_cli(factory: str, devices: int, global_batch: int, out: str | Path, *,
                       quick: bool = False, timeout: float = 900.0) -> dict[str, Any]:
    """Run ``pipecut calibrate --model benchmarks/layout_model.py:FACTORY`` in a fresh process (this
    checkout's packages first), its output shown as it runs; return the command, its wall time and
    what the file says it was fitted on. ``quick`` passes ``--quick`` (tiny probes, fewer timed steps).

    Raises:
        RuntimeError: the command failed or ran past ``timeout`` (its exit code in the message).
    """
    spec = f"{Path(__file__).resolve().relative_to(ROOT)}:{factory}"
    cmd = [sys.executable, "-m", "pipecut", "calibrate", "--model", spec, "--devices", str(devices),
           "--global-batch", str(global_batch), "--timeout", str(timeout), "--out", str(out),
           *(["--quick"] if quick else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, timeout=2 * timeout + 60, check=False)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{' '.join(cmd)} ran past {e.timeout:.0f} s") from e
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited with code {done.returncode}")
    details = json.loads(Path(out).read_text())["details"]
    shown = ["pipecut", *cmd[3:]]
    return {"command": " ".join(shown), "wall_s": time.perf_counter() - t0, "fitted_to": details.get("fitted_to")}
