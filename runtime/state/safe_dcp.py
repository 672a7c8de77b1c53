"""Reading torch.distributed.checkpoint (DCP) directories without letting them run code, and
writing pipecut's own non-tensor state so that its checkpoints hold no pickle at all.

DCP stores its ``.metadata`` with ``pickle.dump`` and reads it with ``pickle.load``, and its
default load planner reads every non-tensor item with ``torch.load(weights_only=False)``: a
shared checkpoint or "weights" folder could run any command on every rank that loads it. Here
the same DCP machinery reads through a subclassed storage reader and load planner that admit
only what a DCP checkpoint legitimately holds:

* ``.metadata``: a :class:`pickle.Unpickler` whose ``find_class`` knows only DCP's metadata
  dataclasses, ``torch.Size``, dtypes, layouts and paths (plain containers, strings and numbers
  need no class). torch's ``weights_only`` unpickler would be the natural tool, but torch 2.13's
  understands only the protocol-2 opcodes ``torch.save`` writes, not the protocol 4/5 ones
  (``STACK_GLOBAL``, ``FRAME``, ``MEMOIZE``) that ``pickle.dump`` writes, so this is the
  standard library's documented "restricting globals" recipe instead.
* non-tensor items in ``.distcp`` files (``torch.save`` blobs): ``torch.load(weights_only=True)``.
* tensors: DCP already reads them with ``weights_only=True``.

pipecut's own non-tensor values (the step, optimizer settings, the LR scheduler's and loss
scaler's state) are written as *records* (:func:`to_record`): JSON in a ``uint8`` tensor, so
DCP stores them as tensors and nothing in a pipecut checkpoint needs pickle.

Anything else is refused with :class:`UnsafeFileError` naming the file and the class; nothing
of it is imported or called. A truncated or damaged file is a :class:`CorruptFileError` naming
the file and the entry, checked before any destination is written where sizes tell.

Every save and load here also shows DCP a packed tensor-parallel weight as the parts it is
(:func:`packed_in_parts`), which DCP cannot tell from its ``DTensor`` placement alone.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import json
import logging
import os
import pathlib
import pickle
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from partitioner.errors import PipecutError
from runtime.state.weight_errors import CheckpointError, CorruptFileError, UnsafeFileError

__all__ = [
    "SafeLoadPlanner", "SafeReader", "from_record", "load", "read_metadata", "record_slot", "save",
    "packed_in_parts", "single_process_quiet", "to_record",
]

log = logging.getLogger(__name__)

METADATA = ".metadata"
_FIX = "restore the checkpoint from a good copy, or save (re-export) it again"


def _metadata_classes() -> dict[tuple[str, str], Any]:
    """``(module, name) -> object`` that a DCP ``.metadata`` pickle may name."""
    from torch.distributed.checkpoint import filesystem, metadata

    objs: list[Any] = [
        metadata.Metadata, metadata.TensorStorageMetadata, metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata, metadata.TensorProperties, metadata._MEM_FORMAT_ENCODING,
        metadata.StorageMeta, metadata.MetadataIndex, filesystem._StorageInfo, torch.Size,
        OrderedDict, set, frozenset,
        # StorageMeta.checkpoint_id is whatever path object the saver passed.
        pathlib.PurePath, pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.Path,
        type(pathlib.Path()),
    ]
    allowed = {(o.__module__, o.__qualname__): o for o in objs}
    for o in objs[-5:]:  # as Pythons before 3.13 name them (pathlib._local since)
        allowed[("pathlib", o.__qualname__)] = o
    # A layout pickles as a call of this name -> layout lookup (torch's weights_only allows it too).
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    # dtypes (and layouts, in other versions) pickle as ``torch.<name>``.
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout)):
            allowed[("torch", name)] = value
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, importing only :func:`_metadata_classes`."""

    def __init__(self, file: IO[bytes], allowed: dict[tuple[str, str], Any]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._allowed:
            return self._allowed[(module, name)]
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"persistent id {pid!r}")


class _Refused(UnsafeFileError):
    """Raised inside the unpickler; :func:`read_metadata` adds the file and the advice."""

    def __init__(self, name: str = "") -> None:
        super().__init__(name, refused=(name,))
        self.name = name


def read_metadata(directory: str | os.PathLike[str]) -> Metadata:
    """The DCP metadata of ``directory``, read without importing anything outside the allow-list.

    Raises:
        UnsafeFileError: ``.metadata`` names a class or function a DCP checkpoint does not hold.
        CorruptFileError: ``.metadata`` is missing, truncated or not DCP metadata.
    """
    file = Path(directory) / METADATA
    try:
        with open(file, "rb") as f:
            meta = _MetadataUnpickler(f, _metadata_classes()).load()
    except _Refused as e:
        raise UnsafeFileError(
            f"refused to load {file}: it would import {e.name}, which a torch.distributed.checkpoint "
            "metadata file never holds (a crafted file can run code this way, so nothing of it was run). "
            "Use only checkpoints from a source you trust; if this one is yours, save it again",
            file=str(file), refused=(e.name,),
        ) from None
    except FileNotFoundError as e:
        raise CorruptFileError(
            f"{file} does not exist: {Path(directory)} is not a torch.distributed.checkpoint directory, "
            "or its save did not finish; pass the directory trainer.save() wrote",
            file=str(file),
        ) from e
    except Exception as e:  # truncated or flipped bytes: EOFError, UnpicklingError, ValueError...
        raise CorruptFileError(
            f"{file} is truncated or damaged ({type(e).__name__}: {e}); {_FIX}", file=str(file),
        ) from e
    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict):
        raise CorruptFileError(
            f"{file} holds a {type(meta).__name__}, not torch.distributed.checkpoint metadata; {_FIX}",
            file=str(file),
        )
    return meta


class SafeReader(FileSystemReader):
    """DCP's file-system reader, reading ``.metadata`` through :func:`read_metadata` and naming
    the file and entry of any item that cannot be read."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self._meta: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # Read once: DCP swallows a metadata error and retries a rank-local file, which would
        # hide the typed error; callers read it first (:func:`load`), and DCP reuses it here.
        if self._meta is None:
            self._meta = read_metadata(str(self.path))
        if self._meta.storage_meta is None:
            self._meta.storage_meta = StorageMeta()
        self._meta.storage_meta.load_id = self.load_id
        return self._meta

    def check_files(self, keys: set[str] | None = None) -> None:
        """Every file holding ``keys`` (all keys: ``None``) exists and is long enough.

        Raises:
            CorruptFileError: a file is missing or shorter than its entries say.
        """
        meta = self.read_metadata()
        ends: dict[str, tuple[int, str]] = {}
        for index, info in (meta.storage_data or {}).items():
            if keys is not None and index.fqn not in keys:
                continue
            end = info.offset + info.length
            if end > ends.get(info.relative_path, (-1, ""))[0]:
                ends[info.relative_path] = (end, index.fqn)
        for relative, (end, key) in sorted(ends.items()):
            file = Path(self.path) / relative
            size = file.stat().st_size if file.is_file() else None
            if size is None or size < end:
                what = "does not exist" if size is None else f"has {size} bytes, its entries need {end}"
                raise CorruptFileError(
                    f"{file} {what} (entry {key!r} among others): the checkpoint is incomplete or "
                    f"truncated; {_FIX}",
                    file=str(file), key=key,
                )

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        # Item by item (each call opens its file once), so that an error names its file and key.
        future = None
        for item in plan.items:
            file = str(Path(self.path) / self.storage_data[item.storage_index].relative_path)
            key = item.dest_index.fqn
            try:
                future = super().read_data(dataclasses.replace(plan, items=[item]), planner)
                future.wait()
            except UnsafeFileError as e:
                raise UnsafeFileError(
                    f"refused to load entry {key!r} of {file}: it would import {', '.join(e.refused)}, "
                    "which pipecut never stores (a crafted file can run code this way, so nothing of it "
                    "was run). Use only checkpoints from a source you trust; if this one is yours, save "
                    "it again",
                    file=file, refused=e.refused,
                ) from None
            except Exception as e:
                refused = self._refused(item) if isinstance(e, pickle.UnpicklingError) else ()
                if refused:  # a tensor entry DCP read with weights_only=True, which refused it
                    raise UnsafeFileError(
                        f"refused to load entry {key!r} of {file}: it would import {', '.join(refused)}, "
                        "which a tensor never needs (a crafted file can run code this way, so nothing "
                        "of it was run). Use only checkpoints from a source you trust",
                        file=file, refused=refused,
                    ) from None
                raise CorruptFileError(
                    f"entry {key!r} of {file} cannot be read ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}); the file is truncated or damaged: {_FIX}",
                    file=file, key=key,
                ) from e
        return future if future is not None else super().read_data(plan, planner)


    def _refused(self, item: ReadItem) -> tuple[str, ...]:
        """The globals outside torch's ``weights_only`` allow-list in ``item``'s bytes, if any."""
        info = self.storage_data[item.storage_index]
        with open(Path(self.path) / info.relative_path, "rb") as f:
            f.seek(info.offset)
            blob = io.BytesIO(f.read(info.length))
        try:
            return tuple(torch.serialization.get_unsafe_globals_in_checkpoint(blob))
        except Exception:  # not even a torch file: damaged, not crafted
            return ()


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor items with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            value.seek(0)
            try:
                refused = tuple(torch.serialization.get_unsafe_globals_in_checkpoint(value))
            except Exception:
                raise e from None  # not a torch file at all: the reader reports it as damaged
            if not refused:
                raise
            raise UnsafeFileError(", ".join(refused), refused=refused) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load(state: dict[str, Any], directory: str | os.PathLike[str], *, collective: bool) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` from ``directory``, in place, safely.

    The metadata is read, and the files holding ``state``'s keys are checked to exist and be
    long enough, before any value is read. DCP's own ``CheckpointException`` (a
    ``BaseException``, which ``except Exception`` misses) never escapes: it becomes the first
    rank's typed error, or a :class:`CheckpointError` carrying it.

    Args:
        state: the flat state to fill (tensors in place, other values by replacement).
        directory: a DCP checkpoint.
        collective: every rank of the process group loads together (DCP's collective load);
            ``False``: this process alone (``no_dist=True``).

    Raises:
        UnsafeFileError: a file would import a class or function outside the allow-list.
        CorruptFileError: a file is missing, truncated or damaged.
        CheckpointError: DCP failed otherwise (the message carries its first failure).
    """
    reader = SafeReader(directory)
    if collective:  # every rank checks every file, so that all raise the same error or none
        reader.check_files()
    else:  # the keys asked for, and those DCP flattened below them (a scheduler's state_dict)
        wanted = set(state)
        reader.check_files({k for k in reader.read_metadata().state_dict_metadata
                            if k in wanted or any(p in wanted for p in _prefixes(k))})
    try:
        with single_process_quiet(), packed_in_parts(state, f"a load from {directory}", collective=collective):
            _dcp_load(state, checkpoint_id=str(directory), storage_reader=reader,
                      planner=SafeLoadPlanner(), no_dist=not collective)
    except CheckpointException as e:
        raise _typed(e, f"torch.distributed.checkpoint could not load {directory}",
                     "check that the checkpoint is complete and was saved by this model") from e


def save(state: dict[str, Any], directory: str | os.PathLike[str], *, collective: bool) -> None:
    """``torch.distributed.checkpoint.save`` of ``state`` to ``directory``, with DCP's
    ``CheckpointException`` (a ``BaseException``) turned into the first rank's typed error or
    a :class:`CheckpointError`.

    Raises:
        CheckpointError: DCP failed on some rank (the message names the rank and its error).
    """
    # Looked up at each call, so that tests can replace dcp.save (untyped: it is re-exported).
    dcp: Any = importlib.import_module("torch.distributed.checkpoint")

    try:
        with single_process_quiet(), packed_in_parts(state, f"a save to {directory}", collective=collective):
            dcp.save(state, checkpoint_id=str(directory), no_dist=not collective)
    except CheckpointException as e:
        raise _typed(e, f"torch.distributed.checkpoint could not save to {directory}",
                     "check that the folder is writable and the disk has room") from e


@contextmanager
def packed_in_parts(state: dict[str, Any], what: str, *, collective: bool) -> Iterator[None]:
    """Show DCP each packed tensor-parallel weight of ``state`` as the parts it holds, for the
    length of a save or a load.

    A ``packed_colwise`` weight (GPT-2's ``c_attn``, ``runtime.parallel.tensor``) is a ``DTensor``
    placed ``_StridedShard(dim, split_factor=k)`` on the tp mesh: tp rank ``t`` holds, side by
    side, its slice of each of the ``k`` parts (q, k, v). DCP describes a ``DTensor``'s local data
    as one chunk at one offset, which is wrong for it (the ranks' chunks overlap on save; a load
    would read the wrong columns). Inside this block each such entry is instead a ``DTensor``
    whose local tensor is torch's ``LocalShardsWrapper`` over ``k`` views of the rank's local
    tensor, each at its own offset of the whole (``j * P + t * P / tp`` along ``dim``, ``P =
    shape[dim] / k``), the way DCP's ``_Checkpointable`` protocol takes several chunks per rank.
    A save writes ``k`` chunks per rank, ``k * tp`` covering the whole once, under the weight's
    own key and whole shape; a load reads into the views, that is into the rank's own tensor,
    from whatever chunks overlap them (another tp's, or one whole tensor). So the checkpoint is
    keyed and shaped as any other, and a plain tensor (tp 1, the plain model) reads it whole
    through DCP's own resharding. The entries are put back on exit; no tensor is copied.

    ``collective``: the ranks tell each other what they cannot store (one small gather), so that
    all raise, or none does, before DCP's own collectives.

    Raises:
        CheckpointError: a ``_StridedShard`` this cannot describe (on a mesh of more than one
            dim, as FSDP2 x tp would make; or a dim not divisible by ``k * tp``), naming the
            weight and what to do instead.
    """
    parts: dict[str, Any] = {}
    problem: str | None = None
    for key, value in state.items():
        strided = [pl for pl in getattr(value, "placements", ()) if hasattr(pl, "split_factor")]
        if not strided:
            continue
        dim, k = strided[0].dim, strided[0].split_factor
        mesh = value.device_mesh
        if mesh.ndim != 1 or value.shape[dim] % (k * mesh.size()):
            problem = problem or (
                f"{key!r} is a packed tensor-parallel weight placed {tuple(value.placements)} on a mesh of shape "
                f"{tuple(mesh.shape)}, global shape {tuple(value.shape)}: only a 1-D tp mesh and a dim divisible "
                f"by {k} parts x {mesh.size()} ranks can be stored as parts")
            continue
        parts[key] = _as_parts(value, dim, k)
    if collective:
        import torch.distributed as dist

        found: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(found, problem)
        problem = next((p for p in found if p is not None), None)
    if problem is not None:
        raise CheckpointError(
            f"{what}: {problem}. export_safetensors writes it whole; to checkpoint, run tensor parallelism "
            "on a 1-D tp mesh (no FSDP2 over it), or keep the packed layer whole (drop its pattern from "
            "TensorParallel(plan=...))")
    kept = {key: state[key] for key in parts}
    state.update(parts)
    try:
        yield
    finally:
        state.update(kept)


def _as_parts(value: Any, dim: int, k: int) -> Any:
    """``value`` (a packed ``DTensor``) with its local tensor as ``k`` views at their global offsets."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    mesh = value.device_mesh
    tp, t = mesh.size(), mesh.get_local_rank()
    width = value.shape[dim] // (k * tp)  # of one part, on one rank
    local = value.to_local()
    views = [local.narrow(dim, j * width, width) for j in range(k)]
    offsets = [tuple((j * tp + t) * width if d == dim else 0 for d in range(value.dim())) for j in range(k)]
    return DTensor.from_local(LocalShardsWrapper(views, offsets), mesh, value.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def _dcp_load(state: dict[str, Any], **kwargs: Any) -> None:
    """DCP's load (a seam: tests make it fail as DCP can)."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    dcp_load(state, **kwargs)


def _typed(e: CheckpointException, what: str, fix: str) -> Exception:
    """What to raise for DCP's ``CheckpointException`` ``e``: the lowest failing rank's error if
    it is one of pipecut's (each rank then raises the same), else a :class:`CheckpointError`."""
    failures = sorted(e.failures.items())
    for _rank, (error, _) in failures:
        if isinstance(error, PipecutError) and isinstance(error, Exception):
            return error
    if not failures:
        return CheckpointError(f"{what}: {e}; {fix}")
    rank, (error, _) = failures[0]
    detail = str(error).splitlines()[0] if str(error) else ""
    return CheckpointError(f"{what}: rank {rank} failed with {type(error).__name__}: {detail}; {fix}")


def _prefixes(key: str) -> Iterator[str]:
    """``a``, ``a.b`` for ``a.b.c``."""
    parts = key.split(".")
    for i in range(1, len(parts)):
        yield ".".join(parts[:i])


@contextmanager
def single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it "assumes the intent is to save/load in a single process",
    which it gives even when told so (``no_dist=True``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


# -- records: non-tensor values as tensors ------------------------------------------------------

_TUPLE = "__tuple__"  # JSON has no tuple; optimizers' betas are one, and must come back one
_NOT_JSON = object()


def to_record(value: Any) -> Any:
    """``value`` as JSON in a 1-D ``uint8`` tensor, when JSON holds it exactly; else ``value``.

    Exactly: ``None``, bools, ints, floats (``NaN`` and infinities too), strings, lists, tuples
    and dicts with string keys. Anything else (a tensor inside a scheduler's state, say) is
    returned as it is, for DCP to store its own way (read back with ``weights_only``).

    Example:
        >>> from_record(to_record({"betas": (0.9, 0.95), "lr": 1e-3, "foreach": None}))
        {'betas': (0.9, 0.95), 'lr': 0.001, 'foreach': None}
    """
    plain = _plain(value)
    if plain is _NOT_JSON:
        return value
    return torch.frombuffer(bytearray(json.dumps(plain).encode("utf-8")), dtype=torch.uint8).clone()


def from_record(value: Any) -> Any:
    """The value :func:`to_record` stored in ``value``; anything but a 1-D ``uint8`` tensor as it is."""
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1):
        return value
    return _unplain(json.loads(value.cpu().numpy().tobytes().decode("utf-8")))


def record_slot(saved: Any, value: Any) -> Any:
    """What DCP loads an entry into: a tensor of the saved shape and dtype when the checkpoint
    holds one (a record), else ``value`` (an older checkpoint's pickled form)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if isinstance(saved, TensorStorageMetadata):
        return torch.empty(tuple(saved.size), dtype=saved.properties.dtype)
    return value


def _plain(value: Any) -> Any:
    """``value`` with tuples tagged, ready for ``json.dumps``; ``_NOT_JSON`` if JSON cannot hold it."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) in (tuple, list):
        items = [_plain(v) for v in value]
        if any(v is _NOT_JSON for v in items):
            return _NOT_JSON
        return {_TUPLE: items} if type(value) is tuple else items
    if type(value) is dict and all(type(k) is str for k in value) and _TUPLE not in value:
        out = {k: _plain(v) for k, v in value.items()}
        return _NOT_JSON if any(v is _NOT_JSON for v in out.values()) else out
    return _NOT_JSON


def _unplain(value: Any) -> Any:
    if isinstance(value, list):
        return [_unplain(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            return tuple(_unplain(v) for v in value[_TUPLE])
        return {k: _unplain(v) for k, v in value.items()}
    return value
