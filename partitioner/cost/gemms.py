"""The matrix products a model runs, forward and backward, with their shapes and counts: the sizes
a calibration times (``Probe.with_gemms``)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from partitioner.cost.analytic import Coster
from partitioner.cost.probes import GemmShape
from partitioner.tracing.globalstate import preserved
from partitioner.tracing.trace import TracedModel

__all__ = ["model_gemms"]

log = logging.getLogger(__name__)


class _GemmRecorder(TorchDispatchMode):
    """Records the shape of every matrix product that reaches ATen (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.shapes: list[GemmShape] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        shape = _gemm_shape(func, args)
        if shape is not None:
            self.shapes.append(shape)
        return func(*args, **(kwargs or {}))


def _gemm_shape(func: Any, args: Sequence[Any]) -> GemmShape | None:
    aten = torch.ops.aten
    if func in (aten.mm.default, aten.bmm.default):
        a, b = args[0], args[1]
    elif func in (aten.addmm.default, aten.baddbmm.default):
        a, b = args[1], args[2]
    else:
        return None
    try:
        if a.dim() == 2:
            return GemmShape(int(a.shape[0]), int(a.shape[1]), int(b.shape[1]))
        return GemmShape(int(a.shape[1]), int(a.shape[2]), int(b.shape[2]), batch=int(a.shape[0]))
    except (TypeError, RuntimeError):  # a symbolic size without a hint: not a shape to time
        return None


def model_gemms(traced: TracedModel | fx.GraphModule) -> dict[GemmShape, int]:
    """The matrix products one micro-batch of the model runs, forward and backward, with how many
    times each runs: "the sizes the model uses", for ``Probe.with_gemms``.

    Every distinct call of the graph (as the cost model groups them) is replayed once on fake
    tensors under a dispatch mode that records ``mm``/``addmm``/``bmm``/``baddbmm`` shapes, and
    counted as often as the graph repeats it. Fused attention kernels are no GEMM here; the
    roofline prices their FLOPs at the measured GEMM speed too.

    Example:
        >>> from torch import nn
        >>> from partitioner.tracing.trace import trace
        >>> t = trace(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)), (torch.randn(4, 64),))
        >>> sorted(model_gemms(t).items())[:2]
        [(GemmShape(rows=4, inner=8, cols=32, batch=1), 1), (GemmShape(rows=4, inner=32, cols=8, batch=1), 1)]
    """
    gm = traced.gm if isinstance(traced, TracedModel) else traced
    with preserved(what="model_gemms()"):
        coster = Coster(gm)
        coster.run()
        counts = Counter(key for key, _ in coster.calls.values())
        first = dict(coster.calls.values())  # one call per distinct key
        found: Counter[GemmShape] = Counter()
        for key, prepared in first.items():
            recorder = _GemmRecorder()
            try:
                with coster.mode:
                    call = coster.fake_call(prepared)
                    with recorder:
                        out = call.fn(*call.args, **call.kwargs)
                        call.backward([o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)])
            except Exception as e:  # a node fake tensors cannot run: the cost model warned already
                log.debug("no GEMM shapes from %s: %s", prepared[0].name, e)
            for shape in recorder.shapes:
                found[shape] += counts[key]
    return dict(found)
