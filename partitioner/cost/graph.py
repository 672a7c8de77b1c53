"""The costed graph as a networkx DiGraph, its grouping into units, and its reduction to a Problem.

Legend: ``n`` units, ``p`` stages, ``s`` a stage index, ``i`` a unit index. A *unit* is what the
partitioner places: one fx node (``granularity='node'``) or a run of consecutive nodes of the same
module (``granularity='module'``, e.g. one transformer block).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import networkx as nx
import torch.fx as fx

from partitioner.algorithms.problem import GRAPH_INPUT, Problem, Tensor
from partitioner.cost.costs import NodeCost, node_time
from partitioner.cost.devices import Cluster, DeviceSpec
from partitioner.errors import PartitionOptionError
from partitioner.tracing.fxutil import COMPUTE_OPS, flat_outputs, wire_form

__all__ = ["Unit", "build_graph", "layer_depth", "group_units", "to_problem", "module_range", "canonical_names"]


@dataclass(frozen=True)
class Unit:
    """A placeable run of graph nodes.

    Attributes:
        index: position in the unit order.
        nodes: fx node names, in graph order.
        module: the module the run belongs to (its group key), ``''`` for top-level code.
    """

    index: int
    nodes: tuple[str, ...]
    module: str


def build_graph(
    gm: fx.GraphModule,
    costs: Mapping[str, NodeCost],
    module_path: Callable[[fx.Node], str],
) -> nx.DiGraph[str]:
    """The compute nodes of ``gm`` as a DiGraph with their costs.

    Node attributes: ``cost`` (NodeCost), ``module`` (innermost module path), ``order`` (graph
    position). Edge ``u -> v`` attribute ``nbytes``: the size of ``u``'s output. Graph attributes:
    ``inputs`` (placeholder name -> (reader nodes, nbytes)) and ``outputs`` (names of the nodes
    whose values the model returns, in output order).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from partitioner.tracing.trace import trace
        >>> from partitioner.cost.costs import cost_graph
        >>> t = trace(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), (torch.randn(2, 4),))
        >>> g = build_graph(t.gm, cost_graph(t), t.module_path)
        >>> sorted(g.nodes)
        ['_0', '_1']
    """
    g: nx.DiGraph[str] = nx.DiGraph()
    order = 0
    for node in gm.graph.nodes:
        if node.op in COMPUTE_OPS:
            g.add_node(
                node.name, cost=costs[node.name], module=module_path(node), order=order,
                crossable=wire_form(node) is not None,
            )
            order += 1
    inputs: dict[str, tuple[tuple[str, ...], int]] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            readers = tuple(u.name for u in node.users if u.name in g)
            inputs[node.name] = (readers, _value_nbytes(node))
        elif node.op in COMPUTE_OPS:
            nbytes = costs[node.name].output_bytes
            for u in node.users:
                if u.name in g:
                    g.add_edge(node.name, u.name, nbytes=nbytes)
    g.graph["inputs"] = inputs
    g.graph["outputs"] = tuple(
        a.name for a in flat_outputs(gm) if isinstance(a, fx.Node) and a.name in g
    )
    return g


def layer_depth(paths: Sequence[str]) -> int:
    """The module depth at which a model's repeated layers sit.

    The container whose direct children cover the most distinct node groups wins, numbered
    children (``h.0``, ``h.1``, ``layer1.0``...) first; its children are the layers, so the depth
    is one more than the container's. ``'transformer.h.3.attn'`` in a GPT-2 gives depth 3.
    """
    children: dict[str, set[str]] = {}
    for path in paths:
        parts = path.split(".") if path else []
        for d in range(len(parts)):
            children.setdefault(".".join(parts[:d]), set()).add(parts[d])
    if not children:
        return 1

    def score(item: tuple[str, set[str]]) -> tuple[int, int, int]:
        prefix, kids = item
        numbered = sum(k.isdigit() for k in kids)
        return (numbered, len(kids), -len(prefix))

    prefix, _ = max(children.items(), key=score)
    return (len(prefix.split(".")) if prefix else 0) + 1


def group_units(
    g: nx.DiGraph[str], granularity: str = "node", module_depth: int | None = None
) -> list[Unit]:
    """Group the graph's nodes into units, in graph order.

    Args:
        g: from ``build_graph``.
        granularity: ``'node'`` (every node a unit) or ``'module'`` (consecutive nodes sharing
            their module path truncated to ``module_depth`` form one unit).
        module_depth: the truncation depth; default ``layer_depth`` of the model.
    """
    names = sorted(g.nodes, key=lambda v: g.nodes[v]["order"])
    if granularity == "node":
        return [Unit(i, (v,), g.nodes[v]["module"]) for i, v in enumerate(names)]
    if granularity != "module":
        raise PartitionOptionError(f"granularity must be 'node' or 'module', got {granularity!r}")
    depth = module_depth or layer_depth([g.nodes[v]["module"] for v in names])
    units: list[Unit] = []
    run: list[str] = []
    key = None
    for v in names:
        k = _truncate(g.nodes[v]["module"], depth)
        if run and k != key:
            units.append(Unit(len(units), tuple(run), key or ""))
            run = []
        run.append(v)
        key = k
    if run:
        units.append(Unit(len(units), tuple(run), key or ""))
    return units


def to_problem(
    g: nx.DiGraph[str],
    units: Sequence[Unit],
    cluster: Cluster,
    *,
    inflight: Sequence[int],
    param_numel: Mapping[str, int],
    state_bytes_per_param: float = 16.0,
    param_aliases: Mapping[str, Sequence[str]] | None = None,
) -> Problem:
    """Reduce the costed graph to the plain-data ``Problem`` the algorithms solve.

    Args:
        g: from ``build_graph``.
        units: from ``group_units``.
        cluster: ``p`` devices; ``compute[s]`` uses ``cluster.devices[s]``.
        inflight: micro-batches each stage holds activations for (depends on the schedule).
        param_numel: element count of every parameter by name.
        state_bytes_per_param: training-state bytes per parameter element (weights + grads +
            optimizer; Adam in fp32 is 4 + 4 + 8 = 16).
        param_aliases: every name of a tensor known under several (tied weights), so that its
            names count as one parameter.
    """
    canon = canonical_names(param_aliases or {})
    unit_of = {v: u.index for u in units for v in u.nodes}
    n = len(units)
    depth = layer_depth(sorted({u.module for u in units}))
    owned: set[tuple[str, str]] = set()
    state = [0.0] * n
    counts = [0.0] * n
    act = [0.0] * n
    for u in units:
        layer = _truncate(u.module, depth)
        for v in u.nodes:
            c: NodeCost = g.nodes[v]["cost"]
            act[u.index] += c.saved_bytes
            state[u.index] += c.buffer_bytes
            for name in c.param_names:
                name = canon.get(name, name)
                # A parameter is charged to its first user in each layer that reads it: once for
                # an ordinary weight, on both ends for a tied embedding (each holder keeps a copy).
                if (name, layer) not in owned:
                    owned.add((name, layer))
                    state[u.index] += param_numel.get(name, 0) * state_bytes_per_param
                    counts[u.index] += param_numel.get(name, 0)
    # One row per distinct device spec: a uniform cluster of 64 prices each node once, not 64 times.
    rows: dict[DeviceSpec, tuple[float, ...]] = {}
    compute = []
    for dev in cluster.devices:
        if dev not in rows:
            row = [0.0] * n
            for u in units:
                row[u.index] = sum(sum(node_time(g.nodes[v]["cost"], dev)) for v in u.nodes)
            rows[dev] = tuple(row)
        compute.append(rows[dev])
    outputs = set(g.graph["outputs"])
    tensors: list[Tensor] = []
    for v in sorted(g.nodes, key=lambda x: g.nodes[x]["order"]):
        i = unit_of[v]
        readers = {unit_of[w] for w in g.successors(v)} - {i}
        if v in outputs:
            readers.add(n)
        if readers:
            tensors.append(Tensor(i, tuple(sorted(readers)), float(g.nodes[v]["cost"].output_bytes)))
    for input_readers, nbytes in g.graph["inputs"].values():
        if input_readers:
            tensors.append(Tensor(GRAPH_INPUT, tuple(sorted({unit_of[r] for r in input_readers})), float(nbytes)))
    return Problem(
        compute=tuple(compute),
        state_bytes=tuple(state),
        act_bytes=tuple(act),
        tensors=tuple(tensors),
        capacity=tuple(d.usable_memory for d in cluster.devices),
        inflight=tuple(inflight),
        link_bandwidth=tuple(cluster.link_bandwidth),
        link_latency=tuple(cluster.link_latency),
        cuts=_allowed_cuts(g, units, unit_of),
        names=tuple(u.module + ":" + u.nodes[0] if u.module else u.nodes[0] for u in units),
        param_counts=tuple(counts),
    )


def canonical_names(aliases: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """Every alias of a tied tensor -> one name for it (the smallest), so its names count once.

    Example:
        >>> canonical_names({"head.weight": ("head.weight", "emb.weight")})
        {'head.weight': 'emb.weight', 'emb.weight': 'emb.weight'}
    """
    out: dict[str, str] = {}
    for name, names in aliases.items():
        first = min((name, *names))
        for n in (name, *names):
            out[n] = min(first, out.get(n, first))
    return out


def _allowed_cuts(g: nx.DiGraph[str], units: Sequence[Unit], unit_of: Mapping[str, int]) -> tuple[int, ...] | None:
    """Cut positions no uncrossable value (a list of tensors, say) spans; None when all are allowed."""
    n = len(units)
    span = [0] * (n + 1)
    for v in g.nodes:
        if g.nodes[v]["crossable"]:
            continue
        i = unit_of[v]
        last = max((unit_of[w] for w in g.successors(v)), default=i)
        if last > i:  # cuts i+1 .. last would separate the value from a reader
            span[i + 1] += 1
            span[last + 1] -= 1
    if not any(span):
        return None
    allowed, open_spans = [], 0
    for k in range(1, n):
        open_spans += span[k]
        if open_spans == 0:
            allowed.append(k)
    return tuple(allowed)


def module_range(modules: Sequence[str]) -> str:
    """A short reading of the modules a stage holds, in order: ``'h.0 … h.5'``.

    Consecutive duplicates collapse. Top-level code (size reads, reshapes between modules) is
    left out, and reads as ``'<top>'`` only when the stage holds nothing else.

    Example:
        >>> module_range(["emb", "h.0", "h.0", "h.1", "h.2"])
        'emb … h.2'
        >>> module_range(["", "h.3", "", "h.4", "head"])
        'h.3 … head'
        >>> module_range(["", ""])
        '<top>'
    """
    seq: list[str] = []
    for m in [m for m in modules if m] or ["<top>"]:
        if not seq or seq[-1] != m:
            seq.append(m)
    if len(seq) <= 2:
        return ", ".join(seq)
    return f"{seq[0]} … {seq[-1]}"


def _truncate(path: str, depth: int) -> str:
    return ".".join(path.split(".")[:depth]) if path else ""


def _value_nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    if val is not None and hasattr(val, "numel") and hasattr(val, "element_size"):
        return int(val.numel()) * int(val.element_size())
    return 8
