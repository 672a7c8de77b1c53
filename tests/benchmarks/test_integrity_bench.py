"""benchmarks/integrity.py runs end to end on 64 MiB (--quick) and writes what it promises."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_run_measures_every_row(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("_bench_integrity", ROOT / "benchmarks" / "integrity.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    out = tmp_path / "integrity.json"
    module.main(["--quick", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["bytes"] == 64 << 20
    assert set(result["algorithms_gib_s"]) == {"crc32", "adler32", "sha256", "blake2b"}
    assert all(v > 0 for v in [*result["checkpoint"].values(), *result["export"].values()])
