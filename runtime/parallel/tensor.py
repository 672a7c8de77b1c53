"""Tensor parallelism inside a stage: Megatron's column/row pairs written into the stage's graph.

Legend: ``tp`` ranks of the tensor-parallel group, ``r`` this rank in it, ``d`` the dimension
of an activation that is split over ``tp`` (its *sharded dim*); shapes ``(B, T, C)``.

A stage module is a ``torch.fx`` graph of ``aten`` ops that reads its weights through
``get_attr`` (``runtime.parallel.blocks`` explains why), so torch's parallel styles, which wrap
an ``nn.Linear``'s forward, have nothing to attach to. :func:`parallelize_stage` rewrites the
graph instead, as Megatron-LM writes its layers: each ``aten.linear`` whose weight the plan calls
``colwise`` keeps rows ``r / tp`` of it (its output is this rank's heads or hidden units) behind
an identity whose backward all-reduces the input's gradient; each ``rowwise`` one keeps columns
``r / tp`` and all-reduces its output (bias added after). Between the two the graph runs on
local tensors, so the shape ops that name a head count (Llama's grouped-query ``expand`` and
``reshape``) are rewritten to the local count: the sharded dim is followed op by op through the
global shapes the trace recorded, and an op whose rule is not known, or that would mix shards
(a stage output, a slice across heads), is refused with its node named. One all-reduce per
attention and one per MLP forward, as many backward: the design, measured, is in
docs/tensor-parallel.md (DTensor's own propagation of the same graph does not finish a forward
on CPU in minutes: it decomposes the CPU attention kernel op by op).

Sharded weights become ``DTensor`` parameters (``Shard(0)`` or ``Shard(1)`` on the group's 1-D
mesh), each rank holding its shard only; the graph reads them through ``to_local``, so their
gradients are ``DTensor`` shards too. Every other parameter stays a whole tensor: every op that
reads one (norms, embeddings, a row-parallel bias) sees activations that are identical on every
rank (whole stage inputs, all-reduced row outputs), and the gradient reaching it is whole too
(the column inputs' backward all-reduce runs before it), so its gradient is bitwise the same on
every rank without a reduction.

Example:
    >>> plan_for({"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"},
    ...          ["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight",
    ...           "model.layers.0.mlp.down_proj.bias", "model.norm.weight"])
    {'model.layers.0.mlp.up_proj.weight': 'colwise', 'model.layers.0.mlp.down_proj.weight': 'rowwise', \
'model.layers.0.mlp.down_proj.bias': 'rowwise'}
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from partitioner.errors import PipecutError

__all__ = [
    "STYLES", "TensorParallelError", "TensorParallelLayout", "parallelize_stage", "plan_for", "plan_from_config",
]

log = logging.getLogger(__name__)

STYLES = ("colwise", "rowwise")
_ELEMENTWISE = {
    "add", "sub", "mul", "div", "neg", "silu", "gelu", "relu", "tanh", "sigmoid", "pow", "rsqrt", "exp",
    "to", "_to_copy", "clone", "contiguous", "alias", "dropout", "type_as", "where", "masked_fill",
}
_VIEWS = {"view", "reshape", "_unsafe_view"}


class TensorParallelError(PipecutError, ValueError):
    """The plan or the stage cannot be split over the tensor-parallel group; the message names
    the parameter or node, the values, and what to do instead."""


@dataclass(frozen=True)
class TensorParallelLayout:
    """What :func:`parallelize_stage` did to a stage.

    Attributes:
        tp: ranks in the group.
        sharded: sharded parameter name -> the dim split over ``tp`` (0 rows, 1 columns).
        forward_all_reduces: all-reduces one forward of the stage runs (one per row-parallel layer).
        backward_all_reduces: all-reduces one backward runs (one per input of column-parallel layers).
    """

    tp: int
    sharded: Mapping[str, int]
    forward_all_reduces: int
    backward_all_reduces: int


def plan_for(patterns: Mapping[str, str], names: Iterable[str]) -> dict[str, str]:
    """Map a Hugging Face style tp plan onto a stage's parameter names.

    A pattern names a module relative to the base model (``layers.*.self_attn.q_proj``, ``*``
    one path segment); it matches a parameter whose owner's path is the pattern or ends with
    ``.`` + the pattern (``model.layers.3.self_attn.q_proj.weight`` in a ``...ForCausalLM``).

    Args:
        patterns: module pattern -> style (``config.base_model_tp_plan``, or a user's plan).
        names: the stage's parameter names.

    Returns:
        Parameter name -> ``'colwise'`` or ``'rowwise'``, for the parameters a pattern matches.

    Raises:
        TensorParallelError: a pattern matching one of ``names`` has a style this module does
            not implement (``packed_colwise``, ``moe_tp_experts``, ``embedding_rowwise``...).
    """
    compiled = [(re.compile(r"(?:^|.*\.)" + re.escape(p).replace(r"\*", r"[^.]+") + r"$"), p, s)
                for p, s in patterns.items()]
    out: dict[str, str] = {}
    for name in names:
        owner = name.rpartition(".")[0]
        for rx, pattern, style in compiled:
            if not rx.match(owner):
                continue
            if style not in STYLES:
                raise TensorParallelError(
                    f"tp plan entry {pattern!r}: {style!r} (it matches {name!r}) is not a style pipecut "
                    f"shards yet (known: {', '.join(STYLES)}); expert, packed and vocabulary styles are "
                    "not implemented: pass plan= without that entry to keep those weights whole on "
                    "every tp rank, or run this model with tp=1"
                )
            out[name] = style
            break
    return out


def plan_from_config(config: Any, names: Iterable[str]) -> dict[str, str]:
    """The tp plan of a Hugging Face config (``config.base_model_tp_plan``) on these parameter names.

    Raises:
        TensorParallelError: the config has no plan (GPT-2's fused ``Conv1D`` layers have none:
            ``c_attn`` packs q, k and v in one weight, which needs a packed style not
            implemented yet), or :func:`plan_for` refuses one of its styles.
    """
    patterns = getattr(config, "base_model_tp_plan", None)
    if not patterns:
        raise TensorParallelError(
            f"{type(config).__name__} has no base_model_tp_plan: pass plan={{module pattern: 'colwise' | "
            "'rowwise'}} (e.g. {'layers.*.mlp.up_proj': 'colwise', 'layers.*.mlp.down_proj': 'rowwise'}); "
            "GPT-2's Conv1D c_attn packs q, k and v in one weight and is not supported yet"
        )
    return plan_for(dict(patterns), names)


def parallelize_stage(
    gm: fx.GraphModule,
    plan: Mapping[str, str],
    group: Any,
) -> TensorParallelLayout:
    """Shard ``gm``'s planned weights over ``group`` and rewrite its graph to compute the same function.

    ``gm`` (a stage, blocks outlined or not) is changed in place: the parameters in ``plan``
    become ``DTensor`` shards under the same names, and each graph it holds is rewritten and
    recompiled. It still takes and returns whole tensors, equal (to round-off: the row-parallel
    sums run in another order) to what it computed before, on every rank of the group. Every
    rank must hold the same weights before (the stage built alike on each) and call this alike.

    Args:
        gm: the stage module, traced to ``aten`` ops (``torch.export``: Hugging Face models).
        plan: parameter name -> ``'colwise'`` | ``'rowwise'`` (:func:`plan_for`,
            :func:`plan_from_config`); a bias follows its weight.
        group: the tensor-parallel ``ProcessGroup`` or a 1-D ``DeviceMesh``.

    Returns:
        What was sharded and the all-reduces a forward and a backward run.

    Raises:
        TensorParallelError: a planned weight is not read by one ``aten.linear`` of the graph
            (a ``Conv1D``'s ``addmm``, an embedding, a weight tied elsewhere), a split dim is not
            divisible by ``tp`` (heads, kv heads, hidden units), or the sharded activations reach
            an op with no rule or leave the stage (a cut between a column layer and its row layer).

    Example:
        >>> import torch.distributed as dist  # doctest: +SKIP
        >>> layout = parallelize_stage(stage, plan_from_config(cfg, names), dist.group.WORLD)  # doctest: +SKIP
        >>> layout.forward_all_reduces  # doctest: +SKIP
        4
    """
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise TensorParallelError(f"the tp mesh must be 1-D; got {group.ndim} dims {group.mesh_dim_names}: "
                                      "pass mesh['tp']")
        mesh, pg = group, group.get_group()
    else:
        pg = group
        device = next((p.device.type for p in gm.parameters()), "cpu")
        mesh = DeviceMesh.from_group(pg, device)
    tp, rank = dist.get_world_size(pg), dist.get_rank(pg)
    params = dict(gm.named_parameters(remove_duplicate=False))
    unknown = sorted(set(plan) - set(params))
    if unknown:
        raise TensorParallelError(f"tp plan names {len(unknown)} parameter(s) this stage does not hold, e.g. "
                                  f"{unknown[0]!r}: map the plan onto this stage's names with plan_for")
    bad = {n: s for n, s in plan.items() if s not in STYLES}
    if bad:
        n, s = next(iter(bad.items()))
        raise TensorParallelError(f"{n!r}: style {s!r} is not one of {STYLES}")
    rw = _Rewriter(gm, plan, pg, tp)
    for prefix, sub in list(gm.named_modules()):
        if isinstance(sub, fx.GraphModule):
            rw.rewrite(sub, prefix + "." if prefix else "")
    missed = sorted(set(plan) - rw.seen, key=lambda n: (not n.endswith("weight"), n))
    if missed:
        reader = rw.readers.get(missed[0], "no op")
        raise TensorParallelError(
            f"{missed[0]!r} is in the tp plan but is read by {reader}, not as the weight of an aten.linear: "
            "only linear layers are split (a Conv1D, GPT-2's c_attn/c_fc/c_proj, runs addmm on an (in, out) "
            "weight, and c_attn packs q, k and v: not supported yet); drop it from the plan to keep it whole"
        )
    from torch.distributed.tensor import DTensor, Shard

    for name, dim in rw.sharded.items():
        owner_path, _, leaf = name.rpartition(".")
        owner = gm.get_submodule(owner_path)
        whole = params[name].detach()
        rows = whole.shape[dim] // tp
        local = whole.narrow(dim, rank * rows, rows).clone()
        shard = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)
        setattr(owner, leaf, nn.Parameter(shard, requires_grad=params[name].requires_grad))
    layout = TensorParallelLayout(tp=tp, sharded=dict(rw.sharded), forward_all_reduces=rw.reduces,
                                  backward_all_reduces=rw.enters)
    log.info("tensor parallel over %d ranks: %d weights sharded, %d all-reduces a forward, %d a backward",
             tp, len(layout.sharded), layout.forward_all_reduces, layout.backward_all_reduces)
    return layout


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


class TensorParallelIn(nn.Module):
    """Called by a rewritten stage graph before its column-parallel layers (see :class:`_Enter`)."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Enter.apply(x, self.group)  # type: ignore[no-untyped-call,no-any-return]


class TensorParallelOut(nn.Module):
    """Called by a rewritten stage graph after a row-parallel layer (see :class:`_Reduce`)."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Reduce.apply(x, self.group)  # type: ignore[no-untyped-call,no-any-return]


class _Rewriter:
    """Rewrites the graphs of one stage; collects what it sharded and the collectives it added."""

    def __init__(self, root: fx.GraphModule, plan: Mapping[str, str], group: Any, tp: int) -> None:
        self.root, self.plan, self.group, self.tp = root, plan, group, tp
        self.sharded: dict[str, int] = {}
        self.seen: set[str] = set()
        self.reduces = self.enters = 0
        self.readers: dict[str, str] = {}  # planned parameter -> the op that reads it, for errors

    def rewrite(self, gm: fx.GraphModule, prefix: str) -> None:
        graph = gm.graph
        local: dict[fx.Node, int] = {}  # node -> its sharded dim
        entered: dict[fx.Node, fx.Node] = {}
        changed = False
        for node in list(graph.nodes):
            if node.op == "get_attr" and prefix + str(node.target) in self.plan and node.users:
                user = next(iter(node.users))
                self.readers[prefix + str(node.target)] = f"{user.name} ({user.target})"
            if node.op == "call_module" and not isinstance(gm.get_submodule(str(node.target)), fx.GraphModule):
                mod = gm.get_submodule(str(node.target))
                held = [prefix + str(node.target) + "." + n for n, _ in mod.named_parameters()]
                if any(h in self.plan for h in held):
                    raise TensorParallelError(
                        f"node {node.name}: layer {prefix}{node.target} is called as a module (an fx trace), "
                        "so its weights cannot be split in the graph: trace the model with torch.export "
                        "(pipecut's default for Hugging Face models) or drop it from the tp plan")
            if node.op == "call_function" and _op(node) == "linear":
                style = self._style(gm, prefix, node)
                if style is not None:
                    self._linear(gm, prefix, node, style, local, entered)
                    changed = True
                    continue
            ins = [a for a in node.all_input_nodes if a in local]
            if not ins:
                continue
            if node.op == "output":
                raise TensorParallelError(
                    f"{prefix or 'the stage'}: {ins[0].name} leaves the graph split over tp (a cut between a "
                    "column-parallel layer and its row-parallel layer): cut the pipeline between blocks")
            d = _propagate(node, local, self.tp)
            if d is not None:
                local[node] = d
            changed = True
        if changed:
            graph.lint()
            gm.recompile()

    def _style(self, gm: fx.GraphModule, prefix: str, node: fx.Node) -> str | None:
        w = node.args[1]
        if not (isinstance(w, fx.Node) and w.op == "get_attr"):
            return None
        name = prefix + str(w.target)
        style = self.plan.get(name)
        if style is None:
            return None
        users = [u for u in w.users if u is not node]
        if users:
            raise TensorParallelError(f"{name!r} (tp {style}) is read by {users[0].name} besides {node.name}: a "
                                      "weight tied to another op stays whole; drop it from the tp plan")
        return style

    def _linear(self, gm: fx.GraphModule, prefix: str, node: fx.Node, style: str,
                local: dict[fx.Node, int], entered: dict[fx.Node, fx.Node]) -> None:
        graph = gm.graph
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        assert isinstance(x, fx.Node) and isinstance(w, fx.Node)
        wname = prefix + str(w.target)
        shape = tuple(gm.get_parameter(str(w.target)).shape)
        dim = 0 if style == "colwise" else 1
        if shape[dim] % self.tp:
            what = "output features (heads x head dim, or hidden units)" if dim == 0 else "input features"
            raise TensorParallelError(f"{wname!r} ({style}) has {shape[dim]} {what}, not divisible by tp={self.tp}: "
                                      f"pick a tp that divides {shape[dim]}")
        self.sharded[wname] = dim
        self.seen.add(wname)
        owner = str(w.target).rpartition(".")[0]
        with graph.inserting_before(node):
            wl = graph.call_method("to_local", (w,))
            wl.meta = dict(node.meta)
            node.replace_input_with(w, wl)
            bl = None
            if isinstance(b, fx.Node) and b.op == "get_attr":
                bname = prefix + str(b.target)
                self.seen.add(bname)
                if style == "colwise":
                    self.sharded[bname] = 0
                    bl = graph.call_method("to_local", (b,))
                    bl.meta = dict(node.meta)
                    node.replace_input_with(b, bl)
        if style == "colwise":
            if x in local:
                raise TensorParallelError(f"node {node.name}: {wname!r} is colwise but its input {x.name} is already "
                                          "split over tp (two column-parallel layers in a row): make the first rowwise")
            if x not in entered:
                path = _free(gm, owner + ".pipecut_tp_in")
                gm.add_submodule(path, TensorParallelIn(self.group))
                with graph.inserting_before(node):
                    entered[x] = graph.call_module(path, (x,))
                entered[x].meta = dict(node.meta)
                self.enters += 1
            node.replace_input_with(x, entered[x])
            local[node] = len(_shape(node)) - 1
            return
        if local.get(x) != len(_shape(x)) - 1:
            raise TensorParallelError(
                f"node {node.name}: {wname!r} is rowwise but its input {x.name} is "
                + ("whole on every rank" if x not in local else f"split on dim {local[x]}, not its last")
                + ": a row-parallel layer must follow its column-parallel ones in the same stage")
        path = _free(gm, owner + ".pipecut_tp_out")
        gm.add_submodule(path, TensorParallelOut(self.group))
        if b is not None:
            node.args = (x, node.args[1])
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "bias"}
        with graph.inserting_after(node):
            red = graph.call_module(path, (node,))
        red.meta = dict(node.meta)
        last = red
        if b is not None:
            with graph.inserting_after(red):
                last = graph.call_function(torch.ops.aten.add.Tensor, (red, b))
            last.meta = dict(node.meta)
        node.replace_all_uses_with(last, delete_user_cb=lambda u: u is not red)
        self.reduces += 1


def _free(gm: nn.Module, path: str) -> str:
    """``path``, or ``path`` + ``_1``, ``_2``... where a module is already installed there."""
    taken = dict(gm.named_modules())
    out, k = path, 0
    while out in taken:
        k += 1
        out = f"{path}_{k}"
    return out


def _op(node: fx.Node) -> str:
    """The aten op's name without its overload (``'linear'`` for ``aten.linear.default``)."""
    packet = getattr(node.target, "overloadpacket", None)
    return str(getattr(packet, "__name__", node.target)) if node.op == "call_function" else str(node.target)


def _shape(node: Any) -> tuple[int, ...]:
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
        "expand, attention); cut the stage so this op is outside a column/row pair, or drop the pair from the plan")


def _propagate(node: fx.Node, local: dict[fx.Node, int], tp: int) -> int | None:
    """The sharded dim of ``node``'s output (``None``: whole), rewriting its size arguments to local sizes."""
    op = _op(node) if node.op == "call_function" else f"{node.op} {node.target}"
    if node.op == "call_method" and node.target in ("contiguous", "clone"):
        op = str(node.target)
    out = _shape(node)
    a: Any = node.args  # fx types each argument as any Argument: the op fixes them
    x = a[0] if a else None
    d = local.get(x, -1) if isinstance(x, fx.Node) else -1
    if op in _ELEMENTWISE:
        return _elementwise(node, local, out)
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
        whole = start in (None, 0) and (end is None or (isinstance(end, int) and end >= _shape(x)[dim]))
        if dim == d and not whole:
            raise _refuse(node, f"slices the split dim {d}")
        return d
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
        d2 = d + len(sizes) - len(_shape(x))
        node.args = (x, _local_sizes(node, sizes, d2, out, tp), *a[2:])
        return d2
    if op in _VIEWS:
        d2 = _view_dim(node, _shape(x), out, d, tp)
        node.args = (x, _local_sizes(node, list(a[1]), d2, out, tp), *a[2:])
        return d2
    if op == "scaled_dot_product_attention":
        q, k, v = a[:3]
        heads = len(out) - 3
        if any(local.get(t, -1) != heads for t in (q, k, v)):
            raise _refuse(node, "attention needs q, k and v all split by heads")
        mask = a[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node):
            m = _shape(mask)
            if mask in local or (len(m) > len(out) - 1 - heads and m[heads - len(out)] != 1):
                raise _refuse(node, f"its mask {mask.name} varies over the heads")
        return heads
    if op == "sym_size" and int(a[1]) % len(_shape(x)) != d:
        return None  # the size of a dim that is whole: the same on every rank
    raise _refuse(node, f"{op} has no rule for split tensors")


def _elementwise(node: fx.Node, local: dict[fx.Node, int], out: tuple[int, ...]) -> int:
    dims = set()
    for a in _flat(node.args, node.kwargs):
        if isinstance(a, fx.Node) and a in local:
            dims.add(local[a] + len(out) - len(_shape(a)))
    if len(dims) != 1:
        raise _refuse(node, "its operands are split on different dims")
    (d,) = dims
    for a in _flat(node.args, node.kwargs):
        if isinstance(a, fx.Node) and a not in local and "val" in a.meta and hasattr(a.meta["val"], "shape"):
            s = _shape(a)
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
