"""Checkpoint loads as transactions: check against the metadata, read into staging, apply at the end.

A load (``runtime.state.checkpoint.load``, ``load_model``) either changes everything it was asked
to or nothing. The steps, each here:

1. :func:`check_against`: every tensor the load fills has the checkpoint's shape and dtype
   (from DCP's ``.metadata``, before a byte of data is read); the files were checked to exist
   and be long enough by ``runtime.state.safe_dcp``.
2. :func:`stage`: the state to fill, with a fresh tensor in place of each live one, so that DCP
   reads into staging. A damaged entry in the middle of a file is found only when it is read;
   by then the entries before it are in staging, not in the model.
3. :func:`agree`: under torch.distributed, every rank learns whether any rank failed, so that
   all apply or none does.
4. :func:`commit`: the staging copied into the live tensors, once everything has been read.

Memory: staging holds a second copy of what the load replaces on this rank, for the length of
the load: the weights, and the optimizer state when the optimizer already had some. A fresh
optimizer's state (created for the load to have tensors to read into) is its own staging: it
is dropped on failure (:func:`optimizer_rolled_back`), so a resume costs one extra copy of the
rank's weights, not of its optimizer moments. The alternative, reading in place after
checking checksums, still could not undo a read that fails halfway through a file.

Legend: a *key* is a checkpoint entry (``model.<name>``, ``optim.state.<name>.<key>``...).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from runtime.state.weight_errors import (
    CheckpointDtypeError,
    CheckpointShapeError,
    WeightProblem,
    listing,
)

__all__ = ["agree", "check_against", "commit", "optimizer_rolled_back", "stage"]

log = logging.getLogger(__name__)

_CAUSE = (
    "the checkpoint was saved from another model (another config or size), or the run folder "
    "(pipecut train --out) holds an older run's checkpoints: pass the checkpoint of this model, "
    "or start in a fresh --out. Nothing was loaded"
)


def check_against(state: Mapping[str, Any], saved: Mapping[str, Any], source: str) -> None:
    """Every tensor of ``state`` has the shape and dtype ``saved`` (DCP's ``state_dict_metadata``)
    gives its key; a key ``saved`` lacks is skipped (the caller reports missing keys).

    Args:
        state: key -> tensor to fill (a ``DTensor``: its global shape), or another value.
        saved: the checkpoint's metadata by key.
        source: the checkpoint, for the message.

    Raises:
        CheckpointShapeError: some shape differs (the message names each tensor and both shapes).
        CheckpointDtypeError: the shapes agree but some dtype differs.

    Example:
        >>> from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata
        >>> meta = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([24, 8]), [])
        >>> check_against({"model.w": torch.zeros(16, 8)}, {"model.w": meta}, "ckpt")
        Traceback (most recent call last):
        ...
        runtime.state.weight_errors.CheckpointShapeError: ckpt does not fit: 1 tensor differs ...
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    shapes: list[WeightProblem] = []
    dtypes: list[WeightProblem] = []
    for key, value in state.items():
        meta = saved.get(key)
        if not isinstance(value, torch.Tensor) or meta is None:
            continue
        name = key.removeprefix("model.") if key.startswith("model.") else None
        if not isinstance(meta, TensorStorageMetadata):
            shapes.append(WeightProblem(name, key, expected=f"a tensor {_shape(value.shape)}",
                                        found="a non-tensor value"))
        elif tuple(meta.size) != tuple(value.shape):
            shapes.append(WeightProblem(name, key, expected=f"shape {_shape(value.shape)}",
                                        found=f"shape {_shape(meta.size)}"))
        elif meta.properties.dtype != value.dtype:
            dtypes.append(WeightProblem(name, key, expected=str(value.dtype).removeprefix("torch."),
                                        found=str(meta.properties.dtype).removeprefix("torch.")))
    problems, cls = (shapes, CheckpointShapeError) if shapes else (dtypes, CheckpointDtypeError)
    if problems:
        what = "shape" if shapes else "dtype"
        raise cls(
            f"{source} does not fit: {len(problems)} tensor{'s differ' if len(problems) > 1 else ' differs'} "
            f"in {what} from this trainer's:\n{listing(problems)}\n{_CAUSE}",
            source=source, problems=problems,
        )


def stage(state: Mapping[str, Any], *, keep: Callable[[str], bool] = lambda key: False) -> dict[str, Any]:
    """``state`` with each tensor replaced by an empty one like it, for DCP to read into.

    Tensors that share memory (a tied weight under each of its names) share one staging
    tensor. Keys for which ``keep`` is true keep their tensor (a fresh optimizer's state, which
    is dropped if the load fails).
    """
    staged: dict[str, Any] = {}
    by_memory: dict[tuple[Any, ...], torch.Tensor] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or keep(key):
            staged[key] = value
            continue
        where = _memory(value)
        if where is None:
            staged[key] = torch.empty_like(value)
        else:
            staged[key] = by_memory.setdefault(where, torch.empty_like(value))
    return staged


def commit(state: Mapping[str, Any], staged: Mapping[str, Any]) -> dict[str, Any]:
    """Copy each staging tensor into its live tensor; the state as loaded, with live tensors.

    Values DCP replaced rather than filled (non-tensor entries) come from ``staged``.
    """
    applied: dict[str, Any] = {}
    with torch.no_grad():
        for key, live in state.items():
            new = staged[key]
            if isinstance(live, torch.Tensor) and isinstance(new, torch.Tensor) and new is not live:
                live.copy_(new)
                applied[key] = live
            else:
                applied[key] = new
    return applied


def agree(error: Exception | None, *, distributed: bool) -> None:
    """Under torch.distributed, raise on every rank the lowest failing rank's error (a collective:
    every rank calls it, failed or not); else raise ``error`` if any."""
    if distributed:
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed and error is None:
            log.info("rank %d failed the load; this rank applies nothing either", failed[0][0])
        error = error if error is not None else (failed[0][1] if failed else None)
    if error is not None:
        raise error


@contextmanager
def optimizer_rolled_back(opt: torch.optim.Optimizer | None) -> Iterator[None]:
    """Undo what the block did to a *fresh* optimizer (one without state) if it raises.

    The block may create the optimizer's state (a step with zero gradients and lr 0) for a
    load to read into; a failure drops that state and restores the group settings, so the
    optimizer is as before: its first real step creates the state afresh.
    """
    if opt is None or opt.state:
        yield
        return
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    counters = {k: opt.__dict__[k] for k in ("_opt_called", "_step_count") if k in opt.__dict__}
    try:
        yield
    except BaseException:
        opt.state.clear()
        for g, before in zip(opt.param_groups, groups):
            for k in [k for k in g if k != "params" and k not in before]:
                del g[k]
            g.update(before)
        for k in ("_opt_called", "_step_count"):
            if k in counters:
                opt.__dict__[k] = counters[k]
            else:
                opt.__dict__.pop(k, None)
        raise


def _memory(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Where ``t``'s elements live (storage, offset, shape, strides), ``None`` when unknown or empty."""
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: its shard
    if local.numel() == 0 or local.device.type == "meta":
        return None
    try:
        ptr = local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return (type(t), ptr, local.storage_offset(), tuple(local.shape), local.stride(), local.dtype)


def _shape(size: Any) -> str:
    return str(tuple(int(d) for d in size))
