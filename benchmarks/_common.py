"""What the benchmark scripts share: the git state a result was measured at, and list arguments."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def git_state(paths: tuple[str, ...] = ("partitioner", "runtime")) -> dict[str, Any]:
    """The commit the library was at and its uncommitted files under ``paths`` ({} outside git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", *paths], cwd=ROOT, capture_output=True,
                               text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {"commit": head.stdout.strip(), "dirty": [ln[3:] for ln in dirty.stdout.splitlines()]}


def int_list(text: str) -> list[int]:
    """``'4,8,16' -> [4, 8, 16]`` for comma-separated command-line values."""
    return [int(x) for x in text.split(",") if x.strip()]
