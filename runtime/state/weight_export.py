"""Exporting weights as a Hugging Face safetensors checkpoint: shards and an index, or one file,
committed atomically so that an interrupted export never loads as a whole checkpoint.

Why not DCP's ``HuggingFaceStorageWriter`` (torch 2.13): it does not size shards (the caller
must assign every key a file number), writes files under their final names as it goes (a crash
leaves shards beside a stale index), and goes through DCP's save planning for what is, here,
one process writing a mapping of tensors. ``safetensors.torch.save_file`` writes a shard from
the tensors' own memory (safetensors 0.8 does not copy contiguous CPU tensors; older versions,
and tensors on other devices, take one shard's worth of host memory), and the commit below is a
few renames.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.state.weight_errors import WeightsError, names_listing
from runtime.state.weight_sources import INDEX_FILE, SINGLE_FILE
from runtime.state.weights import PathLike, PrefixMap

__all__ = ["SaveReport", "save_safetensors"]

logger = logging.getLogger(__name__)

# transformers' default shard size (save_pretrained(max_shard_size="5GB")).
DEFAULT_SHARD_BYTES = 5_000_000_000


@dataclass(frozen=True)
class SaveReport:
    """What :func:`save_safetensors` wrote.

    Attributes:
        directory: where.
        files: the weight files, then the index when sharded.
        keys: checkpoint keys written.
        total_bytes: bytes of tensor data.
        tied: names not written -> the name they share memory with, which was written.
    """

    directory: str
    files: tuple[str, ...]
    keys: int
    total_bytes: int
    tied: Mapping[str, str] = field(default_factory=dict)


def save_safetensors(
    tensors: Mapping[str, torch.Tensor],
    directory: PathLike,
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    prefix: str | PrefixMap = "",
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
) -> SaveReport:
    """Write ``tensors`` as ``model.safetensors``, or as ``model-0000i-of-0000n.safetensors`` shards
    with ``model.safetensors.index.json`` when they exceed ``max_shard_bytes``.

    Files are written under a temporary folder inside ``directory`` and renamed into place; the
    last rename (the single file, or the index after its shards) is what makes the checkpoint
    whole. Tensors sharing memory (tied weights) are written once, under the first name, as
    transformers does; loading with ``aliases=`` or ``from_pretrained`` restores the others.

    Args:
        tensors: name -> tensor, on any device (not ``meta``); e.g. ``model.state_dict()`` or the
            ranks' stage state dicts gathered.
        directory: created if needed; other files in it (``config.json``) are left alone.
        max_shard_bytes: the most tensor bytes per shard; a larger tensor gets a shard of its own.
        prefix: how names become keys, as in :func:`load_weights`: ``'model.'`` strips it
            (``CausalLMLogits(model)``'s names to the Hugging Face model's keys).
        metadata: extra string entries of each file's header (``format: pt`` is always written).
        overwrite: replace a checkpoint already in ``directory``; else that is an error.

    Returns:
        The files written, keys, bytes and the tied names left out.

    Raises:
        WeightsError: a value is not a tensor or is on ``meta``, a name lacks the prefix, or
            ``directory`` holds a checkpoint and ``overwrite=False``.

    Example:
        >>> import tempfile
        >>> out = tempfile.mkdtemp()
        >>> w = torch.ones(4, 4)
        >>> report = save_safetensors({"model.wte.weight": w, "model.head.weight": w}, out, prefix="model.")
        >>> [Path(f).name for f in report.files], dict(report.tied)
        (['model.safetensors'], {'model.head.weight': 'model.wte.weight'})
    """
    folder = Path(directory)
    mapping = PrefixMap(prefix) if isinstance(prefix, str) else prefix
    keyed, tied = _keyed(tensors, mapping, str(folder))
    if max_shard_bytes < 1:
        raise WeightsError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}", source=str(folder))
    folder.mkdir(parents=True, exist_ok=True)
    existing = [p for p in (folder / SINGLE_FILE, folder / INDEX_FILE) if p.exists()]
    if existing and not overwrite:
        raise WeightsError(
            f"{folder} already holds a checkpoint ({', '.join(p.name for p in existing)}); pass "
            "overwrite=True to replace it, or export to another directory",
            source=str(folder),
        )
    shards = _shards(keyed, max_shard_bytes)
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    header = {**(metadata or {}), "format": "pt"}
    total = sum(_nbytes(t) for t in keyed.values())
    staging = Path(tempfile.mkdtemp(prefix=".pipecut-export-", dir=folder))
    try:
        for name, shard in zip(names, shards):
            save_file(shard, str(staging / name), metadata=header)
            _fsync(staging / name)
        if n > 1:
            weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
            _fsync(staging / INDEX_FILE)
        _uncommit(folder)
        # Shards first, the index last: until that rename nothing here loads as a whole.
        for name in names if n > 1 else []:
            os.replace(staging / name, folder / name)
        last = INDEX_FILE if n > 1 else SINGLE_FILE
        os.replace(staging / last, folder / last)
        _fsync_dir(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    files = tuple(str(folder / f) for f in ([*names, INDEX_FILE] if n > 1 else names))
    report = SaveReport(str(folder), files, len(keyed), total, tied)
    logger.info("wrote %d tensors (%d bytes) to %s in %d file(s)%s", len(keyed), total, folder, n,
                f"; {len(tied)} tied names left out" if tied else "")
    return report


def _keyed(
    tensors: Mapping[str, torch.Tensor], mapping: PrefixMap, where: str
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Checkpoint key -> contiguous tensor, each tensor once; and the tied names left out."""
    bad = [n for n, t in tensors.items() if not isinstance(t, torch.Tensor) or t.device.type == "meta"]
    if bad:
        raise WeightsError(
            f"cannot export {names_listing(bad)}: not tensors or on the meta device (no data). "
            "Export real tensors: materialise the stage (to_empty + load) first",
            source=where,
        )
    unprefixed = [n for n in tensors if mapping.to_key(n) is None]
    if unprefixed:
        raise WeightsError(
            f"names lacking the prefix {mapping.model!r}: {names_listing(unprefixed)}; pass the prefix "
            "every name starts with, or prefix='' to keep names as they are",
            source=where,
        )
    out: dict[str, torch.Tensor] = {}
    seen: dict[tuple[object, ...], str] = {}
    storages: set[tuple[object, ...]] = set()
    tied: dict[str, str] = {}
    for name, t in tensors.items():
        key = mapping.to_key(name)
        assert key is not None  # checked above; a prefix map is one-to-one, so keys are distinct
        storage = (t.device, t.untyped_storage().data_ptr()) if t.numel() else (name,)
        view = (*storage, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if view in seen:
            tied[name] = seen[view]
            continue
        seen[view] = name
        # safetensors refuses tensors that share memory; a partial view of another is written as a copy.
        t = t.detach()
        if not t.is_contiguous() or storage in storages:
            t = t.contiguous() if not t.is_contiguous() else t.clone()
        storages.add(storage)
        out[key] = t
    return out, tied


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """In order, a new shard whenever the next tensor would pass ``limit`` (transformers' rule)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = _nbytes(t)
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    return shards


def _uncommit(folder: Path) -> None:
    """Remove an old checkpoint's commit points first (index, single file), then its shards."""
    index = folder / INDEX_FILE
    old: list[str] = []
    if index.exists():
        try:
            old = sorted(set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values()))
        except (OSError, ValueError, AttributeError):
            old = []
        index.unlink()
    (folder / SINGLE_FILE).unlink(missing_ok=True)
    for name in old:
        if "/" not in name and name.endswith(".safetensors"):
            (folder / name).unlink(missing_ok=True)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    # Makes the renames durable; some file systems cannot fsync a directory, which is harmless here.
    with contextlib.suppress(OSError):
        _fsync(path)
