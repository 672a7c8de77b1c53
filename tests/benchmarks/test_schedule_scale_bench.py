"""The schedule-scale benchmark runs on small sizes and writes what it promises."""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _bench(name: str) -> Any:
    """A function of benchmarks/schedule_scale.py (the script run as a module that is not ``__main__``)."""
    return runpy.run_path(str(ROOT / "benchmarks" / "schedule_scale.py"), run_name="_bench_schedule_scale")[name]


def test_schedule_scale_benchmark_on_small_sizes(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    assert _bench("main")(["--stages", "2,4", "--microbatches", "4,8", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "schedule_scale"
    rows = data["results"]["schedules"]
    assert len(rows) == 2 * 2 * 5
    for r in rows:
        per = 3 if r["schedule"] in ("zbh1", "zbv") else 2
        assert r["actions"] == per * r["stages"] * r["microbatches"]
        assert all(r[k] >= 0 for k in ("build", "unit_run", "validate", "peak_inflight", "comm_plan",
                                       "simulate", "timeline"))
    plans = data["results"]["plans"]
    assert [(p["stages"], p["microbatches"]) for p in plans] == [(2, 4), (2, 8), (4, 4), (4, 8)]
    assert all(p["pipecut_simulate_exit"] == 0 and p["partition"] > 0 for p in plans)
