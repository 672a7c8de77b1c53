"""Checkpoint readers: list keys and read shapes and dtypes from headers alone, then copy chosen
tensors one at a time, opening only the files that hold them.

Five layouts: a safetensors file, safetensors shards with ``model.safetensors.index.json``, a
torch state-dict file (``torch.save``, e.g. ``pytorch_model.bin``), torch shards with
``pytorch_model.bin.index.json``, and a torch.distributed.checkpoint directory (DCP). A directory
is read the way ``from_pretrained`` reads a folder (:func:`find_checkpoint`); a folder whose
weights are in a format none of these readers understands is refused, never half-read.

Why ``safetensors.safe_open`` and not DCP's ``HuggingFaceStorageReader``: torch 2.13's reader
builds its metadata by opening every ``*.safetensors`` file of the directory (the index is not
read), so each rank would open every shard; it takes no single-file path; and it validates
sizes only while copying, after earlier tensors were written. ``safe_open`` maps one file and
reads its header (names, shapes, dtypes) without touching data, and ``get_tensor`` reads one
tensor, which is what "each rank reads only its stages, all checked before any copy" needs.

A destination may be a ``DTensor`` (a tensor-parallel or FSDP2 shard): each reader fills its
local part only (:func:`local_part`), and safetensors reads only that part's bytes
(``safe_open(...).get_slice(key)[rows]``), so a rank never holds a whole split weight.

Torch files are read with ``torch.load(weights_only=True)`` only, so a file whose pickle would
import a class or function is refused (:class:`UnsafeFileError`) and nothing of it runs; torch
before 2.6 is refused too, since its ``weights_only`` loader could be escaped (CVE-2025-32434).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import sys
import zipfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from runtime.state.commit import resolve
from runtime.state.folder_checkpoint import (
    HF_CHECKPOINTS,
    INDEX_FILE,
    SINGLE_FILE,
    TORCH_FILE,
    TORCH_INDEX_FILE,
    find_checkpoint,
)
from runtime.state.integrity import verify_file, verify_manifest
from runtime.state.weight_errors import CorruptFileError, UnsafeFileError, WeightsSourceError

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

__all__ = [
    "INDEX_FILE", "SINGLE_FILE", "TORCH_FILE", "TORCH_INDEX_FILE", "HF_CHECKPOINTS", "Source", "TensorInfo",
    "copy_part", "find_checkpoint", "local_part", "open_source",
]

_DCP_METADATA = ".metadata"

# safetensors' dtype codes (its format spec); torch names the float8 ones only in recent versions.
_ST_DTYPES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
}

# Copies every tensor of ``plan`` (key -> its destinations); calls back with each key done.
Done = Callable[[str], None]


def local_part(dest: torch.Tensor) -> tuple[torch.Tensor, tuple[slice | torch.Tensor, ...] | None]:
    """Where a destination's values go, and which part of the whole tensor they are.

    A ``DTensor`` (a tensor-parallel shard, an FSDP2 shard, or ``Replicate``): its local tensor
    and its slices of the global tensor, from the offsets DTensor and DCP themselves use
    (``Shard(0)``, ``Shard(1)``, uneven chunks); a packed weight's (``_StridedShard``) part is
    not one range: an index tensor of its rows or columns takes that dim's place. A plain
    tensor: itself, and ``None`` (all of it).

    Example:
        >>> t = torch.zeros(2, 3)
        >>> local_part(t)[0] is t, local_part(t)[1]
        (True, None)
    """
    # No DTensor can exist before its module is imported: plain loads never pay for the import.
    if "torch.distributed.tensor" not in sys.modules:
        return dest, None
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(dest, DTensor):
        return dest, None
    strided = [pl for pl in dest.placements if hasattr(pl, "split_factor")]
    if strided and dest.device_mesh.ndim == 1:
        return dest.to_local(), _packed_region(dest, strided[0])
    shape, offset = compute_local_shape_and_global_offset(dest.shape, dest.device_mesh, dest.placements)
    return dest.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _packed_region(dest: Any, placement: Any) -> tuple[slice | torch.Tensor, ...]:
    """A packed tensor-parallel weight's part (``_StridedShard(dim, split_factor=k)`` on the tp
    mesh, runtime.parallel.tensor): this rank's slice of each of its ``k`` parts, side by side;
    an index of those rows (or columns), since they are not one range."""
    dim, k = placement.dim, placement.split_factor
    tp, t = dest.device_mesh.size(), dest.device_mesh.get_local_rank()
    part = dest.shape[dim] // k // tp
    index = torch.cat([torch.arange(j * part * tp + t * part, j * part * tp + (t + 1) * part) for j in range(k)])
    return tuple(index if d == dim else slice(None) for d in range(dest.dim()))


def copy_part(dest: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy ``whole`` into ``dest``: its part of it when ``dest`` is a ``DTensor`` (:func:`local_part`)."""
    local, region = local_part(dest)
    local.copy_(whole if region is None else whole[region])


@dataclass(frozen=True)
class TensorInfo:
    """A checkpoint tensor as its header describes it; no data is read to know it.

    Attributes:
        shape: its size.
        dtype: a torch dtype, or the file's own code when torch has none for it.
        files: the files holding it (one, except for a DCP tensor saved in chunks by several ranks).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype | str
    files: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of its data (0 for a dtype torch does not know)."""
        if not isinstance(self.dtype, torch.dtype):
            return 0
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


class Source(ABC):
    """An open checkpoint. Use as a context manager; ``touched`` lists the files opened so far.

    Each format implements ``keys``, ``file_of``, ``info`` and ``read``.
    """

    kind = ""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.touched: list[str] = []
        self._stack = ExitStack()

    @abstractmethod
    def keys(self) -> Sequence[str]:
        """Every tensor key, from the index, header or metadata alone."""

    @abstractmethod
    def file_of(self, key: str) -> str:
        """The file holding ``key``, without opening it."""

    @abstractmethod
    def info(self, keys: Iterable[str]) -> dict[str, TensorInfo]:
        """Shapes and dtypes of ``keys``, opening only the files that hold them."""

    @abstractmethod
    def read(self, plan: Mapping[str, Sequence[torch.Tensor]], done: Done) -> int:
        """Copy each key's tensor into its destinations, one tensor in memory at a time.

        Returns:
            Bytes read from the checkpoint.
        """

    def get(self, key: str) -> torch.Tensor:
        """One tensor, read into a new CPU tensor of its own (for a tensor that is converted before
        it is copied: :mod:`runtime.state.hf_conversion`)."""
        info = self.info([key])[key]
        if not isinstance(info.dtype, torch.dtype):
            raise WeightsSourceError(
                f"{key!r} in {', '.join(info.files)} has dtype {info.dtype}, which torch cannot hold",
                source=str(self.path),
            )
        out = torch.empty(info.shape, dtype=info.dtype)
        self.read({key: [out]}, lambda _: None)
        return out

    def describe(self) -> str:
        """``/ckpt (safetensors shards, 4 files, 291 keys)``: the source for messages."""
        files = {self.file_of(k) for k in self.keys()}
        return f"{self.path} ({self.kind}, {len(files)} file{'s' * (len(files) != 1)}, {len(self.keys())} keys)"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


def open_source(source: str | os.PathLike[str]) -> Source:
    """The reader for ``source``: a file (``.safetensors``, ``*.index.json``, else a torch file)
    or a directory (``.metadata`` -> DCP, else the checkpoint :func:`find_checkpoint` picks).

    Raises:
        WeightsSourceError: no such path, or a directory holding none of those layouts (or
            weights in a format pipecut does not read).
        UnsafeFileError: a torch file's pickle would import a class or function (nothing of it ran).
    """
    path = Path(source)
    if not path.is_file():  # an export or checkpoint cut between its overwrite's renames: its previous copy
        path = resolve(path)
    if path.is_dir():
        if (path / _DCP_METADATA).is_file():
            return _DcpSource(verify_manifest(path))  # safetensors files are verified as opened
        found = find_checkpoint(path)
        if found is None:
            raise WeightsSourceError(
                f"{path} is a directory with no checkpoint pipecut reads: expected {SINGLE_FILE}, "
                f"{INDEX_FILE} with its shards, {TORCH_FILE}, {TORCH_INDEX_FILE} with its shards, or a "
                "torch.distributed.checkpoint '.metadata' file.",
                source=str(path),
            )
        path = found
    if not path.is_file():
        raise WeightsSourceError(
            f"checkpoint {path} does not exist; give a safetensors file or directory, a "
            "model.safetensors.index.json, a torch.save file (or pytorch_model.bin.index.json), or a "
            "torch.distributed.checkpoint directory",
            source=str(path),
        )
    if path.name.endswith(".index.json"):
        weight_map = _read_index(path)
        if all(file.endswith(".safetensors") for file in weight_map.values()):
            return _SafetensorsSource(path, weight_map, "safetensors shards")
        return _TorchSource(path, weight_map, "torch shards")
    if path.suffix == ".safetensors":
        return _SafetensorsSource.single(path)
    return _TorchSource.single(path)


def _read_index(index: Path) -> dict[str, str]:
    """An index's ``weight_map``: key -> the path of the shard holding it."""
    kind = "torch" if index.name.endswith(".bin.index.json") else "safetensors"
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsSourceError(
            f"cannot read the {kind} index {index}: {e}; re-export the checkpoint "
            "(save_safetensors or save_pretrained) or restore the file",
            source=str(index),
        ) from e
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise WeightsSourceError(
            f"{index} has no 'weight_map' object of key -> shard file name, so it is not a "
            "checkpoint index; re-export the checkpoint or pass the directory that holds it",
            source=str(index),
        )
    folder = index.parent
    return {k: str(folder / v) for k, v in weight_map.items()}


class _FileMapSource(Source):
    """A checkpoint whose every key is in one of its files (``_map``: key -> file)."""

    def __init__(self, path: Path, weight_map: dict[str, str], kind: str) -> None:
        super().__init__(path)
        self.kind = kind
        self._map = weight_map

    def keys(self) -> Sequence[str]:
        return list(self._map)

    def file_of(self, key: str) -> str:
        return self._map[key]

    def info(self, keys: Iterable[str]) -> dict[str, TensorInfo]:
        return {key: self._info(key, self._map[key]) for key in keys}

    @abstractmethod
    def _info(self, key: str, file: str) -> TensorInfo:
        """``key``'s shape and dtype, read from ``file`` (the one the map names)."""

    def _stale(self, key: str, file: str) -> WeightsSourceError:
        return WeightsSourceError(
            f"the index {self.path} puts key {key!r} in {file}, which does not hold it; the "
            "index is stale: re-export the checkpoint",
            source=str(self.path),
        )

    def _by_file(self, plan: Mapping[str, Sequence[torch.Tensor]]) -> list[tuple[str, list[str]]]:
        """The planned keys grouped by the file holding them, files and keys sorted."""
        by_file: dict[str, list[str]] = {}
        for key in sorted(plan):
            by_file.setdefault(self._map[key], []).append(key)
        return sorted(by_file.items())


class _SafetensorsSource(_FileMapSource):
    """One safetensors file or shards: key -> file from the index (or the one header)."""

    def __init__(self, path: Path, weight_map: dict[str, str], kind: str) -> None:
        super().__init__(path, weight_map, kind)
        self._handles: dict[str, Any] = {}

    @classmethod
    def single(cls, file: Path) -> _SafetensorsSource:
        source = cls(file, {}, "safetensors")
        source._map = dict.fromkeys(source._open(str(file)).keys(), str(file))
        return source

    def _open(self, file: str) -> Any:
        if file not in self._handles:
            verify_file(file)  # against the manifest beside it, if pipecut wrote one
            try:
                self._handles[file] = self._stack.enter_context(safe_open(file, framework="pt"))
            except Exception as e:  # safetensors raises its own SafetensorError for a bad header
                exists = "does not exist" if not os.path.exists(file) else f"is not a safetensors file ({e})"
                raise WeightsSourceError(
                    f"checkpoint file {file} {exists}; "
                    + ("the index names it: restore the shard or re-export" if self.kind.endswith("shards")
                       else "re-export it"),
                    source=str(self.path),
                ) from e
            self.touched.append(file)
        return self._handles[file]

    def _info(self, key: str, file: str) -> TensorInfo:
        handle = self._open(file)
        try:
            sl = handle.get_slice(key)
        except Exception as e:
            raise self._stale(key, file) from e
        code = sl.get_dtype()
        dtype = getattr(torch, _ST_DTYPES.get(code, ""), code)
        return TensorInfo(tuple(sl.get_shape()), dtype, (file,))

    def read(self, plan: Mapping[str, Sequence[torch.Tensor]], done: Done) -> int:
        nbytes = 0
        # File by file, each through a handle of its own that is closed once its keys are copied:
        # pages read through a mapping count in the process's RSS for as long as it is mapped.
        for file, keys in self._by_file(plan):
            self._open(file)  # the header, and the error for a missing or broken shard
            with safe_open(file, framework="pt") as handle:
                for key in keys:
                    whole: torch.Tensor | None = None
                    for dest in plan[key]:
                        local, region = local_part(dest)
                        if region is None:
                            if whole is None:
                                whole = handle.get_tensor(key)  # this tensor only, on CPU
                                nbytes += whole.numel() * whole.element_size()
                            local.copy_(whole)
                        elif any(isinstance(r, torch.Tensor) for r in region):  # a packed weight's parts
                            part = handle.get_tensor(key)[region]
                            nbytes += part.numel() * part.element_size()
                            local.copy_(part)
                            del part
                        else:  # a shard: only its rows (or columns) are read
                            part = handle.get_slice(key)[region]
                            nbytes += part.numel() * part.element_size()
                            local.copy_(part)
                            del part
                    del whole
                    done(key)
        return nbytes


class _TorchSource(_FileMapSource):
    """``torch.save`` state dicts: one file, or shards with ``pytorch_model.bin.index.json``.

    A file is opened when one of its keys is first asked about, memory-mapped where its format
    allows (torch's zip format, the default since torch 1.6; the legacy format is read whole):
    shapes are known at once, pages are read on copy.
    """

    def __init__(self, path: Path, weight_map: dict[str, str], kind: str) -> None:
        super().__init__(path, weight_map, kind)
        self._loaded: dict[str, dict[str, torch.Tensor]] = {}

    @classmethod
    def single(cls, file: Path) -> _TorchSource:
        source = cls(file, {}, "torch file")
        source._map = dict.fromkeys(source._load(str(file)), str(file))
        return source

    def _load(self, file: str) -> dict[str, torch.Tensor]:
        if file not in self._loaded:
            if not os.path.exists(file):
                raise WeightsSourceError(
                    f"checkpoint file {file} does not exist; the index {self.path} names it: restore the "
                    "shard or re-export",
                    source=str(self.path),
                )
            self._loaded[file] = _torch_load(Path(file))
            if file not in self.touched:
                self.touched.append(file)
        return self._loaded[file]

    def _info(self, key: str, file: str) -> TensorInfo:
        tensor = self._load(file).get(key)
        if tensor is None:
            raise self._stale(key, file)
        return TensorInfo(tuple(tensor.shape), tensor.dtype, (file,))

    def read(self, plan: Mapping[str, Sequence[torch.Tensor]], done: Done) -> int:
        nbytes = 0
        for file, keys in self._by_file(plan):
            tensors = self._load(file)
            for key in keys:
                tensor = tensors[key]
                nbytes += tensor.numel() * tensor.element_size()
                for dest in plan[key]:
                    copy_part(dest, tensor)
                done(key)
            # Let the file's mapping go once its keys are copied: pages read through a mapping
            # count in the process's RSS for as long as it is mapped.
            del tensors
            self._loaded.pop(file, None)
        return nbytes


def _torch_load(file: Path) -> dict[str, torch.Tensor]:
    """A torch file's tensors by dotted key, read with ``weights_only=True`` (mapped where it can be)."""
    if torch.torch_version.TorchVersion(torch.__version__) < "2.6":  # compared as versions, not text
        raise WeightsSourceError(
            f"reading the torch file {file} needs torch >= 2.6 (this is {torch.__version__}): older "
            "torch.load(weights_only=True) can be made to run code by a crafted file (CVE-2025-32434). "
            "Upgrade torch, or convert the file to safetensors in a Python you trust",
            source=str(file),
        )
    # mmap needs torch's zip format; a legacy-format file (torch < 1.6) is read whole.
    mmap = zipfile.is_zipfile(file)
    try:
        loaded = torch.load(file, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:
        # weights_only refuses a damaged file and a crafted one alike; a crafted one names a global.
        refused = _unsafe_globals(file) or tuple(re.findall(r"Unsupported global: GLOBAL (\S+)", str(e)))
        if not refused:
            raise _unreadable(file, e) from e
        raise UnsafeFileError(
            f"{file} is not a plain state dict: its pickle would import {', '.join(refused)}, and pipecut "
            "reads torch files with torch.load(weights_only=True) only, so nothing of it ran. If you trust "
            "where it came from, convert it in a Python of your own: sd = torch.load(path, "
            "weights_only=False), keep its tensors, save them with safetensors.torch.save_file(sd, "
            "'model.safetensors') (or load the model and save_pretrained() it), and use that file",
            file=str(file), refused=refused,
        ) from None
    except Exception as e:
        raise _unreadable(file, e) from e
    if not isinstance(loaded, Mapping):
        raise WeightsSourceError(
            f"{file} holds a {type(loaded).__name__}, not a state dict (a mapping of names to "
            "tensors); save model.state_dict() instead",
            source=str(file),
        )
    return _flatten(loaded)


def _unreadable(file: Path, e: Exception) -> WeightsSourceError:
    return WeightsSourceError(
        f"cannot read {file} as a torch state dict with torch.load(weights_only=True): "
        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. Re-save it as a plain state dict: "
        "torch.save(model.state_dict(), path), or convert it to safetensors",
        source=str(file),
    )


def _unsafe_globals(file: Path) -> tuple[str, ...]:
    """The globals outside torch's ``weights_only`` allow-list that ``file`` would import, if it can tell."""
    try:
        return tuple(torch.serialization.get_unsafe_globals_in_checkpoint(file))
    except Exception:  # the legacy format, or a torch without the helper: the message says less
        return ()


def _flatten(tree: Mapping[Any, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """Tensors of nested mappings under dotted keys, as DCP flattens them; other values dropped."""
    out: dict[str, torch.Tensor] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[key] = v
        elif isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
    return out


class _DcpSource(Source):
    """A torch.distributed.checkpoint directory: shapes and dtypes from its ``.metadata``."""

    kind = "torch.distributed.checkpoint"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        # Imported here: torch.distributed.checkpoint takes seconds to import, and most runs never read one.
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from runtime.state.safe_dcp import SafeReader

        self._reader = SafeReader(path)
        try:  # without pickle: an UnsafeFileError (a crafted .metadata) goes up as it is
            metadata = self._reader.read_metadata()
        except CorruptFileError as e:
            raise WeightsSourceError(
                f"cannot read the torch.distributed.checkpoint metadata of {path}: {e}",
                source=str(path),
            ) from e
        self.touched.append(str(path / _DCP_METADATA))
        self._meta = {
            k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
        }
        files: dict[str, set[str]] = {}
        for index, storage in (metadata.storage_data or {}).items():
            files.setdefault(index.fqn, set()).add(str(path / storage.relative_path))
        self._files = {k: tuple(sorted(files.get(k, ()))) for k in self._meta}

    def keys(self) -> Sequence[str]:
        return list(self._meta)

    def file_of(self, key: str) -> str:
        return ", ".join(self._files[key]) or str(self.path)

    def info(self, keys: Iterable[str]) -> dict[str, TensorInfo]:
        keys = list(keys)
        try:  # the files exist and are long enough (a stat each), before any data is copied
            self._reader.check_files(set(keys))
        except CorruptFileError as e:
            raise WeightsSourceError(str(e), source=str(self.path)) from e
        return {
            k: TensorInfo(tuple(self._meta[k].size), self._meta[k].properties.dtype, self._files[k])
            for k in keys
        }

    def read(self, plan: Mapping[str, Sequence[torch.Tensor]], done: Done) -> int:
        from runtime.state.safe_dcp import load

        nbytes = 0
        groups: dict[tuple[str, ...], list[str]] = {}
        for key in plan:
            groups.setdefault(self._files[key], []).append(key)
        # One load per group of files, so a failure names the keys already in place. no_dist=True
        # even under an initialised process group: DCP's collective load expects every rank to ask
        # for the same keys at the same time, and a pipeline's ranks hold different stages.
        for files, keys in sorted(groups.items()):
            state = {k: plan[k][0] for k in keys}
            load(state, self.path, collective=False)
            self.touched.extend(f for f in files if f not in self.touched)
            for k in keys:
                first, *others = plan[k]
                if state[k] is not first:  # DCP copies in place into plain tensors; say so if not
                    first.copy_(state[k])
                for dest in others:
                    dest.copy_(first)
                local = local_part(first)[0]  # DCP reads a DTensor's own part only
                nbytes += local.numel() * local.element_size()
                done(k)
        return nbytes
