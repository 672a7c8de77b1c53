"""Checksums of the files pipecut writes into a checkpoint or an export, and their verification.

Every checkpoint (DCP folder) and safetensors export pipecut writes holds ``pipecut-manifest.json``:
file name -> size and CRC-32, and for a ``.safetensors`` file the CRC-32 of its header and of
each tensor's bytes, so that a damaged export names the tensor. A load checks every file against
it before reading anything and raises :class:`ChecksumError` naming the file (and the tensor);
a folder without a manifest (older pipecut, third-party weights) loads with a warning.

Why CRC-32 (``zlib.crc32``): the job is to catch storage and transfer damage (a flipped bit, a
truncated or zeroed block), not tampering, and CRC-32 detects every 1- to 3-bit error and every
burst of up to 32 bits in the sizes written here. It hashed 2.5 GiB/s on one core of the
development machine, against 1.3 for SHA-256 and 0.66 for BLAKE2b (``benchmarks/integrity.py``),
and it releases the GIL, so files are hashed on a few threads at once. The manifest names its
algorithm, so another can be added without breaking old manifests.

Example:
    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()); _ = (d / "a.bin").write_bytes(b"weights")
    >>> _ = write_manifest(d, digest_files(d, ["a.bin"]))
    >>> verify_manifest(d) == d
    True
    >>> _ = (d / "a.bin").write_bytes(b"weightz")
    >>> verify_manifest(d)
    Traceback (most recent call last):
    ...
    runtime.state.integrity.ChecksumError: ...a.bin...
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from runtime.state.weight_errors import CorruptFileError

__all__ = ["MANIFEST", "ChecksumError", "digest_files", "verify_file", "verify_manifest", "write_manifest"]

log = logging.getLogger(__name__)

MANIFEST = "pipecut-manifest.json"
_FORMAT = "pipecut-manifest"
_ALGORITHM = "crc32"
_HEADER = "__header__"  # a safetensors file's segment before its tensors: length and JSON header
_CHUNK = 16 << 20  # bytes hashed per read: large enough for zlib's speed, small for memory
_COMMIT_FILES = (".metadata", "model.safetensors.index.json", "model.safetensors")

PathLike = str | os.PathLike[str]


class ChecksumError(CorruptFileError):
    """A file's size or checksum differs from what its checkpoint's manifest recorded at save.

    Attributes:
        file: the damaged file.
        key: the tensor whose bytes differ (a safetensors export), else ``''``.
    """


def digest_files(directory: PathLike, names: Iterable[str], *, threads: int = 4) -> dict[str, dict[str, Any]]:
    """The manifest entries of ``names`` (files in ``directory``): size, CRC-32, per-tensor CRC-32s.

    Files are hashed on up to ``threads`` threads (``zlib.crc32`` releases the GIL).
    """
    folder = Path(directory)
    names = sorted(set(names))
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(names) or 1))) as pool:
        return dict(zip(names, pool.map(lambda n: _digest(folder / n), names)))


def write_manifest(directory: PathLike, files: Mapping[str, Mapping[str, Any]]) -> Path:
    """Write ``directory``'s manifest of ``files`` (from :func:`digest_files`, any ranks' merged)."""
    path = Path(directory) / MANIFEST
    body = {"format": _FORMAT, "version": 1, "algorithm": _ALGORITHM, "files": dict(sorted(files.items()))}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def verify_manifest(directory: PathLike, *, collective: bool = False) -> Path:
    """Check every file ``directory``'s manifest lists (size, then checksum); return ``directory``.

    A committed folder (``.metadata``, ``model.safetensors`` or its index) without a manifest is
    accepted with a warning: it was written by an older pipecut or another tool, and nothing can
    be verified. Collective with ``collective=True``: each rank hashes a share of the files and
    every rank raises the same error.

    Raises:
        ChecksumError: a file is missing, of another size, or hashes differently; names the file,
            and for a safetensors file the tensor.
        CorruptFileError: the manifest itself cannot be read.
    """
    folder = Path(directory)
    entries = _read_manifest(folder)
    if entries is None:
        if any((folder / m).is_file() for m in _COMMIT_FILES):
            log.warning("%s has no %s (written by an older pipecut or another tool): its files are "
                        "loaded without checksum verification", folder, MANIFEST)
        return folder
    names = sorted(entries)
    rank, world = _rank_world() if collective else (0, 1)
    mine = names[rank::world]
    problems = [p for p in _pool_map(lambda n: _problem(folder, n, entries[n]), mine) if p]
    if collective and world > 1:
        import torch.distributed as dist

        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, problems)
        problems = sorted(p for part in gathered for p in part)
    if problems:
        file, key, what = problems[0]
        more = f" ({len(problems) - 1} more damaged file(s))" if len(problems) > 1 else ""
        raise ChecksumError(
            f"{folder / file}{f' (tensor {key!r})' if key else ''} {what}{more}: the file changed "
            "after it was saved (disk, copy or transfer damage); restore it from a backup or the "
            "previous checkpoint, or re-save",
            file=str(folder / file), key=key,
        )
    log.debug("verified %d file(s) of %s", len(mine), folder)
    return folder


def verify_file(file: PathLike) -> None:
    """Check one file against the manifest beside it (no manifest, or not listed: nothing to check).

    Raises:
        ChecksumError: as :func:`verify_manifest`.
    """
    path = Path(file)
    entries = _read_manifest(path.parent)
    if entries is None or path.name not in entries:
        return
    problem = _problem(path.parent, path.name, entries[path.name])
    if problem:
        _, key, what = problem
        raise ChecksumError(
            f"{path}{f' (tensor {key!r})' if key else ''} {what}: the file changed after it was saved; "
            "restore it or re-export", file=str(path), key=key,
        )


# -- hashing -----------------------------------------------------------------------------------


def _digest(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    segments = _safetensors_segments(path, size) if path.suffix == ".safetensors" else None
    if segments is None:
        return {"size": size, _ALGORITHM: _hex(_crcs(path, [("", 0, size)])[""])}
    return {"size": size, "tensors": {k: _hex(v) for k, v in _crcs(path, segments).items()}}


def _safetensors_segments(path: Path, size: int) -> list[tuple[str, int, int]] | None:
    """The header and each tensor's byte range, in file order, when they tile the file exactly
    (safetensors requires it); else ``None`` (the file is then hashed whole)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n)) if n <= size - 8 else None
    except (OSError, struct.error, ValueError):
        return None
    if not isinstance(header, dict):
        return None
    base = 8 + n
    segments = [(_HEADER, 0, base)]
    try:
        ranges = sorted((int(v["data_offsets"][0]), int(v["data_offsets"][1]), k)
                        for k, v in header.items() if k != "__metadata__")
    except (KeyError, TypeError, ValueError, IndexError):
        return None
    end = base
    for start, stop, key in ranges:
        if base + start != end or stop < start:
            return None
        segments.append((key, base + start, base + stop))
        end = base + stop
    return segments if end == size else None


def _crcs(path: Path, segments: Sequence[tuple[str, int, int]]) -> dict[str, int]:
    """The CRC-32 of each ``(name, start, stop)`` byte range (contiguous, in order), in one read."""
    out = {name: 0 for name, _, _ in segments}
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        for name, start, stop in segments:
            f.seek(start)
            left, crc = stop - start, 0
            while left:
                got = f.readinto(view[: min(left, _CHUNK)])
                if not got:
                    break  # the file is shorter than recorded: the size check reports it
                crc = zlib.crc32(view[:got], crc)
                left -= got
            out[name] = crc
    return out


def _problem(folder: Path, name: str, entry: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """``(file, tensor, what is wrong)`` for a file that fails its entry, else ``None``."""
    path = folder / name
    if not path.is_file():
        return (name, "", "is missing (the manifest lists it)")
    size = path.stat().st_size
    if size != entry.get("size"):
        return (name, "", f"has {size} bytes, {entry.get('size')} when saved (truncated or overwritten)")
    if "tensors" in entry:
        want = entry["tensors"]
        segments = _safetensors_segments(path, size)
        if segments is None or {s[0] for s in segments} != set(want):
            return (name, _HEADER, "has a damaged header (checksum mismatch)")
        got = _crcs(path, segments)
        for key, _, _ in segments:
            if _hex(got[key]) != want.get(key):
                return (name, key, f"fails its checksum ({_ALGORITHM} {_hex(got[key])}, {want.get(key)} when saved)")
        return None
    want_crc = entry.get(_ALGORITHM)
    got_crc = _hex(_crcs(path, [("", 0, size)])[""])
    if got_crc != want_crc:
        return (name, "", f"fails its checksum ({_ALGORITHM} {got_crc}, {want_crc} when saved)")
    return None


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CorruptFileError(
            f"{path} cannot be read as a pipecut manifest ({e}); restore it, or delete it to load "
            "the folder unverified", file=str(path),
        ) from e
    files = body.get("files") if isinstance(body, dict) else None
    if not isinstance(files, dict) or body.get("format") != _FORMAT or body.get("algorithm") != _ALGORITHM:
        found = {k: body.get(k) for k in ("format", "algorithm")} if isinstance(body, dict) else type(body).__name__
        raise CorruptFileError(
            f"{path} is not a pipecut manifest this version reads (found {found}, expected format "
            f"{_FORMAT!r}, algorithm {_ALGORITHM!r}, a 'files' object); upgrade pipecut, restore the "
            "file, or delete it to load the folder unverified", file=str(path),
        )
    return files


def _hex(crc: int) -> str:
    return f"{crc:08x}"


def _pool_map(fn: Any, items: Sequence[str]) -> list[Any]:
    if len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=min(4, len(items))) as pool:
        return list(pool.map(fn, items))


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
