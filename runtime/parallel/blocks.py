"""A stage's blocks as modules it calls: what FSDP needs to gather one block at a time.

Legend: a *block* is a module at the model's layer depth (``model.transformer.h.3`` in a GPT-2,
``layers.5`` in a Llama), found from the stage graph's own module paths
(``partitioner.cost.graph.layer_depth``).

A stage module is a ``torch.fx`` graph that reads its parameters through ``get_attr`` and runs
their ops itself (``torch.export`` graphs of Hugging Face models run ``aten`` ops; ``fx``-traced
ones call leaf layers), so no block's ``forward`` ever runs and FSDP's hooks on a block would
never fire: FSDP could only gather the whole stage. :func:`outline_blocks` moves each block's
nodes into a graph module of its own, installed at the block's own path, and calls it from the
stage graph: parameter names, tied weights and checkpoints keep their names, the stage computes
the same ops in the same order (bitwise the same results), and FSDP can shard each block as its
own unit, gathering one block (and the next, prefetched) at a time instead of the stage.

A block is outlined only when it is safe to: its nodes run one after another in the stage's
graph, and its parameters are read by no node outside it (a weight tied between a block and
another part of the stage stays with the stage). Everything else stays in the stage graph.

A block the plan's cut splits between two stages is outlined in each, as the part of it that
stage holds (the stage's module at the block's path has only that part's weights), and each
part becomes an FSDP unit of its stage. A part with none of the block's weights (the cut left a
stage only the block's last residual add, say) has nothing to shard and stays in the stage graph.

Example:
    >>> import torch
    >>> from torch import fx, nn
    >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)])
    >>> gm = fx.symbolic_trace(net)
    >>> x = torch.randn(2, 4)
    >>> want = gm(x)
    >>> outline_blocks(gm)
    ['0', '1', '2']
    >>> torch.equal(gm(x), want), [n.op for n in gm.graph.nodes][:3]
    (True, ['placeholder', 'call_module', 'call_function'])
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

from torch import fx, nn

from partitioner.cost.graph import layer_depth
from partitioner.tracing.trace import node_module_path

__all__ = ["outline_blocks"]


def outline_blocks(gm: fx.GraphModule) -> list[str]:
    """Move each block of ``gm``'s graph into a module called at the block's path; return those paths.

    ``gm`` is changed in place (its graph and the modules at the outlined paths) and recompiled;
    its parameters stay the same objects under the same names.
    """
    nodes = list(gm.graph.nodes)
    # The calls' traced module stacks (``_path``'s), read through partitioner.tracing at once.
    calls = [n for n in nodes if n.op == "call_function" or n.op == "call_method"]
    stacks = dict(zip(calls, map(node_module_path, calls)))
    paths = {n: stacks[n] if n in stacks else _path(n) for n in nodes}
    container = _container([p for p in paths.values() if p])
    if container is None:
        return []
    depth = len(container.split(".")) + 1 if container else 1
    block = {n: _block(p, container, depth) for n, p in paths.items()}
    runs: list[tuple[str | None, list[fx.Node]]] = []
    for n in nodes:
        if n.op == "get_attr":
            continue
        key = block[n] if n.op not in ("placeholder", "output") else None
        if runs and runs[-1][0] == key:
            runs[-1][1].append(n)
        else:
            runs.append((key, [n]))
    counts: dict[str, int] = {}
    for key, _ in runs:
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    done = []
    for key, body in runs:
        if key is None or counts[key] != 1:  # absent, or its nodes interleave with others'
            continue
        attrs = [n for n in nodes if n.op == "get_attr" and block[n] == key]
        if _outline(gm, key, body, attrs):
            done.append(key)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _path(node: fx.Node) -> str:
    """The module a node belongs to: a parameter's owner for ``get_attr``, the layer for
    ``call_module``, the traced module stack's innermost entry otherwise."""
    if node.op in ("get_attr", "call_module"):
        return str(node.target).rpartition(".")[0] if node.op == "get_attr" else str(node.target)
    return node_module_path(node) if node.op == "call_function" or node.op == "call_method" else ""


def _container(paths: Sequence[str]) -> str | None:
    """The path of the module whose numbered children are the blocks, or ``None`` when there are none."""
    depth = layer_depth(paths)
    kids = {".".join(p.split(".")[:depth]) for p in paths if len(p.split(".")) >= depth}
    parents = {k.rpartition(".")[0] for k in kids if k.rpartition(".")[2].isdigit()}
    return parents.pop() if len(parents) == 1 else None


def _block(path: str, container: str, depth: int) -> str | None:
    parts = path.split(".")
    inside = path.startswith(container + ".") if container else bool(path)
    return ".".join(parts[:depth]) if inside and len(parts) >= depth else None


def _outline(gm: fx.GraphModule, key: str, body: list[fx.Node], attrs: list[fx.Node]) -> bool:
    """Replace ``body`` (and the ``attrs`` it reads) by a call of a graph module at ``key``; whether
    the block at ``key`` is now called as a module (``False``: left in the stage's graph)."""
    inside = set(body) | set(attrs)
    if not _finds(gm.get_submodule, key):
        return False  # a cut left this stage a part of the block without its weights: nothing to shard
    if any(u not in inside for a in attrs for u in a.users):
        return False  # a parameter of the block is read outside it (tied): leave the block in place
    if any(n.op == "call_module" and n.target == key for n in body):
        return True  # the block is called as a module already: its hooks run as they are
    mine = {id(gm.get_parameter(str(a.target))) for a in attrs if _finds(gm.get_parameter, str(a.target))}
    others = {id(p) for name, p in gm.named_parameters(remove_duplicate=False)
              if not name.startswith(key + ".")}
    if mine & others:
        return False  # the same tensor is also another module's (a tie inside the stage)
    ins = list(dict.fromkeys(a for n in body for a in n.all_input_nodes if a not in inside))
    outs = [n for n in body if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {a: sub.placeholder(a.name) for a in ins}
    for a in attrs:
        env[a] = sub.get_attr(str(a.target)[len(key) + 1:])
    for a in (*ins, *attrs):
        env[a].meta = dict(a.meta)  # the traced shapes, which tensor parallelism follows
    for n in body:
        env[n] = sub.node_copy(n, lambda x: env[x])
        if n.op == "call_module":  # a layer of the block, named from the block now
            env[n].target = str(n.target)[len(key) + 1:]
    sub.output(tuple(env[o] for o in outs))
    outlined = fx.GraphModule(gm.get_submodule(key), sub, class_name="Block")
    parent, _, leaf = key.rpartition(".")
    owner: nn.Module = gm.get_submodule(parent) if parent else gm
    owner._modules[leaf] = outlined
    with gm.graph.inserting_before(body[0]):
        call = gm.graph.call_module(key, tuple(ins))
        got = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(outs))]
    for o, g in zip(outs, got):
        o.replace_all_uses_with(g, delete_user_cb=lambda u: u not in inside)
    for n in reversed(body):
        gm.graph.erase_node(n)
    for a in attrs:
        gm.graph.erase_node(a)
    return True


def _finds(get: Callable[[str], object], name: str) -> bool:
    """Whether ``get(name)`` (``gm.get_submodule``, ``gm.get_parameter``) finds what ``name`` names."""
    try:
        get(name)
    except AttributeError:
        return False
    return True
