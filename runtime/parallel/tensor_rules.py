"""The rules that follow a tensor-parallel split through a stage graph, op by op.

Legend: ``tp`` ranks of the tensor-parallel group, ``d`` the dimension of an activation split over
``tp`` (its *sharded dim*), ``k`` the outputs a *packed* layer holds side by side (GPT-2's
``c_attn``: q, k and v, ``k = 3``).

``runtime.parallel.tensor`` rewrites a stage so that the activations between a column-parallel
layer and its row-parallel one are each rank's part only. Here, for each op that reads such an
activation, :func:`propagate` says on which dim its output is split and rewrites the sizes the op
names (a view to ``(B, T, H, hd)`` names ``H``, the global head count: it becomes ``H / tp``).
The sizes come from the global shapes ``torch.export`` recorded on every node. An op with no
rule, or one that would mix the ranks' parts (a slice across heads, a cat with a whole tensor),
is refused with the node named. A packed layer's output is split into its ``k`` parts by a
``split`` along the sharded dim: that split (and only that one) is rewritten to the local part
size, since each rank holds its slice of every part (``_StridedShard``), not a contiguous block.
At the end, the graph readings the rewrite asks: a layer's head count, a packed layer's parts,
and whether a whole tensor can carry a gradient.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from partitioner.errors import PipecutError

__all__ = ["ELEMENTWISE", "TensorParallelError", "op_name", "propagate", "shape_of"]

ELEMENTWISE = {
    "add", "sub", "mul", "div", "neg", "silu", "gelu", "relu", "tanh", "sigmoid", "pow", "rsqrt", "exp",
    "to", "_to_copy", "clone", "contiguous", "alias", "dropout", "type_as", "where", "masked_fill",
    # Comparisons and the other pointwise ops activations are made of (xIELU's gt/expm1/where,
    # squared ReLU's square, clamps): each element of the output from the same elements of the inputs.
    "gt", "ge", "lt", "le", "eq", "ne", "square", "abs", "sqrt", "log", "log1p", "expm1", "erf", "softplus",
    "clamp", "clamp_min", "clamp_max", "minimum", "maximum", "sign", "reciprocal", "sin", "cos", "elu",
    "leaky_relu", "hardtanh", "mish", "hardswish", "hardsigmoid", "relu6", "logical_and", "logical_or",
    "logical_not", "bitwise_and", "bitwise_or", "bitwise_not", "__and__", "__or__", "lerp", "addcmul",
    "addcdiv", "zeros_like", "ones_like", "full_like", "empty_like", "copy", "floor", "ceil", "round",
}
_VIEWS = {"view", "reshape", "_unsafe_view"}
# Reductions over some dims (``aten.mean(x, [-1], True)``: a per-head norm over the head dim).
_REDUCTIONS = {"mean", "sum", "amax", "amin", "var", "std", "linalg_vector_norm", "norm"}
_SPLITS = {"split", "split_with_sizes", "chunk"}


class TensorParallelError(PipecutError, ValueError):
    """The plan or the stage cannot be split over the tensor-parallel group; the message names
    the parameter or node, the values, and what to do instead."""


def op_name(node: fx.Node) -> str:
    """The aten op's name without its overload (``'linear'`` for ``aten.linear.default``)."""
    packet = getattr(node.target, "overloadpacket", None)
    return str(getattr(packet, "__name__", node.target)) if node.op == "call_function" else str(node.target)


def shape_of(node: Any) -> tuple[int, ...]:
    """The global shape the trace recorded for ``node`` (symbolic sizes by their hints)."""
    if not isinstance(node, fx.Node):
        return tuple(node.shape) if isinstance(node, torch.Tensor) else ()
    val = node.meta.get("val", node.meta.get("tensor_meta"))
    if val is None or not hasattr(val, "shape"):
        raise TensorParallelError(f"node {node.name} has no recorded shape (meta 'val'): tensor parallelism "
                                  "follows the shapes torch.export records; trace the stage with torch.export")
    return tuple(_int(s) for s in val.shape)


def _int(s: Any) -> int:
    if isinstance(s, int):
        return s
    hint = getattr(getattr(s, "node", None), "hint", None)
    return int(hint if hint is not None else s)


def _refuse(node: fx.Node, why: str) -> TensorParallelError:
    return TensorParallelError(
        f"node {node.name} ({node.target}) reads an activation split over tp, and {why}: pipecut's tensor "
        "parallelism knows the ops of attention and MLP blocks (elementwise, views, transpose, slice, cat, "
        "stack, expand, reductions over other dims, attention); cut the stage so this op is outside a "
        "column/row pair, or drop the pair from the plan")


def propagate(node: fx.Node, local: dict[fx.Node, int], packed: dict[fx.Node, int], tp: int) -> int | None:
    """The sharded dim of ``node``'s output (``None``: whole), rewriting its size arguments to local sizes.

    Args:
        node: an op reading at least one split activation (a key of ``local``).
        local: split activation -> its sharded dim, for the nodes before ``node``.
        packed: split activation -> ``k``, for the outputs of packed layers not split into their
            parts yet; ``node``'s entry is added when it carries the packing on.
        tp: ranks in the group.

    Raises:
        TensorParallelError: the op has no rule, or would mix the ranks' parts (the node named).
    """
    op = op_name(node) if node.op == "call_function" else f"{node.op} {node.target}"
    if node.op == "call_method" and node.target in ("contiguous", "clone"):
        op = str(node.target)
    a: Any = node.args  # fx types each argument as any Argument: the op fixes them
    x = a[0] if a else None
    d = local.get(x, -1) if isinstance(x, fx.Node) else -1
    if node.op == "call_function" and node.target is operator.getitem:
        return d  # one part of a split along the sharded dim, or of one along a whole dim: split alike
    if op in _SPLITS:
        return _split(node, d, packed.get(x) if isinstance(x, fx.Node) else None, tp)
    out = shape_of(node)
    k = packed.get(x) if isinstance(x, fx.Node) else None
    if k is not None and op not in _VIEWS and op not in ELEMENTWISE:
        raise _refuse(node, f"reads the output of a packed layer ({k} parts side by side) before it is split "
                      "into its parts")
    if op in ("min", "max") and len(node.args) > 1 and isinstance(a[1], fx.Node):
        op = "minimum"  # min(x, other), max(x, other): pointwise, as minimum and maximum
    if op in ELEMENTWISE:
        d = _elementwise(node, local, out)
        if k is not None:
            packed[node] = k
        return d
    if op == "transpose":
        i, j = (int(k) % len(out) for k in a[1:3])
        return j if d == i else i if d == j else d
    if op == "permute":
        return [int(i) % len(out) for i in a[1]].index(d)
    if op == "unsqueeze":
        k = int(a[1]) % len(out)
        return d + 1 if k <= d else d
    if op == "slice":
        dim = int(a[1]) % len(out)
        start = a[2] if len(node.args) > 2 else None
        end = a[3] if len(node.args) > 3 else None
        whole = start in (None, 0) and (end is None or (isinstance(end, int) and end >= shape_of(x)[dim]))
        if dim == d and not whole:
            raise _refuse(node, f"slices the split dim {d}")
        return d
    if op in _REDUCTIONS:
        return _reduction(node, d, len(shape_of(x)))
    if op in ("softmax", "_softmax", "log_softmax", "_log_softmax"):  # eager attention's, over the keys
        if int(a[1]) % len(out) == d:
            raise _refuse(node, f"normalises over the split dim {d}")
        return d
    if op in ("matmul", "bmm"):  # eager attention's q @ k^T and p @ v: both split on one batch (head) dim
        other = a[1]
        dims = {local.get(t, -1) + len(out) - len(shape_of(t)) for t in (x, other) if isinstance(t, fx.Node)}
        if len(dims) != 1 or any(t not in local for t in (x, other)) or next(iter(dims)) >= len(out) - 2:
            raise _refuse(node, "multiplies it with a tensor not split on the same batch (head) dim")
        return next(iter(dims))
    if op == "flatten":  # flatten(x, start, end): dims start..end become one
        rank = len(shape_of(x))
        start = int(a[1]) % rank if len(node.args) > 1 else 0
        end = int(a[2]) % rank if len(node.args) > 2 else rank - 1
        if start < d <= end:
            raise _refuse(node, f"flattens the split dim {d} into dim {start}")
        return d if d <= start else d - (end - start)
    if op == "stack":
        parts = a[0]
        kw: Any = node.kwargs
        dim = int(a[1] if len(node.args) > 1 else kw.get("dim", 0)) % len(out)
        dims = {local.get(p, -1) for p in parts}
        if len(dims) != 1 or -1 in dims:
            raise _refuse(node, "stacks it with a whole tensor")
        (d,) = dims
        return d + 1 if dim <= d else d
    if op == "cat":
        parts, dim = a[0], int(a[1]) if len(node.args) > 1 else 0
        dims = {local.get(p, -1) for p in parts}
        if len(dims) != 1 or -1 in dims:
            raise _refuse(node, "joins it with a whole tensor")
        (d,) = dims
        if dim % len(out) == d:
            raise _refuse(node, f"concatenates along the split dim {d}")
        return d
    if op == "expand":
        sizes = list(a[1])
        d2 = d + len(sizes) - len(shape_of(x))
        node.args = (x, _local_sizes(node, sizes, d2, out, tp), *a[2:])
        return d2
    if op in _VIEWS:
        src = shape_of(x)
        d2 = _view_dim(node, src, out, d, tp)
        if k is not None:
            if out[d2] != src[d]:
                raise _refuse(node, f"reshapes the output of a packed layer ({k} parts side by side) on its "
                              f"split dim ({src} -> {out}) before it is split into its parts")
            packed[node] = k
        node.args = (x, _local_sizes(node, list(a[1]), d2, out, tp), *a[2:])
        return d2
    if op == "scaled_dot_product_attention":
        q, k, v = a[:3]
        heads = len(out) - 3
        if any(local.get(t, -1) != heads for t in (q, k, v)):
            raise _refuse(node, "attention needs q, k and v all split by heads")
        mask = a[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node):
            m = shape_of(mask)
            if mask in local or (len(m) > len(out) - 1 - heads and m[heads - len(out)] != 1):
                raise _refuse(node, f"its mask {mask.name} varies over the heads")
        return heads
    if op == "sym_size" and int(a[1]) % len(shape_of(x)) != d:
        return None  # the size of a dim that is whole: the same on every rank
    raise _refuse(node, f"{op} has no rule for split tensors")


def _reduction(node: fx.Node, d: int, rank: int) -> int:
    """The rule of a reduction: over dims other than ``d`` each rank reduces its own part (its
    heads' own norms); over ``d`` it would need the other ranks' parts, and is refused."""
    a: Any = node.args
    kw: Any = node.kwargs
    op = op_name(node)
    at = 2 if op in ("linalg_vector_norm", "norm") else 1  # norm(x, ord, dim, keepdim)
    dims = a[at] if len(a) > at else kw.get("dim")
    keep = a[at + 1] if len(a) > at + 1 else kw.get("keepdim", False)
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        raise _refuse(node, "reduces over every dim, the split one included")
    dims = [int(i) % rank for i in (dims if isinstance(dims, (list, tuple)) else [dims])]
    if d in dims:
        raise _refuse(node, f"reduces over the split dim {d}")
    return d if keep else d - sum(1 for i in dims if i < d)


def _split(node: fx.Node, d: int, k: int | None, tp: int) -> int:
    """The rule of ``split``, ``split_with_sizes`` and ``chunk``: along a whole dim every part stays
    split on ``d``; along ``d`` only a packed layer's output splits, into its ``k`` parts."""
    a: Any = node.args
    kw: Any = node.kwargs
    x = a[0]
    src = shape_of(x)
    dim = int(a[2] if len(a) > 2 else kw.get("dim", 0)) % len(src)
    if dim != d:
        return d
    if k is None:
        raise _refuse(node, f"splits the split dim {d} (a layer packing several outputs in one weight, as "
                      "GPT-2's c_attn packs q, k and v, is 'packed_colwise' in the plan)")
    op = op_name(node)
    whole = src[d]
    if op == "chunk":
        sizes = [whole // a[1]] * a[1]
    else:
        sizes = [a[1]] * (whole // a[1]) if op == "split" else list(a[1])
    if len(sizes) != k or len(set(sizes)) != 1 or any(isinstance(z, fx.Node) for z in sizes):
        raise _refuse(node, f"splits a packed layer's {k} parts into {sizes} (packed_colwise needs {k} equal parts)")
    if op == "split":
        node.args = (x, a[1] // tp, *a[2:])
    elif op == "split_with_sizes":
        node.args = (x, [z // tp for z in a[1]], *a[2:])
    return d


def _elementwise(node: fx.Node, local: dict[fx.Node, int], out: tuple[int, ...]) -> int:
    dims = set()
    for a in _flat(node.args, node.kwargs):
        if isinstance(a, fx.Node) and a in local:
            dims.add(local[a] + len(out) - len(shape_of(a)))
    if len(dims) != 1:
        raise _refuse(node, "its operands are split on different dims")
    (d,) = dims
    for a in _flat(node.args, node.kwargs):
        if isinstance(a, fx.Node) and a not in local and "val" in a.meta and hasattr(a.meta["val"], "shape"):
            s = shape_of(a)
            k = d - (len(out) - len(s))
            if k >= 0 and s[k] != 1:
                raise _refuse(node, f"it combines it with {a.name}, whole along the split dim {d}")
    return d


def _flat(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
    return [*args, *kwargs.values()]


def _view_dim(node: fx.Node, src: tuple[int, ...], out: tuple[int, ...], d: int, tp: int) -> int:
    """The output dim of a view/reshape that the split input dim ``d`` lands on: the outermost of
    the dims it splits into, or the merged dim it is the outermost of."""
    before = math.prod(src[:d])
    for d2 in range(len(out)):
        if math.prod(out[:d2]) == before and out[d2] != 1:
            if out[d2] % tp:
                raise TensorParallelError(
                    f"node {node.name} ({node.target}) splits a tp-split dim into {out[d2]} (heads?), not "
                    f"divisible by tp={tp}: pick a tp dividing the heads and the kv heads ({out})")
            return d2
    raise _refuse(node, f"the view {src} -> {out} moves the split dim {d} inside another dim")


def _local_sizes(node: fx.Node, sizes: list[Any], d: int, out: tuple[int, ...], tp: int) -> list[Any]:
    s = sizes[d]
    if isinstance(s, fx.Node):
        raise _refuse(node, f"its size at the split dim {d} is symbolic ({s.name})")
    if s != -1:
        sizes[d] = out[d] // tp
    return sizes


def _head_count(node: fx.Node) -> int | None:
    """The heads a layer's output is viewed as (``(..., n * hd) -> (..., n, hd)``, through views
    only), or ``None``: no such view (an MLP's hidden units)."""
    at = node
    while len(at.users) == 1:
        (nxt,) = at.users
        if op_name(nxt) not in ("view", "reshape", "_unsafe_view"):
            return None
        src, out = shape_of(at), shape_of(nxt)
        if len(out) == len(src) + 1 and out[:-2] == src[:-1] and out[-2] * out[-1] == src[-1]:
            return out[-2]
        at = nxt
    return None


def _packed_parts(node: fx.Node, wname: str) -> int:
    """How many outputs a ``packed_colwise`` layer holds side by side: the parts of the ``split``
    (or ``chunk``) of its output along its last dim, found through the views between."""
    at = node
    while len(at.users) == 1:
        (nxt,) = at.users
        op, a, kw = op_name(nxt), list[Any](nxt.args), dict[str, Any](nxt.kwargs)  # the op fixes the types
        if op in ("view", "reshape", "_unsafe_view") and shape_of(nxt)[-1] == shape_of(at)[-1]:
            at = nxt
            continue
        if op in ("split", "split_with_sizes", "chunk"):
            dim = int(a[2] if len(a) > 2 else kw.get("dim", 0))
            whole = shape_of(at)[-1]
            if dim % len(shape_of(at)) == len(shape_of(at)) - 1:
                size = a[1]
                if op == "chunk":
                    return int(size)
                return whole // int(size) if op == "split" else len(size)
        break
    raise TensorParallelError(
        f"{wname!r} is packed_colwise but its output ({node.name}) is not split into its parts along the last dim "
        "(a split or chunk after it, through views only): mark it 'colwise' if it is one output, or leave it whole")


def _gradient_source(gm: nn.Module, node: fx.Node) -> str | None:
    """``'weight'`` when ``node`` is computed from a trainable parameter, ``'input'`` when from a
    floating-point stage input (which may arrive with a gradient), else ``None``."""
    seen: set[fx.Node] = set()
    todo, found = [node], None
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr":
            attr = _attr_or_none(gm, str(n.target))
            if isinstance(attr, nn.Parameter) and attr.requires_grad:
                return "weight"
        elif n.op == "placeholder":
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                found = "input"
        todo.extend(n.all_input_nodes)
    return found


def _attr_or_none(gm: nn.Module, target: str) -> Any:
    try:
        return operator.attrgetter(target)(gm)
    except AttributeError:
        return None
