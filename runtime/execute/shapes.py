"""Wire shapes for a micro-batch size other than the plan's example, found without computing.

The plan records each crossing value's shape for the example micro-batch. A trainer that runs
another micro-batch size needs the receive-buffer shapes for it before any data moves (the
distributed transport allocates them ahead: no handshake). We interpret the traced graph on fake
tensors -- no memory, no FLOPs -- and keep every value's shape, without touching the graph's own
metadata.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from partitioner.errors import InputShapeError, PlanMismatchError
from partitioner.tracing.globalstate import preserved
from partitioner.tracing.trace import InputMeta
from runtime.precision import fake_slots, whole_fake_params

__all__ = ["wire_shapes", "check_fixed_dims"]


class _ShapeRecorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.shapes: dict[str, tuple[int, ...]] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.shapes[n.name] = tuple(int(d) for d in out.shape)
        return out


def wire_shapes(gm: fx.GraphModule, inputs: Mapping[str, Any], *, method: str = "fx") -> dict[str, tuple[int, ...]]:
    """Shape of every tensor value of ``gm`` for the given graph inputs, by node name.

    Args:
        gm: the traced graph (its placeholders named as in ``inputs``).
        inputs: one micro-batch of graph inputs by placeholder name (real or fake tensors).
        method: the tracer that made ``gm``; ``'export'`` graphs are specialised to the example
            shapes, which the error message then explains.

    Raises:
        PlanMismatchError: the graph cannot run on these input shapes.

    Example:
        >>> from torch import nn
        >>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 8), nn.ReLU()))
        >>> wire_shapes(gm, {"input_1": torch.zeros(5, 4)})["_1"]
        (5, 8)
    """
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = [mode.from_tensor(inputs[n]) if isinstance(inputs[n], torch.Tensor) else inputs[n] for n in names]
    rec = _ShapeRecorder(gm)
    try:
        # Leaf modules run on fake tensors still write their real buffers in place
        # (BatchNorm's num_batches_tracked): finding shapes must leave the model as it was.
        with preserved(gm, what="wire_shapes()"), whole_fake_params(gm, mode), _meta_as_fake(gm, mode, fake), mode, \
                _quiet(_FAKE_LOG):
            rec.run(*fake)
    except Exception as e:  # any op may reject the new shapes: say why in pipecut's terms
        given = {n: tuple(v.shape) for n, v in inputs.items() if isinstance(v, torch.Tensor)}
        hint = (
            " torch.export fixed the sizes the model could not leave free: plan with example "
            "inputs of the shapes you train with."
            if method == "export"
            else ""
        )
        raise PlanMismatchError(
            f"the planned graph cannot run on micro-batch inputs of shapes {given} "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}).{hint}"
        ) from e
    return rec.shapes


@contextmanager
def _meta_as_fake(gm: fx.GraphModule, mode: FakeTensorMode, inputs: Sequence[Any]) -> Iterator[None]:
    """Within: every parameter and buffer still on ``meta`` is a fake tensor on the inputs' device.

    A model built on meta keeps the stages of other ranks there (each rank materialises only its
    own): run as they are beside the inputs' real device, they would fail the fake run for mixing
    devices, though only their shapes matter. Put back on exit.
    """
    device = next((x.device for x in inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
    with fake_slots(gm, mode, lambda t: device if t.is_meta and device.type != "meta" else None, buffers=True):
        yield


# FakeTensorMode logs a traceback at ERROR level when an op rejects the shapes; the error we
# raise says it better, so that log is silenced while shapes are found.
_FAKE_LOG = "torch._subclasses.fake_tensor"


@contextmanager
def _quiet(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(before)


def check_fixed_dims(traced: Sequence[InputMeta], mb_inputs: Mapping[str, Any]) -> None:
    """Check one micro-batch of inputs against the sizes the traced graph keeps fixed.

    An export-traced graph leaves the batch (and, where the model allowed it, an integer input's
    sequence length) free and fixes every other size; a graph from torch.fx fixes none itself.

    Raises:
        InputShapeError: an input has another number of dimensions, or another size in a fixed
            dimension, than the traced example; the message names both shapes and the fix.

    Example:
        >>> meta = InputMeta("ids", (2, 16), "torch.int64", dynamic=(0,))
        >>> check_fixed_dims([meta], {"ids": torch.zeros(4, 16)})   # another batch: fine
        >>> check_fixed_dims([meta], {"ids": torch.zeros(4, 32)})
        Traceback (most recent call last):
        ...
        partitioner.errors.InputShapeError: input 'ids': the plan's graph was traced with micro-batches of shape (2, 16) and keeps dimension 1 fixed at 16, but got (4, 32). ...
    """  # noqa: E501 - the error message above is one line, as the doctest compares it
    for meta in traced:
        x = mb_inputs.get(meta.name)
        if meta.dynamic is None or not isinstance(x, torch.Tensor):
            continue
        got = tuple(int(d) for d in x.shape)
        fixed = [i for i in range(len(meta.shape)) if i not in meta.dynamic]
        if len(got) == len(meta.shape) and all(got[i] == meta.shape[i] for i in fixed):
            continue
        if len(got) != len(meta.shape):
            why = f"has {len(meta.shape)} dimensions"
        else:
            bad = [i for i in fixed if got[i] != meta.shape[i]]
            why = "keeps " + ", ".join(f"dimension {i} fixed at {meta.shape[i]}" for i in bad)
        raise InputShapeError(
            f"input {meta.name!r}: the plan's graph was traced with micro-batches of shape "
            f"{meta.shape} and {why}, but got {got}. torch.export fixes the sizes the model does "
            "not leave free (free here: "
            f"{', '.join(f'dimension {i}' for i in meta.dynamic) or 'none'}). Re-plan with example "
            f"inputs of shape {got} (partition(model, example, ...)), or bring the inputs to the "
            "traced size (pad or crop)."
        )
