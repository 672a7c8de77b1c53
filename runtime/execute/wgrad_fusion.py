"""Weight-gradient accumulation fusion: a stage's linear layers add ``dL/dW`` into ``W.grad`` in place.

With ``m`` micro-batches, plain autograd computes every weight gradient into a fresh tensor and
then adds it to ``W.grad`` (``AccumulateGrad``): per layer and micro-batch one allocation and
one pass that reads two weight-sized tensors and writes one. When a micro-batch is small those
passes, not the matmuls' arithmetic, are much of the backward's cost (a skinny matmul is
bound by memory traffic too). Megatron-LM's ``gradient_accumulation_fusion`` removes them by
having the weight-gradient GEMM accumulate into the gradient buffer (``beta = 1``); this module
does the same on any device with ``torch.addmm_``, by rewriting a stage's FX graph:

* ``call_module`` of an ``nn.Linear`` (exactly that class, so subclasses that change
  ``forward`` are left alone), ``F.linear`` / ``aten.linear`` and ``aten.addmm`` (Hugging Face's
  ``Conv1D`` form, ``bias + x @ W``) whose weight is a parameter read by ``get_attr``
  become calls of :func:`linear_accumulate` / :func:`addmm_accumulate`;
* a weight used by more than one node, or listed in ``skip`` (tied weights that other stages
  share: their ``.grad`` may be written by another thread), is left to autograd, and so is any
  weight smaller than ``min_numel`` elements, where the Python ``autograd.Function`` costs more
  than the pass it saves.

The fused weight's gradient bypasses ``AccumulateGrad``, so hooks registered on that parameter
(``register_hook``, ``register_post_accumulate_grad_hook``) do not fire for it, and the fused
layers are not twice differentiable (``create_graph=True``); the trainer option
``fuse_wgrad=False`` turns the rewrite off.

Split backward (zero-bubble schedules) gets the split for free: ``I`` runs inside
:func:`deferring`, where a fused layer computes its input gradient and only records its
weight-gradient GEMM; ``W`` runs the recorded GEMMs (:func:`accumulate_deferred`) without
touching the autograd graph, and under :func:`owing` adds, once, the gradients of fused layers
that ``I`` did not reach (``runtime.execute.split_backward``).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import fx, nn

__all__ = [
    "accumulate_deferred", "addmm_accumulate", "deferring", "fuse_weight_grad_accumulation", "fused_params",
    "linear_accumulate", "owing",
]

log = logging.getLogger(__name__)

# Below this many weight elements (256 KiB in fp32) the saved pass is cheaper than the ~20 us
# a Python autograd.Function adds to a forward and a backward.
DEFAULT_MIN_NUMEL = 1 << 16


Work = Callable[[], None]


class _Mode:
    """What a fused layer's backward does with its parameters' gradients: one per thread.

    ``sink`` set (split backward's ``I``): record ``(parameter, work)`` for ``W`` to run later.
    ``owed`` set (split backward's ``W``): run the work only for parameters still owed (their
    layer did not run in ``I``), once each. Neither (a fused ``B``): run it.

    A fused layer keeps the mode of the thread that ran its forward (the stage's thread, which
    also runs its backward) and reads that one in backward: autograd runs the backward of CUDA
    ops on a worker thread of its own, where a thread-local read would see no mode at all.
    """

    def __init__(self) -> None:
        self.sink: list[tuple[torch.Tensor, Work]] | None = None
        self.owed: dict[int, torch.Tensor] | None = None


class _PerThread(threading.local):
    def __init__(self) -> None:
        self.mode = _Mode()


_local = _PerThread()


def _current() -> _Mode:
    """This thread's mode (what :func:`deferring` and :func:`owing` set)."""
    mode: _Mode = _local.mode
    return mode


@contextmanager
def deferring() -> Iterator[list[tuple[torch.Tensor, Work]]]:
    """Within: fused layers whose forward ran on this thread record their parameter-gradient
    work instead of running it.

    Split backward's ``I`` runs inside it; ``W`` then calls :func:`accumulate_deferred`.
    """
    mode = _current()
    sink: list[tuple[torch.Tensor, Work]] = []
    before, mode.sink = mode.sink, sink
    try:
        yield sink
    finally:
        mode.sink = before


@contextmanager
def owing(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Within: fused layers whose forward ran on this thread add gradients only for ``params``, each once."""
    mode = _current()
    before, mode.owed = mode.owed, {id(p): p for p in params}
    try:
        yield
    finally:
        mode.owed = before


def accumulate_deferred(work: Sequence[tuple[torch.Tensor, Work]]) -> None:
    """Run the gradient work :func:`deferring` recorded."""
    for _, run in work:
        run()


def _param_grad(mode: _Mode, prm: torch.Tensor, work: Work) -> None:
    """A fused layer's gradient for ``prm``: run now, recorded for later, or skipped (``mode``)."""
    if mode.sink is not None:
        mode.sink.append((prm, work))
    elif mode.owed is None or mode.owed.pop(id(prm), None) is not None:
        work()


def _accumulate(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``weight.grad += a @ b``, in place when the buffer allows it."""
    grad = weight.grad
    if grad is None:
        weight.grad = torch.mm(a, b).to(weight.dtype)
    elif grad.dtype == a.dtype == b.dtype and grad.is_contiguous():
        grad.addmm_(a, b)
    else:  # mixed precision (autocast) or an odd layout: the plain way
        grad.add_(torch.mm(a, b).to(grad.dtype))


def _accumulate_bias(bias: torch.Tensor, g: torch.Tensor) -> None:
    """``bias.grad +=`` ``g`` summed down to the bias's shape (``g``: (tokens, out))."""
    part = g if g.dim() == bias.dim() else g.sum(0)
    if bias.grad is None:
        bias.grad = part.to(bias.dtype, copy=True)
    else:
        bias.grad.add_(part.to(bias.grad.dtype))


class _LinearAccumulate(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose backward adds ``dL/dweight`` (and a parameter bias's
    gradient, with ``own_bias``) into ``.grad`` itself."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, own_bias: bool
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.mode = _current()
        ctx.has_bias = bias is not None
        ctx.bias = bias if own_bias else None  # a leaf parameter: no reference cycle
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None, None]:
        (g,) = grad_outputs  # one output, one gradient
        x, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])  # (tokens, out)
        gx = g.matmul(weight.to(g.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1]).to(g.dtype)  # (tokens, in)
            _param_grad(ctx.mode, weight, functools.partial(_accumulate, weight, g2.t(), x2))  # (out, in)
        gb = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            if ctx.bias is not None:
                _param_grad(ctx.mode, ctx.bias, functools.partial(_accumulate_bias, ctx.bias, g2))
            else:
                gb = g2.sum(0)
        return gx, None, gb, None


class _AddmmAccumulate(torch.autograd.Function):
    """``torch.addmm(bias, x, weight)`` (``weight``: (in, out)) adding ``dL/dweight`` into ``weight.grad``."""

    @staticmethod
    def forward(ctx: Any, bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, own_bias: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.mode = _current()
        ctx.bias_shape = bias.shape
        ctx.bias = bias if own_bias else None
        return torch.addmm(bias, x, weight)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        (g,) = grad_outputs  # one output, one gradient
        x, weight = ctx.saved_tensors
        gx = g.mm(weight.to(g.dtype).t()).to(x.dtype) if ctx.needs_input_grad[1] else None
        if ctx.needs_input_grad[2]:
            _param_grad(ctx.mode, weight, functools.partial(_accumulate, weight, x.to(g.dtype).t(), g))  # (in, out)
        gb = None
        if ctx.needs_input_grad[0]:
            if ctx.bias is not None:
                _param_grad(ctx.mode, ctx.bias, functools.partial(_accumulate_bias, ctx.bias, g))
            else:
                gb = g if len(ctx.bias_shape) == 2 else g.sum(0)
                gb = gb.reshape(ctx.bias_shape) if gb.shape != ctx.bias_shape else gb
        return gb, gx, None, None


# torch leaves Function.apply unannotated (it returns Any); these are its types for the two functions.
_linear_accumulate_apply: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, bool], torch.Tensor]
_linear_accumulate_apply = _LinearAccumulate.apply
_addmm_accumulate_apply: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]
_addmm_accumulate_apply = _AddmmAccumulate.apply


def linear_accumulate(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, own_bias: bool = False
) -> torch.Tensor:
    """``F.linear`` with weight-gradient accumulation fusion (see the module docstring).

    ``own_bias``: add the bias's gradient into ``bias.grad`` too (a parameter used only here);
    else it is returned to autograd.

    Example:
        >>> w = nn.Parameter(torch.randn(3, 4))
        >>> linear_accumulate(torch.randn(2, 4), w).sum().backward()
        >>> linear_accumulate(torch.randn(2, 4), w).sum().backward()  # added in place
        >>> w.grad.shape
        torch.Size([3, 4])
    """
    return _linear_accumulate_apply(x, weight, bias, own_bias)


def addmm_accumulate(bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, own_bias: bool = False) -> torch.Tensor:
    """``torch.addmm(bias, x, weight)`` with weight-gradient accumulation fusion."""
    return _addmm_accumulate_apply(bias, x, weight, own_bias)


# fx records these functions as call_function targets, so a rewritten graph stays printable.
fx.wrap("linear_accumulate")
fx.wrap("addmm_accumulate")

_LINEAR_TARGETS = {F.linear, torch._C._nn.linear, torch.ops.aten.linear.default}
_ADDMM_TARGETS = {torch.addmm, torch.ops.aten.addmm.default}


def _param(gm: fx.GraphModule, node: object) -> nn.Parameter | None:
    if isinstance(node, fx.Node) and node.op == "get_attr":
        try:
            obj = gm.get_parameter(str(node.target))
        except AttributeError:
            return None
        return obj
    return None


def fused_params(module: nn.Module) -> tuple[nn.Parameter, ...]:
    """The parameters whose gradients a rewritten module's layers add themselves (none if not rewritten)."""
    return tuple(getattr(module, "pipecut_fused_params", ()))


def _uses(gm: fx.GraphModule) -> dict[int, int]:
    """How many graph nodes read each parameter (through ``get_attr`` or a module call)."""
    count: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            prm = _param(gm, node)
            if prm is not None:
                count[id(prm)] = count.get(id(prm), 0) + len(node.users)
        elif node.op == "call_module":
            for prm in gm.get_submodule(str(node.target)).parameters():
                count[id(prm)] = count.get(id(prm), 0) + 1
    return count


class _Eligible:
    """Which parameters a rewritten layer may take over: read by that node alone and not in ``skip``."""

    def __init__(self, gm: fx.GraphModule, skip: Collection[nn.Parameter], least: int) -> None:
        self.skip_ids = {id(p) for p in skip}
        self.uses = _uses(gm)
        self.least = least

    def own(self, prm: nn.Parameter | None) -> bool:
        """A bias the layer may add the gradient of itself."""
        return prm is not None and prm.requires_grad and id(prm) not in self.skip_ids and self.uses.get(id(prm), 0) == 1

    def weight(self, prm: nn.Parameter | None) -> bool:
        """A weight worth fusing: owned, 2-D and of at least ``least`` elements."""
        return (
            prm is not None and prm.requires_grad and id(prm) not in self.skip_ids
            and self.uses.get(id(prm), 0) == 1 and prm.numel() >= self.least and prm.dim() == 2
        )


def _fuse_linear_module(gm: fx.GraphModule, node: fx.Node, ok: _Eligible) -> tuple[nn.Parameter, ...] | None:
    """Replace a ``call_module`` of an ``nn.Linear`` by :func:`linear_accumulate` on its parameters."""
    graph = gm.graph
    mod = gm.get_submodule(str(node.target))
    if type(mod) is not nn.Linear:
        return None
    # torch types Linear.weight as a plain Tensor and .bias as never None; they are
    # Parameters, and bias is None for Linear(..., bias=False).
    weight, mod_bias = cast(nn.Parameter, mod.weight), cast("nn.Parameter | None", mod.bias)
    if not ok.weight(weight):
        return None
    bias = mod_bias if ok.own(mod_bias) else None
    with graph.inserting_before(node):
        w = graph.get_attr(f"{node.target}.weight")
        b = graph.get_attr(f"{node.target}.bias") if mod_bias is not None else None
        new = graph.call_function(linear_accumulate, (node.args[0], w, b, bias is not None))
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return tuple(p for p in (weight, bias) if p is not None)


def _fuse_linear_call(gm: fx.GraphModule, node: fx.Node, ok: _Eligible) -> tuple[nn.Parameter, ...] | None:
    """Retarget ``F.linear(x, weight, bias)`` / ``aten.linear`` to :func:`linear_accumulate`."""
    if not ok.weight(weight := _param(gm, node.args[1])):
        return None
    bias = _param(gm, node.args[2]) if len(node.args) > 2 else None
    bias = bias if ok.own(bias) else None
    node.target = linear_accumulate
    node.args = (*node.args, *(None,) * (3 - len(node.args)), bias is not None)
    return tuple(p for p in (weight, bias) if p is not None)


def _fuse_addmm(gm: fx.GraphModule, node: fx.Node, ok: _Eligible) -> tuple[nn.Parameter, ...] | None:
    """Retarget ``addmm(bias, x, weight)`` (Hugging Face's ``Conv1D``) to :func:`addmm_accumulate`."""
    if not ok.weight(weight := _param(gm, node.args[2])):
        return None
    bias = _param(gm, node.args[0])
    bias = bias if ok.own(bias) else None
    node.target = addmm_accumulate
    node.args = (*node.args, bias is not None)
    return tuple(p for p in (weight, bias) if p is not None)


def _fuse_node(gm: fx.GraphModule, node: fx.Node, ok: _Eligible) -> tuple[nn.Parameter, ...] | None:
    """Rewrite ``node`` if it is an eligible linear layer; the parameters it took over, else None."""
    if node.kwargs:
        return None
    if node.op == "call_module" and len(node.args) == 1:
        return _fuse_linear_module(gm, node, ok)
    if node.op == "call_function" and node.target in _LINEAR_TARGETS and len(node.args) >= 2:
        return _fuse_linear_call(gm, node, ok)
    if node.op == "call_function" and node.target in _ADDMM_TARGETS and len(node.args) == 3:
        return _fuse_addmm(gm, node, ok)
    return None


def fuse_weight_grad_accumulation(
    gm: fx.GraphModule, *, skip: Collection[nn.Parameter] = (), min_numel: int | None = None
) -> int:
    """Rewrite ``gm`` in place so that its eligible linear layers accumulate weight gradients.

    Only the graph changes: submodules, parameters (under every alias), buffers and their
    persistence stay as they are, so ``gm.state_dict()`` is unchanged.

    Args:
        gm: a stage module (``torch.fx.GraphModule``).
        skip: parameters never to fuse (weights tied across stages).
        min_numel: smallest weight, in elements, worth fusing (default ``DEFAULT_MIN_NUMEL``).

    Returns:
        How many layers this call fused.

    Example:
        >>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(512, 512), nn.ReLU()))
        >>> fuse_weight_grad_accumulation(gm)
        1
        >>> [p.shape for p in fused_params(gm)]
        [torch.Size([512, 512]), torch.Size([512])]
    """
    ok = _Eligible(gm, skip, DEFAULT_MIN_NUMEL if min_numel is None else min_numel)
    fused: list[nn.Parameter] = []
    n = 0
    for node in list(gm.graph.nodes):
        taken = _fuse_node(gm, node, ok)
        if taken is None:
            continue
        fused += taken
        n += 1
    if n == 0:
        return 0
    gm.graph.lint()
    gm.recompile()
    # torch types Module.__setattr__'s value as a Tensor or Module; a plain attribute is fine at runtime.
    gm.pipecut_fused_params = fused_params(gm) + tuple(fused)  # type: ignore[assignment]
    log.debug("fused weight-gradient accumulation into %d linear layers", n)
    return n
