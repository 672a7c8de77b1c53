"""How one stage's messages are laid out, derived once from the plan's wiring.

Legend: ``s`` a stage, ``q`` a stage sending to it (a producer), ``c`` a stage reading its
outputs (a consumer). A message from ``q`` to ``s`` holds the values ``q`` produces that ``s``
reads, in ``q``'s output order; only floating values get a gradient back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from partitioner.errors import PlanFormatError
from partitioner.plan.split import StageIO, ValueSpec
from runtime.transport.p2p import TensorMeta

__all__ = ["Wiring", "wire", "message_values", "is_float", "on_wire", "dtype_of", "model_output", "merge_microbatches"]


def message_values(ios: Sequence[StageIO], src: int, dst: int) -> list[ValueSpec]:
    """The values stage ``src`` sends stage ``dst`` for one micro-batch, in wire order."""
    return [v for v in ios[src].outputs if dst in v.consumers and v.producer == src]


def is_float(v: ValueSpec) -> bool:
    """Whether a value is a floating tensor (a gradient flows back for it)."""
    return v.kind == "tensor" and any(k in v.dtype for k in ("float", "bfloat", "complex"))


@dataclass(frozen=True)
class Wiring:
    """One stage's messages, derived once from the plan (a step only looks them up)."""

    producers: tuple[int, ...]  # stages sending this one activations, ascending
    consumers: tuple[int, ...]  # stages reading this one's outputs, ascending
    recv_vals: dict[int, tuple[ValueSpec, ...]]  # per producer: the message's values, wire order
    recv_grad: dict[int, tuple[bool, ...]]  # per producer: which of them get a gradient back
    send_idx: dict[int, tuple[int, ...]]  # per consumer: output positions, wire order
    grad_vals: dict[int, tuple[ValueSpec, ...]]  # per consumer: the values whose gradient returns
    grad_mask: dict[int, tuple[bool, ...]]  # per consumer: which of the message's values those are
    grad_args: dict[int, tuple[int, ...]]  # per producer: input positions of the gradients sent back
    args: tuple[tuple[str, bool], ...]  # per input: (name, is a graph input)


def wire(ios: Sequence[StageIO], s: int) -> Wiring:
    """Stage ``s``'s :class:`Wiring`, from every stage's inputs and outputs."""
    io = ios[s]
    producers = tuple(sorted({v.producer for v in io.inputs if v.producer >= 0}))
    consumers = tuple(sorted({c for v in io.outputs if v.producer == s for c in v.consumers}))
    out_pos = {v.name: i for i, v in enumerate(io.outputs)}
    in_pos = {v.name: i for i, v in enumerate(io.inputs)}
    recv_vals = {q: tuple(message_values(ios, q, s)) for q in producers}
    sent = {c: tuple(message_values(ios, s, c)) for c in consumers}
    return Wiring(
        producers=producers,
        consumers=consumers,
        recv_vals=recv_vals,
        recv_grad={q: tuple(is_float(v) for v in vals) for q, vals in recv_vals.items()},
        send_idx={c: tuple(out_pos[v.name] for v in vals) for c, vals in sent.items()},
        grad_vals={c: tuple(v for v in vals if is_float(v)) for c, vals in sent.items()},
        grad_mask={c: tuple(is_float(v) for v in vals) for c, vals in sent.items()},
        grad_args={q: tuple(in_pos[v.name] for v in vals if is_float(v)) for q, vals in recv_vals.items()},
        args=tuple((v.name, v.producer < 0) for v in io.inputs),
    )


def on_wire(tensors: Sequence[torch.Tensor], metas: Sequence[TensorMeta]) -> list[torch.Tensor]:
    """``tensors`` in their message's dtypes (the receiver allocates those: ``runtime.precision``)."""
    return [t if t.dtype == mt.dtype else t.to(mt.dtype) for t, mt in zip(tensors, metas)]


def dtype_of(name: str) -> torch.dtype:
    """The ``torch.dtype`` a plan names (``'torch.float32'`` or ``'float32'``)."""
    dt = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise PlanFormatError(f"unknown dtype {name!r} in the plan")
    return dt


def model_output(flat: Sequence[Any], spec: pytree.TreeSpec | None) -> Any:
    """The model's output from the last stage's flat outputs: rebuilt with ``spec`` (the plan's
    ``output_treespec()``: a Hugging Face ``ModelOutput``, a dict...), else the one output itself,
    or the tuple of several.

    Example:
        >>> import torch
        >>> _, spec = pytree.tree_flatten({"logits": 0, "loss": 0})
        >>> model_output((torch.ones(1), torch.zeros(())), spec)["loss"]
        tensor(0.)
        >>> model_output((torch.ones(1),), None)
        tensor([1.])
    """
    if spec is not None:
        return pytree.tree_unflatten(list(flat), spec)
    return flat[0] if len(flat) == 1 else tuple(flat)


def merge_microbatches(column: Sequence[Any]) -> Any:
    """One output over the micro-batches: rows concatenated, a 0-dim float (a loss) averaged,
    anything else the first micro-batch's.

    Example:
        >>> merge_microbatches([torch.ones(2, 3), torch.zeros(1, 3)]).shape
        torch.Size([3, 3])
        >>> merge_microbatches([torch.tensor(1.0), torch.tensor(3.0)])
        tensor(2.)
    """
    first = column[0]
    if not isinstance(first, torch.Tensor):
        return first
    if first.dim():
        return torch.cat(list(column))
    return torch.stack(list(column)).mean() if first.is_floating_point() else first
