"""The source-layout benchmark measures this checkout and an older one alike, and writes what it promises."""

from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench(name: str) -> Any:
    """A function of benchmarks/source_layout.py (the script run as a module that is not ``__main__``)."""
    return runpy.run_path(str(ROOT / "benchmarks" / "source_layout.py"), run_name="_bench_source_layout")[name]


def test_source_layout_benchmark_on_this_checkout(tmp_path: Path) -> None:
    pytest.importorskip("transformers")  # the construction walk builds a GPT-2
    out = tmp_path / "source_layout.json"
    assert _bench("main")(["--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "source_layout"
    r = data["results"]
    assert r["module_circles"] == [] and r["room_circles"] == []
    assert max(r["modules_per_folder"].values()) <= 12
    assert r["trainer_init"]["parameters"] <= 12
    walk = r["step_walk"]
    assert walk["reentries"] == 0 and walk["modules_passed"] == len(walk["modules"]) > 5
    assert "runtime.trainer" in walk["modules"] and "runtime.execute.executor" in walk["modules"]
    assert walk["handoffs"] <= walk["handoff_calls"] <= walk["calls"]
    rooms = walk["room_walk"]
    assert rooms["handoffs"] == len(rooms["visits"]) - 1
    assert rooms["returns"] == len(rooms["visits"]) - rooms["rooms_passed"] == sum(rooms["return_rooms"].values())
    # Issue 33: the 2-stage GPT-2's construction was 11 rooms, 60 hand-offs, 50 returns before.
    built = r["construction_walks"]["gpt2_2stage"]["room_walk"]
    assert built["rooms_passed"] <= 11 and built["returns"] <= 24, built
    assert built["visits"][:2] == ["runtime.trainer", "runtime.options"]
    assert "gpt2_2x2_fsdp" not in r["construction_walks"]  # only with --distributed


def test_source_layout_benchmark_finds_circles_and_long_functions(tmp_path: Path) -> None:
    # A tree of its own: two modules importing each other, one long function, a crowded folder.
    root = tmp_path / "tree"
    for pkg in ("partitioner", "runtime", "pipecut"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text('"""A package."""\n')
    (root / "partitioner" / "a.py").write_text("def f():\n    from partitioner import b\n")
    (root / "partitioner" / "b.py").write_text("import partitioner.a\n" + "def g():\n" + "    x = 1\n" * 90)
    for i in range(13):
        (root / "runtime" / f"m{i}.py").write_text("")
    shutil.copy(ROOT / "runtime" / "trainer.py", root / "runtime" / "trainer.py")
    result = _bench("measure")(root, walk=False)
    assert result["module_circles"] == [["partitioner.a", "partitioner.b"]]
    assert result["modules_per_folder"]["runtime"] == 14
    assert [f["function"] for f in result["functions_over_80_lines"]][:1] == ["g"]
    assert "step_walk" not in result
