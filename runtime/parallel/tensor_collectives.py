"""The collectives a tensor-parallel stage graph calls, as autograd functions behind small modules.

Legend: ``tp`` ranks of the tensor-parallel group, ``r`` this rank in it.

``runtime.parallel.tensor`` rewrites a stage's graph to call these modules where the split
begins and ends: the input of column-parallel layers (identity forward, all-reduce of the
gradient backward), the output of a row-parallel layer (all-reduce forward), a column output
gathered whole (``colwise_gather_output``), a whole input cut to this rank's columns
(``rowwise_split_input``), and whole keys or values cut to this rank's query heads (fewer kv
heads than ``tp``). Each is exact: its backward is the forward's transpose over the group.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["TensorParallelIn", "TensorParallelOut", "TensorParallelGather", "TensorParallelSplit",
           "TensorParallelHeads"]


class _Enter(torch.autograd.Function):
    """The input of column-parallel layers: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):
    """The output of a row-parallel layer: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Gather(torch.autograd.Function):
    """A column-parallel output made whole: all-gather along the last dim forward; backward, this
    rank's columns of the gradient (every rank holds the whole gradient: the layers after run whole)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.n = group, dist.get_rank(group), x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.narrow(-1, ctx.rank * ctx.n, ctx.n).contiguous(), None


class _Split(torch.autograd.Function):
    """A whole input of a row-parallel layer cut to this rank's columns forward; backward, the
    ranks' column gradients gathered: the whole input's gradient, on every rank."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        tp = dist.get_world_size(group)
        n = x.shape[-1] // tp
        ctx.group, ctx.tp = group, tp
        return x.narrow(-1, dist.get_rank(group) * n, n).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        parts = [torch.empty_like(grad) for _ in range(ctx.tp)]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, -1), None


class _GroupCall(nn.Module):
    """A module a rewritten stage graph calls to apply ``function`` over the tp ``group``."""

    function: ClassVar[type[torch.autograd.Function]]

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function.apply(x, self.group)  # type: ignore[no-any-return]


class TensorParallelIn(_GroupCall):
    """Called by a rewritten stage graph before its column-parallel layers (see :class:`_Enter`)."""

    function = _Enter


class TensorParallelOut(_GroupCall):
    """Called by a rewritten stage graph after a row-parallel layer (see :class:`_Reduce`)."""

    function = _Reduce


class TensorParallelGather(_GroupCall):
    """Called by a rewritten stage graph after a ``colwise_gather_output`` layer (see :class:`_Gather`)."""

    function = _Gather


class TensorParallelSplit(_GroupCall):
    """Called by a rewritten stage graph before a ``rowwise_split_input`` layer (see :class:`_Split`)."""

    function = _Split


class _Heads(torch.autograd.Function):
    """Whole keys or values to this rank's heads: a slice forward; backward, the slice's gradient
    in place in a zero tensor of the whole shape, all-reduced (every rank's heads, whole again)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int, n: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.start, ctx.shape = group, dim, dist.get_rank(group) * n, x.shape
        return x.narrow(dim, ctx.start, n).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        whole = grad.new_zeros(ctx.shape)
        whole.narrow(ctx.dim, ctx.start, grad.shape[ctx.dim]).copy_(grad)
        dist.all_reduce(whole, group=ctx.group)
        return whole, None, None, None


class TensorParallelHeads(nn.Module):
    """Called by a rewritten stage graph on whole keys or values before attention (see :class:`_Heads`)."""

    def __init__(self, group: Any, dim: int, n: int) -> None:
        super().__init__()
        self.group, self.dim, self.n = group, dim, n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Heads.apply(x, self.group, self.dim, self.n)  # type: ignore[no-untyped-call,no-any-return]
