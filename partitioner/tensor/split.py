"""What a tensor-parallel group splits in a traced graph, found from the graph, and the costs that follow.

Legend: ``tp`` ranks in a tensor-parallel group, ``B x T x C`` a block's activation (rows,
tokens, hidden), ``P`` parameters.

The runtime (``runtime.parallel.tensor``, docs/tensor-parallel.md) splits each block of a stage
the way Megatron-LM does: a linear layer inside a block that reads a *whole* activation is
split column-wise (q, k, v, gate, up; GPT-2's packed ``c_attn`` and ``c_fc``), every op after it
works on ``1 / tp`` of the heads or hidden units, and the linear layer that reads the *split*
activation is split row-wise (o, down; GPT-2's ``c_proj``) and all-reduces its output, so the
block's residual stream, its norms, the embeddings and the LM head stay whole on every rank.

:func:`find_split` finds those pairs in the graph by following the split value node by node
(a linear inside a block reading a parameter of two dimensions is *sharded*: column when its
activation input is whole, row when it is split; any other op reading a split value makes a split
value). Per pair the runtime runs one all-reduce of the row layer's output forward and one of the
column layers' input gradient backward (q, k and v share one): two of ``B x T x C`` per block
forward and two backward, Megatron's count. A graph whose split values leave their block (a
linear outside the pattern, say) is not split: :attr:`TensorSplit.problem` says where.

:func:`shard_costs` turns the graph's per-node costs into one tp rank's: the sharded weights
(their gradients and optimizer state with them) ``1 / tp``, a row layer's bias whole; the compute,
the saved activations and the bytes of every op between a column layer and its row layer ``1 /
tp``; the column layer's input (saved whole) and the row layer's output (whole after the
all-reduce) whole; and each all-reduce's seconds added to the forward or the backward of the
node that waits for it (``NodeCost.comm_fwd_s`` / ``comm_bwd_s``), so the cut balances them and a
recomputed forward repeats them.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx
from torch import nn

from partitioner.cost.exchange import Collective, allreduce_time
from partitioner.cost.graph import layer_depth
from partitioner.cost.nodecost import NodeCost

__all__ = ["TensorSplit", "find_split", "shard_costs", "shard_numel"]

log = logging.getLogger(__name__)

# Ops that compute ``x @ W.T`` (weight ``(out, in)``) and ``x @ W`` (weight ``(in, out)``: GPT-2's Conv1D).
_LINEAR = {torch.ops.aten.linear.default, nn.functional.linear}
_MATMUL = {torch.ops.aten.addmm.default, torch.ops.aten.mm.default, torch.ops.aten.matmul.default,
           torch.matmul, torch.mm, torch.addmm, operator.matmul}


@dataclass(frozen=True)
class TensorSplit:
    """How a tensor-parallel group splits one traced graph (plain data; :func:`find_split` makes it).

    Attributes:
        column: sharded linear nodes that read a whole activation (their output is split).
        row: sharded linear nodes that read a split activation (their output, all-reduced, is whole).
        split: every node whose value is split over the group (the column layers and what follows them).
        sharded: parameter name -> its element count, for every parameter split over the group (the
            column layers' weights and biases, the row layers' weights).
        sizes: per sharded linear, the size it splits (a column layer's output features, a row
            layer's input features): tp must divide each.
        fwd_allreduce: row node -> the node whose output it all-reduces forward (itself).
        bwd_allreduce: column node -> the node whose gradient it all-reduces backward (its input;
            one per input, the first column layer reading it).
        blocks: blocks that hold at least one pair.
        problem: why the graph cannot be split (a split value leaves its block), or ``None``.

    Example:
        >>> TensorSplit().pairs, TensorSplit().problem is None
        (0, True)
    """

    column: frozenset[str] = frozenset()
    row: frozenset[str] = frozenset()
    split: frozenset[str] = frozenset()
    sharded: Mapping[str, int] = field(default_factory=dict)
    sizes: Mapping[str, int] = field(default_factory=dict)
    fwd_allreduce: Mapping[str, str] = field(default_factory=dict)
    bwd_allreduce: Mapping[str, str] = field(default_factory=dict)
    blocks: int = 0
    problem: str | None = None

    @property
    def pairs(self) -> int:
        """Row layers: the all-reduces one forward runs (and one backward runs, as many)."""
        return len(self.row)

    def divides(self, tp: int) -> bool:
        """Whether ``tp`` divides every size a sharded linear splits (and the graph can be split).

        Example:
            >>> TensorSplit(sizes={"a": 12, "b": 8}).divides(4), TensorSplit(sizes={"a": 12}).divides(8)
            (True, False)
        """
        return self.problem is None and all(n % tp == 0 for n in self.sizes.values())


def _tensor_valued(node: fx.Node) -> bool:
    """Whether the node's value holds a tensor (a size read is an int and is never split)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return True
    if isinstance(val, (list, tuple)):
        return any(isinstance(v, torch.Tensor) for v in val)
    return val is None and node.op != "get_attr"  # no record: count it as a tensor


def _block(module: str, depth: int) -> str | None:
    """The block a module path sits in (``model.layers.3``), or ``None`` outside the blocks."""
    parts = module.split(".") if module else []
    if len(parts) >= depth and parts[depth - 1].isdigit():
        return ".".join(parts[:depth])
    return None


def _weight(node: fx.Node, gm: fx.GraphModule, shapes: Mapping[str, torch.Size]) -> tuple[str, fx.Node] | None:
    """``(weight name, activation input)`` when ``node`` is a linear layer reading one 2-D parameter."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if isinstance(mod, nn.Linear) and node.args and isinstance(node.args[0], fx.Node):
            return f"{node.target}.weight", node.args[0]
        return None
    if node.op != "call_function" or (node.target not in _LINEAR and node.target not in _MATMUL):
        return None
    params = [a for a in node.all_input_nodes if a.op == "get_attr" and len(shapes.get(str(a.target), ())) == 2]
    acts = [a for a in node.all_input_nodes if a.op != "get_attr"]
    if len(params) != 1 or len(acts) != 1:
        return None
    return str(params[0].target), acts[0]


def find_split(gm: fx.GraphModule, module_of: Mapping[str, str]) -> TensorSplit:
    """Follow Megatron's column/row pairs through ``gm`` (see the module docstring).

    Args:
        gm: the traced graph (parameters read through ``get_attr``, or ``nn.Linear`` modules).
        module_of: compute node name -> its module path (the costed graph's ``module`` attribute).

    Example:
        >>> from torch import nn
        >>> from partitioner.tracing.trace import trace
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)
        ...     def forward(self, x):
        ...         return x + self.down(torch.relu(self.up(x)))
        >>> t = trace(nn.Sequential(Block(), Block()), (torch.randn(2, 8),))
        >>> found = find_split(t.gm, {n.name: t.module_path(n) for n in t.gm.graph.nodes})
        >>> found.pairs, sorted(found.sizes.values()), found.problem
        (2, [32, 32, 32, 32], None)
    """
    shapes = {name: p.shape for name, p in gm.named_parameters(remove_duplicate=False)}
    modules = [m for n, m in module_of.items()]
    depth = layer_depth(list(dict.fromkeys(modules)))
    column: set[str] = set()
    row: set[str] = set()
    split: set[str] = set()
    sharded: dict[str, int] = {}
    sizes: dict[str, int] = {}
    fwd: dict[str, str] = {}
    bwd: dict[str, str] = {}
    reduced_inputs: set[str] = set()
    blocks: set[str] = set()
    for node in gm.graph.nodes:
        if node.name not in module_of:
            continue
        block = _block(module_of[node.name], depth)
        found = _weight(node, gm, shapes) if block is not None else None
        if found is not None:
            name, act = found
            shape = shapes[name]
            by_rows = node.op == "call_module" or node.target in _LINEAR  # weight (out, in)
            out_dim, in_dim = (0, 1) if by_rows else (1, 0)
            params = [str(a.target) for a in node.all_input_nodes if a.op == "get_attr"]
            if node.op == "call_module":
                params = [f"{node.target}.{k}" for k, _ in gm.get_submodule(str(node.target)).named_parameters()]
            if act.name in split:  # row-wise: its input features; the bias is added after the sum, whole
                row.add(node.name)
                sizes[node.name] = int(shape[in_dim])
                sharded[name] = shape.numel()
                fwd[node.name] = node.name
            else:  # column-wise: its output features, weight and bias
                column.add(node.name)
                split.add(node.name)
                sizes[node.name] = int(shape[out_dim])
                for p in params:
                    sharded[p] = shapes[p].numel() if p in shapes else 0
                if act.name not in reduced_inputs:  # q, k and v share one all-reduce of their input's gradient
                    reduced_inputs.add(act.name)
                    bwd[node.name] = act.name
            blocks.add(block)  # type: ignore[arg-type]
        elif _tensor_valued(node) and any(a.name in split for a in node.all_input_nodes):
            split.add(node.name)
    problem = _leak(gm, split, module_of, depth)
    if problem is not None:
        log.info("tensor parallelism: the graph cannot be split (%s); tp stays 1", problem)
    return TensorSplit(frozenset(column), frozenset(row), frozenset(split), sharded, sizes, fwd, bwd,
                       len(blocks), problem)


def _leak(gm: fx.GraphModule, split: set[str], module_of: Mapping[str, str], depth: int) -> str | None:
    """Where a split value leaves its block (read outside it, or returned), or ``None``."""
    for node in gm.graph.nodes:
        if node.name not in split:
            continue
        here = _block(module_of[node.name], depth)
        for user in node.users:
            if user.op == "output":
                return f"the split value of {node.name} ({module_of[node.name]}) is returned by the model"
            there = _block(module_of.get(user.name, ""), depth)
            if here is None or there != here:
                return (f"the split value of {node.name} ({module_of[node.name]}) reaches {user.name} "
                        f"({module_of.get(user.name, '?')}), outside its block: no row-wise layer closes it")
    return None


def shard_numel(numel: Mapping[str, int], found: TensorSplit, tp: int) -> dict[str, int]:
    """Parameter element counts on one tp rank: the sharded ones ``1 / tp``, the rest whole.

    Example:
        >>> shard_numel({"w": 64, "b": 8, "norm": 8}, TensorSplit(sharded={"w": 64, "b": 8}), 4)
        {'w': 16, 'b': 2, 'norm': 8}
    """
    return {name: n // tp if name in found.sharded else n for name, n in numel.items()}


def shard_costs(
    costs: Mapping[str, NodeCost], found: TensorSplit, tp: int, ring: Collective, value_bytes: Mapping[str, float],
) -> dict[str, NodeCost]:
    """One tp rank's cost of every node (see the module docstring), all-reduces on ``ring``.

    Args:
        costs: node name -> its cost, whole (any micro-batch size: the all-reduces are priced
            from these costs' output bytes).
        found: from :func:`find_split`.
        tp: the group's size.
        ring: the group's collective (inside one node: the device's link).
        value_bytes: bytes of the values that are not compute nodes (graph inputs), by name, for an
            all-reduce of an input's gradient.

    Example:
        >>> found = TensorSplit(column=frozenset({"up"}), row=frozenset({"down"}),
        ...                     split=frozenset({"up", "act"}), fwd_allreduce={"down": "down"},
        ...                     bwd_allreduce={"up": "x"})
        >>> costs = {"up": NodeCost(fwd_flops=8e6, output_bytes=4000, io_bytes=6000, param_bytes=1000),
        ...          "act": NodeCost(saved_bytes=4000, output_bytes=4000, io_bytes=8000),
        ...          "down": NodeCost(fwd_flops=8e6, saved_bytes=4000, output_bytes=1000, io_bytes=6000)}
        >>> out = shard_costs(costs, found, 4, Collective(1e9, 0.0), {"x": 1000})
        >>> out["up"].fwd_flops, out["up"].output_bytes, out["act"].saved_bytes, out["down"].output_bytes
        (2000000.0, 1000, 1000, 1000)
        >>> out["down"].comm_fwd_s, out["up"].comm_bwd_s, out["act"].comm_fwd_s  # 2 (tp - 1) / tp x 1000 B / 1 GB/s
        (1.5e-06, 1.5e-06, 0.0)
    """
    if tp == 1:
        return dict(costs)
    out: dict[str, NodeCost] = {}
    for name, c in costs.items():
        if name in found.column:
            c = _column(c, tp)
        elif name in found.row:
            c = _row(c, tp)
        elif name in found.split:
            c = replace(c, fwd_flops=c.fwd_flops / tp, bwd_flops=c.bwd_flops / tp, saved_bytes=c.saved_bytes // tp,
                        output_bytes=c.output_bytes // tp, io_bytes=c.io_bytes // tp)
        fwd = found.fwd_allreduce.get(name)
        bwd = found.bwd_allreduce.get(name)
        if fwd is not None or bwd is not None:
            c = replace(
                c,
                comm_fwd_s=c.comm_fwd_s + (_allreduce(_bytes(fwd, costs, value_bytes), tp, ring) if fwd else 0.0),
                comm_bwd_s=c.comm_bwd_s + (_allreduce(_bytes(bwd, costs, value_bytes), tp, ring) if bwd else 0.0),
            )
        out[name] = c
    return out


def _allreduce(nbytes: float, tp: int, ring: Collective) -> float:
    """One all-reduce of ``nbytes`` over the group: one collective, its ring steps' latency included."""
    return allreduce_time(nbytes, tp, ring, bucket_bytes=max(nbytes, 1.0))


def _bytes(name: str, costs: Mapping[str, NodeCost], value_bytes: Mapping[str, float]) -> float:
    return float(costs[name].output_bytes) if name in costs else float(value_bytes.get(name, 0.0))


def _parts(c: NodeCost) -> tuple[float, float, float]:
    """``(parameter and buffer bytes, input bytes, output bytes)`` of a node's forward traffic."""
    fixed = min(c.io_bytes, c.param_bytes + c.buffer_bytes)
    rest = c.io_bytes - fixed
    out = min(rest, c.output_bytes)
    return fixed, rest - out, out


def _column(c: NodeCost, tp: int) -> NodeCost:
    """A column layer: its weights, compute and output ``1 / tp``; its input whole (and saved whole)."""
    fixed, inp, out = _parts(c)
    return replace(c, fwd_flops=c.fwd_flops / tp, bwd_flops=c.bwd_flops / tp, param_bytes=c.param_bytes // tp,
                   param_count=c.param_count // tp, output_bytes=c.output_bytes // tp,
                   io_bytes=round(fixed / tp + inp + out / tp))


def _row(c: NodeCost, tp: int) -> NodeCost:
    """A row layer: its weight, compute, input and what it saves (its input) ``1 / tp``; its output whole."""
    fixed, inp, out = _parts(c)
    return replace(c, fwd_flops=c.fwd_flops / tp, bwd_flops=c.bwd_flops / tp, param_bytes=c.param_bytes // tp,
                   param_count=c.param_count // tp, saved_bytes=c.saved_bytes // tp,
                   io_bytes=round((fixed + inp) / tp + out))
