"""A graph's fingerprint: a hash of its structure, shapes and dtypes that a plan is bound to."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

__all__ = ["graph_fingerprint"]


def graph_fingerprint(graph: fx.Graph, *, shapes: bool = True) -> str:
    """sha256 of ``graph``'s structure, shapes and dtypes (see ``TracedModel.fingerprint``).

    Each node contributes its op, target, argument structure (other nodes by position) and the
    shapes and dtypes of ``meta['val']`` (unless ``shapes=False``: region bodies, whose sizes
    may be symbolic). Devices are left out, so the same model traced on another device (or on
    ``meta``, captured as if on the CPU) gets the same fingerprint.

    Example:
        >>> import torch
        >>> from torch import nn, fx
        >>> a = graph_fingerprint(fx.symbolic_trace(nn.Linear(4, 2)).graph)
        >>> a == graph_fingerprint(fx.symbolic_trace(nn.Linear(4, 2)).graph), len(a)
        (True, 64)
    """
    index: dict[fx.Node, int] = {}
    h = hashlib.sha256()
    for i, node in enumerate(graph.nodes):
        index[node] = i
        record = (
            node.op,
            _target_str(node.target),
            _structure(node.args, index),
            _structure(node.kwargs, index),
            _val_signature(node.meta.get("val")) if shapes else None,
        )
        h.update(repr(record).encode())
        h.update(b"\n")
    return h.hexdigest()


def _target_str(target: Any) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    try:
        return fx.node._get_qualified_name(target)
    except Exception:  # builtins without a module; avoid reprs with memory addresses
        return getattr(target, "__qualname__", type(target).__name__)


def _structure(a: Any, index: Mapping[fx.Node, int]) -> Any:
    if isinstance(a, fx.Node):
        return f"%{index[a]}"
    if isinstance(a, (tuple, list)):
        return (type(a).__name__, tuple(_structure(b, index) for b in a))
    if isinstance(a, dict):
        return tuple((str(k), _structure(v, index)) for k, v in a.items())
    if isinstance(a, slice):
        return ("slice", _structure((a.start, a.stop, a.step), index))
    if isinstance(a, torch.device):
        return "<device>"
    if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.layout, torch.memory_format)):
        return repr(a)
    return type(a).__qualname__


def _val_signature(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return (tuple(int(d) for d in val.shape), str(val.dtype))
    if isinstance(val, (tuple, list)):
        return tuple(_val_signature(v) for v in val)
    if val is None or isinstance(val, (bool, int, float, str)):
        return repr(val)
    return type(val).__qualname__
