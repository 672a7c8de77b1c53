"""A run's checkpoint folder: ``checkpoints/step-N``, the latest complete one, the last K kept.

A checkpoint is complete when its DCP ``.metadata`` is there: ``PipelineTrainer.save`` writes into
a hidden ``.step-N.partial-*`` sibling and renames it into place only when every rank is done,
so a run killed mid-save leaves no ``step-N`` to resume from by mistake.

Example:
    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> for n in (2, 4, 6):
    ...     (root / f"step-{n}").mkdir(); (root / f"step-{n}" / ".metadata").touch()
    >>> (root / "step-8").mkdir()  # no .metadata: not complete
    >>> latest(root).name, prune(root, keep=2), [p.name for _, p in complete(root)]
    ('step-6', ['step-2'], ['step-4', 'step-6'])
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

__all__ = ["checkpoint_dir", "complete", "latest", "prune"]

_NAME = re.compile(r"step-(\d+)")
_PARTIAL = re.compile(r"\.step-(\d+)\.partial-.*")


def checkpoint_dir(root: Path, step: int) -> Path:
    """Where the checkpoint after ``step`` optimizer steps goes."""
    return root / f"step-{step}"


def complete(root: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints under ``root``, by step, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.fullmatch(p.name)
        if m and p.is_dir() and (p / ".metadata").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint, or ``None``."""
    found = complete(root)
    return found[-1][1] if found else None


def prune(root: Path, *, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints, and the ``.step-N.partial-*``
    folders of saves that died before the newest complete one; returns the names deleted.

    (A save to the same ``step-N`` removes its own leftovers; a run resumed from an earlier step
    with another cadence may never save that ``N`` again, so the folder would stay forever.)
    """
    found = complete(root)
    gone = [p for _, p in found[: max(0, len(found) - keep)]]
    if found:
        for p in sorted(root.glob(".step-*.partial-*")):
            m = _PARTIAL.fullmatch(p.name)
            if m and int(m.group(1)) < found[-1][0]:
                gone.append(p)
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in gone]
