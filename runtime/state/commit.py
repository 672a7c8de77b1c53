"""Atomic overwrite of a checkpoint or export folder: there is always one loadable copy.

A save writes ``.<dir>.partial-*`` beside ``dir`` and commits it with two renames: the current
``dir`` to ``.<dir>.old``, then the partial folder to ``dir``; ``.<dir>.old`` is deleted last.
A process killed between the two renames leaves no ``dir`` but a whole ``.<dir>.old``, so:

* :func:`resolve` (every load) reads ``.<dir>.old`` when ``dir`` is not committed, and logs it;
* :func:`restore` (every save, before it writes) renames ``.<dir>.old`` back to ``dir`` first, so
  that no save deletes the only complete copy;
* :func:`commit` deletes ``.<dir>.old`` only while a committed ``dir`` exists.

A folder is committed when it holds DCP's ``.metadata`` (a checkpoint) or ``model.safetensors`` /
``model.safetensors.index.json`` (an export): each is written last into the partial folder.

Example:
    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> (root / ".ckpt.old").mkdir(); (root / ".ckpt.old" / ".metadata").touch()  # cut mid-commit
    >>> resolve(root / "ckpt").name
    '.ckpt.old'
    >>> restore(root / "ckpt"), committed(root / "ckpt")
    (True, True)
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

__all__ = ["commit", "committed", "previous", "resolve", "restore"]

log = logging.getLogger(__name__)

_COMMIT_FILES = (".metadata", "model.safetensors.index.json", "model.safetensors")


def committed(folder: Path) -> bool:
    """Whether ``folder`` holds a whole checkpoint or export (its last-written file is there)."""
    return any((folder / name).is_file() for name in _COMMIT_FILES)


def previous(target: Path) -> Path:
    """Where :func:`commit` keeps ``target``'s previous copy while it swaps the new one in."""
    return target.parent / f".{target.name}.old"


def resolve(target: str | os.PathLike[str]) -> Path:
    """``target``, or its previous copy when an overwrite was cut between its renames.

    Read-only (loads may run on many ranks at once); the next save puts the copy back.
    """
    path = Path(target)
    old = previous(path)
    if not committed(path) and committed(old):
        log.warning("%s was being overwritten when the saving process stopped (the new copy was "
                    "never committed): loading the previous copy %s", path, old)
        return old
    return path


def restore(target: Path) -> bool:
    """Put ``target``'s previous copy back when an overwrite was cut between its renames.

    Returns whether it did. Only one process (the leader) may call it.
    """
    old = previous(target)
    if committed(target) or not committed(old):
        return False
    if target.exists():  # not ours (commit never leaves an uncommitted target): keep it aside
        aside = target.parent / f".{target.name}.uncommitted"
        shutil.rmtree(aside, ignore_errors=True)
        target.rename(aside)
        log.warning("moved %s, which holds no checkpoint, to %s", target, aside)
    old.rename(target)
    _fsync_dir(target.parent)
    log.warning("restored %s from %s: an earlier overwrite stopped between its renames", target, old)
    return True


def commit(partial: Path, target: Path) -> None:
    """Put the finished ``partial`` folder at ``target``; the previous copy goes only afterwards.

    Only one process (the leader) may call it, after every rank has written its files.
    """
    restore(target)
    old = previous(target)
    # Here ``old`` is stale (``target`` is committed) or not a whole copy: nothing is lost.
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    # A process killed here leaves ``old`` alone: resolve() loads it, restore() puts it back.
    partial.rename(target)
    _fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    # Makes the renames durable; some file systems cannot fsync a directory, which is harmless here.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
