"""Measure the bytes autograd holds for backward: live now, at peak, and saved in all.

Used to check and benchmark activation recomputation (``runtime.execute.recompute``): a recomputing
stage's forward saves nothing, its replay saves what a plain forward would.

Tensors saved for backward are seen through ``torch.autograd.graph.saved_tensors_hooks``; each
is counted by its storage, once however many graph nodes save it (a layer's output read by two
operations), and from when it is saved until the last node holding it is freed. Parameters (and
any tensor given as ``exclude``) are not counted: they live anyway. The hooks are per thread,
so only graphs built in the thread that entered the context are measured (``transport=
'sequential'`` runs every stage in the caller's thread).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch

__all__ = ["SavedBytes"]


class _Held:
    """A saved tensor, as the graph keeps it while our hooks are on (its death frees the count)."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedBytes:
    """Context manager counting the bytes of tensors saved for backward inside it.

    Attributes:
        live: bytes held now by graphs built inside the context.
        peak: the most bytes held at once.
        total: bytes saved in all (each storage counted each time it is first saved).

    Example:
        >>> lin = torch.nn.Linear(256, 256)
        >>> with SavedBytes(exclude=lin.parameters()) as meter:
        ...     y = torch.relu(lin(torch.randn(8, 256)))
        ...     held = meter.live
        ...     del y
        >>> held, meter.live, meter.peak   # the input (8 x 256 fp32) and relu's output
        (16384, 0, 16384)
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._skip = {t.untyped_storage().data_ptr() for t in exclude}
        self._lock = threading.Lock()
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [holders, bytes]
        self.live = 0
        self.peak = 0
        self.total = 0
        self._hooks: Any = None

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._hooks.__exit__(kind, exc, tb)

    def _pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._skip or t.device.type == "meta":
            return t
        held = _Held(t.detach())  # not ``t``: a saved output would hold its own grad_fn, a cycle
        with self._lock:
            ref = self._refs.get(ptr)
            if ref is None:
                self._refs[ptr] = [1, storage.nbytes()]
                self.live += storage.nbytes()
                self.total += storage.nbytes()
                self.peak = max(self.peak, self.live)
            else:
                ref[0] += 1
        weakref.finalize(held, self._release, ptr)
        return held

    def _release(self, ptr: int) -> None:
        with self._lock:
            ref = self._refs[ptr]
            ref[0] -= 1
            if ref[0] == 0:
                self.live -= ref[1]
                del self._refs[ptr]


def _unpack(held: Any) -> torch.Tensor:
    return held.tensor if isinstance(held, _Held) else held
