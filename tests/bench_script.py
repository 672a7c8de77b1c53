"""The scripts of ``benchmarks/`` as the tests use them: imported as modules, or run as commands.

``benchmarks/`` is a folder of scripts, not a package: a test imports one by its path.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str, as_name: str | None = None) -> ModuleType:
    """``benchmarks/<name>.py`` (``name`` may name a helper: ``lib/tensor_peak``) imported as the module
    ``as_name`` (default ``_bench_<name>``)."""
    spec = importlib.util.spec_from_file_location(as_name or f"_bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up by name as it is made
    spec.loader.exec_module(module)
    return module


def run_script(name: str, argv: Sequence[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/<name>.py ARGV`` from the checkout's root, its output captured, one
    thread per process (``OMP_NUM_THREADS=1``)."""
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def read_result(name: str, argv: Sequence[str], out: Path) -> dict[str, Any]:
    """The result ``benchmarks/<name>.py ARGV`` wrote to ``out``, checked to name its benchmark and the
    command that ran it."""
    data: dict[str, Any] = json.loads(out.read_text())
    assert data["benchmark"] == name
    assert data["command"] == f"python benchmarks/{name}.py " + " ".join(argv)
    return data


def run_result(name: str, argv: Sequence[str], out: Path, *, timeout: float) -> dict[str, Any]:
    """:func:`run_script`, which must succeed (else the tail of its stderr says why), and the result it
    wrote to ``out`` (:func:`read_result`)."""
    run = run_script(name, argv, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return read_result(name, argv, out)
