"""The split-backward benchmark runs on a tiny stage, checks its gradients, and writes what it promises."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_split_backward_benchmark_quick(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("_bench_split_backward", ROOT / "benchmarks" / "split_backward.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "sb.json"
    args = ["--layers", "2", "--width", "32", "--rows", "8", "--repeat", "3", "--warmup", "1", "--out", str(out)]
    assert bench.main(args) == 0
    res = json.loads(out.read_text())["results"]
    assert res["fused"]["B_s"] > 0
    for way in ("split", "rewalk"):
        r = res[way]
        assert r["I_s"] > 0 and r["W_s"] > 0
        assert abs(r["ratio_to_B"] - r["total_s"] / res["fused"]["B_s"]) < 1e-12
