"""The pipecut-vs-torch benchmark runs end to end on a tiny model and writes its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multiprocess
def test_runtime_vs_torch_quick(tmp_path: Path) -> None:
    # A subprocess, as users run it: its spawned ranks re-import the script as __main__.
    out = tmp_path / "rvt.json"
    argv = ["--steps", "2", "--warmup", "1", "--width", "64", "--layers", "4", "--batch", "16",
            "--microbatches", "4", "--timeout", "300", "--out", str(out)]
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "runtime_vs_torch.py"), *argv],
        capture_output=True, text=True, timeout=400, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    for name in ("pipecut gpipe dist", "torch gpipe", "pipecut 1f1b dist", "torch 1f1b", "single micro-batched"):
        assert data["results"][name]["median_ms"] > 0, name
    assert any("pipecut throughput / torch throughput" in k for k in data["ratios"])
