"""The split-backward benchmark runs on a tiny stage, checks its gradients, and writes what it promises."""

from __future__ import annotations

import json
from pathlib import Path

from bench_script import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_split_backward_benchmark_quick(tmp_path: Path) -> None:
    bench = load_script("split_backward")
    out = tmp_path / "sb.json"
    args = ["--layers", "2", "--width", "32", "--rows", "8", "--repeat", "3", "--warmup", "1", "--out", str(out)]
    assert bench.main(args) == 0
    res = json.loads(out.read_text())["results"]
    assert res["fused"]["B_s"] > 0
    for way in ("split", "rewalk"):
        r = res[way]
        assert r["I_s"] > 0 and r["W_s"] > 0
        assert abs(r["ratio_to_B"] - r["total_s"] / res["fused"]["B_s"]) < 1e-12
