"""A run's folder (``--out``): made writable or refused clearly, owned by one run at a time, its
small files replaced atomically.

Two runs on one folder would resume from each other's checkpoints and interleave their metrics,
so a run holds an exclusive ``fcntl.flock`` on ``OUT/.lock`` from before it reads the folder until
it ends; the lock file names the holder (pid, host, start time) for the refusal. The kernel drops
the lock when the holder exits however it exits, so a killed run leaves no stale lock. Under
torchrun only global rank 0 takes it, and every other rank raises the same error.

Example:
    >>> import tempfile
    >>> out = Path(tempfile.mkdtemp()) / "run"
    >>> with hold(out):
    ...     write_text_atomic(out / "note.txt", "hello\\n")
    >>> (out / "note.txt").read_text()
    'hello\\n'
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch.distributed as dist

from partitioner.errors import PipecutError

__all__ = [
    "RunFolderError", "RunLockedError", "DiskFullError", "hold", "owned", "write_text_atomic", "no_space", "disk_full",
    "LOCK_FILE",
]

LOCK_FILE = ".lock"


class RunFolderError(PipecutError, RuntimeError):
    """``--out`` cannot hold the run: it is a file, under a file, or not writable."""


class RunLockedError(RunFolderError):
    """Another run holds ``--out`` (its pid and host are in the message)."""


def make(out: Path) -> None:
    """Create ``out`` (and its parents) if needed.

    Raises:
        RunFolderError: ``out`` or a parent is a file, or the file system refuses (read-only,
            no permission).
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunFolderError(f"--out {out} is a file, not a folder: give a folder's path (it is created)") from None
    except OSError as e:
        raise _refused(out, e) from None
    if not out.is_dir():  # a link to a file, or a special file
        raise RunFolderError(f"--out {out} is not a folder: give a folder's path (it is created)")


class DiskFullError(RunFolderError):
    """The device ``--out`` is on ran out of space while the run wrote to it (path, bytes free and,
    when known, needed)."""


def no_space(error: BaseException) -> bool:
    """Whether ``error`` is, or was caused by, running out of space (``ENOSPC``), including one
    that torch.distributed.checkpoint gathered from a rank into a ``CheckpointException``."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        failures = getattr(e, "failures", None)  # CheckpointException: rank -> (exception, stack)
        if isinstance(failures, dict):
            for f in failures.values():
                first = f[0] if isinstance(f, tuple) and f else f
                if isinstance(first, BaseException):
                    todo.append(first)
        todo.extend([e.__cause__, e.__context__])
    # Another rank's failure arrives as text only (DCP quotes its traceback).
    return f"[Errno {errno.ENOSPC}]" in str(error)


def disk_full(path: Path, *, needed: int | None = None) -> DiskFullError:
    """The error for running out of space while writing ``path``, with the bytes free there now."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = f"{_size(shutil.disk_usage(probe).free)} free"
    except OSError:
        free = "free space unknown"
    need = f"; it needs about {_size(needed)}" if needed is not None else ""
    return DiskFullError(
        f"no space left on the device of {path} ({free}{need}): free space there (older runs, checkpoints "
        "kept with a larger --keep) or give an --out on another device, then rerun to resume from the newest "
        "complete checkpoint"
    )


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} TiB"


@contextmanager
def hold(out: Path) -> Iterator[None]:
    """Create ``out`` and hold its lock for the ``with`` block.

    Raises:
        RunLockedError: another process holds it (named).
        RunFolderError: ``out`` cannot be made or written (:func:`make`).
    """
    make(out)
    path = out / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise _refused(out, e) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 1000, 0).decode(errors="replace").strip() or "pid unknown"
            raise RunLockedError(
                f"{out} is in use by another pipecut train run ({owner}): wait for it to end, or give another "
                "--out (the lock is released when that process exits, however it exits)"
            ) from None
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {stamp}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


@contextmanager
def owned(out: Path, *, leader: bool) -> Iterator[None]:
    """:func:`hold` on the leader (global rank 0) for the ``with`` block; under torch.distributed
    every rank learns whether the leader got the folder and raises the same error if not
    (collective)."""
    with ExitStack() as stack:
        error: RunFolderError | None = None
        if leader:
            try:
                stack.enter_context(hold(out))
            except RunFolderError as e:
                error = e
        if dist.is_initialized():
            box: list[str | None] = [str(error) if error is not None else None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is not None and not leader:
                raise RunFolderError(f"rank 0 could not take the run folder: {box[0]}")
        if error is not None:
            raise error
        yield


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that a kill at any moment leaves the old file or the new
    one, never a part: written to a temporary sibling, fsynced, then renamed over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _refused(out: Path, e: OSError) -> RunFolderError:
    """The error for a file system that refuses to make or write ``out``."""
    where = e.filename or out
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        why = "read-only file system" if e.errno == errno.EROFS else "no permission to write"
        return RunFolderError(f"--out {out} cannot be written ({why}: {where}): give a writable folder")
    if e.errno == errno.ENOTDIR:
        return RunFolderError(f"--out {out} is under a file, not a folder ({where}): give a folder's path")
    return RunFolderError(f"--out {out} cannot be made or written ({e.strerror or e}: {where})")
