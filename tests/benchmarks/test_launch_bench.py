"""benchmarks/launch.py: both start methods launch ranks that see the caller's environment and
folder, and the result names its command and both methods' figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench_script import run_result


@pytest.mark.multiprocess
def test_launch_quick(tmp_path: Path) -> None:
    # A subprocess, as users run it: the fork server and spawned ranks re-import the script as __main__.
    out = tmp_path / "launch.json"
    argv = ["--quick", "--out", str(out)]
    data = run_result("launch", argv, out, timeout=300)
    rows = {(r["method"], r["world"]): r for r in data["rows"]}
    assert set(rows) == {("spawn", 2), ("forkserver", 2)}
    for r in rows.values():
        assert len(r["calls_s"]) == 2 and r["first_s"] == r["calls_s"][0] > 0
        assert r["later_median_s"] == r["calls_s"][1] > 0
        assert 0 < r["rank_rss_bytes"] <= r["rank_hwm_bytes"]
    assert data["spawn_over_forkserver"]["N=2"] == pytest.approx(
        rows["spawn", 2]["later_median_s"] / rows["forkserver", 2]["later_median_s"])
