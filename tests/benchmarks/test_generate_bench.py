"""The generation benchmark runs end to end on a tiny Llama over 2 gloo processes and writes what it promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # it generates with a Llama

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multiprocess
def test_generate_benchmark_quick(tmp_path: Path) -> None:
    # A subprocess, as users run it: its spawned ranks re-import the script as __main__.
    out = tmp_path / "generate.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "generate.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "pipelined/one group" in run.stdout and "time per new token" in run.stdout
    data = json.loads(out.read_text())
    assert data["benchmark"] == "generate" and data["command"].endswith("--quick --out " + str(out))
    rows = data["results"]
    assert [r["sequences"] for r in rows] == [1, 4] and [r["groups_in_flight"] for r in rows] == [1, 2]
    for r in rows:
        assert r["same_tokens"]  # pipelined (whole prompts and in pieces), one group and one process: the same tokens
        for key in ("pipelined_tok_s", "pipelined_pieces_tok_s", "one_group_tok_s", "one_process_tok_s"):
            assert r[key] > 0, key
        assert r["new_tokens"] == r["sequences"] * 4
    # A timing, not a count: k extra steps can be lost in a shared machine's noise (then 0 s per token),
    # so the figures are checked for their shape and their ratio, not for a sign.
    per_token = data["cache"]["s_per_token"]
    assert set(per_token) == {"8", "32"} and min(per_token.values()) >= 0
    short, long = per_token["8"], per_token["32"]
    assert data["cache"]["long_over_short"] == (long / short if short > 0 else float("inf"))
    assert len(data["peak_rss_bytes_per_rank"]) == 2 and min(data["peak_rss_bytes_per_rank"]) > 0
    assert "against the planner's estimate" in run.stdout and "added/estimate" in run.stdout
    memory = data["memory_per_rank"]
    assert [m["rank"] for m in memory] == [0, 1]
    for m in memory:
        assert m["added_bytes"] == m["vmhwm_bytes"] - m["baseline_bytes"] and m["baseline_bytes"] > 0
        stage = m["stage"]
        assert stage["total"] == stage["weights"] + stage["kv_cache"] + stage["working"] and stage["kv_cache"] > 0
        assert m["estimate_bytes"] == stage["total"] + m["beside_stage_bytes"]
        assert m["added_over_estimate"] == m["added_bytes"] / m["estimate_bytes"]
    # Rank 0 also holds the one-process model: more beside its stage than rank 1.
    assert memory[0]["beside_stage_bytes"] > memory[1]["beside_stage_bytes"]
