"""The run's ``metrics.jsonl``: a JSON line per step, appended as steps end, cut back atomically
to the checkpoint's step when a run resumes; a last line cut short by a kill is dropped.

Example:
    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "metrics.jsonl"
    >>> for n in (1, 2, 3):
    ...     append(path, {"step": n, "loss": 1.0})
    >>> cut_back(path, 2); [m["step"] for m in read(path)]
    [1, 2]
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from partitioner.errors import PipecutError
from pipecut.train.runfolder import write_text_atomic

__all__ = ["MetricsFileError", "read", "cut_back", "append"]

log = logging.getLogger(__name__)


class MetricsFileError(PipecutError, ValueError):
    """A line of ``metrics.jsonl`` other than the last is not a metrics line (names the file and line)."""


def read(path: Path) -> list[dict[str, Any]]:
    """The metrics lines of ``path`` (none when it does not exist).

    Raises:
        MetricsFileError: a line before the last is not a JSON object with a ``step``.
    """
    return [m for _, m in _lines(path)]


def cut_back(path: Path, step: int) -> None:
    """Keep the lines of steps up to ``step`` (those a resumed run does not repeat), replacing the
    file atomically: a kill midway leaves the old file whole.

    Raises:
        MetricsFileError: as :func:`read`.
    """
    if not path.is_file():
        return
    write_text_atomic(path, "".join(raw + "\n" for raw, m in _lines(path) if m["step"] <= step))


def append(path: Path, line: Mapping[str, Any]) -> None:
    """Add one step's line."""
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")


def _lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    if not path.is_file():
        return []
    rows = [(i, raw) for i, raw in enumerate(path.read_text().splitlines(), 1) if raw.strip()]
    out = []
    for i, raw in rows:
        try:
            record = json.loads(raw)
            why = "" if isinstance(record, dict) and isinstance(record.get("step"), int) else (
                'not a JSON object with an integer "step"')
        except ValueError as e:
            record, why = None, str(e)
        if why:
            if i == rows[-1][0]:  # a run killed while appending: the line is lost with its step
                log.warning("%s:%d is cut short (a run killed while writing it): dropped (%s)", path, i, why)
                break
            raise MetricsFileError(
                f"{path}:{i} is not a metrics line ({why}): delete that line (or the file) and rerun"
            )
        out.append((raw, record))
    return out
