"""The recomputation benchmark runs on a tiny GPT-2, checks its gradients, and writes what it promises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench_script import load_script

pytest.importorskip("transformers")  # it plans a GPT-2

ROOT = Path(__file__).resolve().parents[2]


def test_recompute_benchmark_quick(tmp_path: Path) -> None:
    bench = load_script("recompute")
    out = tmp_path / "rc.json"
    args = ["--layers", "2", "--width", "32", "--heads", "2", "--vocab", "64", "--seq", "16", "--repeat", "1",
            "--out", str(out)]
    assert bench.main(args) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "recompute" and data["command"].endswith(" ".join(args))
    rows = data["results"]
    assert [r["stage"] for r in rows] == [0, 1]
    for r in rows:
        assert r["saved_bytes_recompute_forward"] == 0  # a recomputing forward saves nothing
        assert 0 < r["input_bytes"] < r["saved_bytes_plain"]
        assert r["memory_ratio"] == pytest.approx(r["memory_saved_measured"] / r["memory_saved_predicted"])
        assert r["backward_added_s_predicted"] > 0 and r["forward_s_measured"] > 0
