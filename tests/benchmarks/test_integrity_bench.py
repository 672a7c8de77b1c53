"""benchmarks/integrity.py runs end to end on 64 MiB (--quick) and writes what it promises."""

from __future__ import annotations

import json
from pathlib import Path

from bench_script import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_run_measures_every_row(tmp_path: Path) -> None:
    module = load_script("integrity")
    out = tmp_path / "integrity.json"
    module.main(["--quick", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["bytes"] == 64 << 20
    assert set(result["algorithms_gib_s"]) == {"crc32", "adler32", "sha256", "blake2b"}
    assert all(v > 0 for v in [*result["checkpoint"].values(), *result["export"].values()])
