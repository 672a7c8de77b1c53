"""Split backward for zero-bubble schedules: input gradients now (``I``), weight gradients later (``W``).

Legend: a stage's autograd graph runs from its *roots* (its outputs, or the loss on the last
stage) down to its *inputs* (tensors received from other stages) and its *parameters*.

``I`` must produce the gradients of the stage's inputs, which the previous stage waits for, and
nothing else. ``W`` must then produce the parameter gradients doing only the work a fused
backward would spend on them, not walk the graph from the roots again. The cut between the two
is the set of *branch nodes*: graph nodes on a path from the roots to an input that also lead to
a parameter (for ``y = x @ W.T + b``, the ``AddmmBackward`` node). ``I`` runs every node on the
root-to-input paths (so every branch node runs, computing only its input-side gradient) and
captures, with a pre-hook, the gradient arriving at each branch node. ``W`` then starts
autograd at the branch nodes with the captured gradients, asking only for the parameters, so
the engine runs just the weight side of each branch node (``dW = dy.T @ x``) and the nodes
between it and the parameter.

A parameter with no branch node (the first stage, whose inputs need no gradient, or a part of
the graph that does not lead to an input) is handled the plain way in ``W``: autograd from the
roots to those parameters; that is also all the backward work they need, since ``I`` did none
of it.

We write our own rather than call ``torch.distributed.pipelining._backward`` (private, and it
detaches the stage outputs in place, which breaks on outputs that are views). The idea is the
same: capture gradients at the boundary in ``I``, restart from it in ``W``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from runtime.execute.wgrad_fusion import accumulate_deferred, deferring, owing

__all__ = ["PendingWeights", "backward_input", "backward_weight"]


@dataclass
class _Group:
    """Parameters whose gradients start from the same branch nodes (one ``autograd.grad`` call)."""

    nodes: list[Node]
    params: list[nn.Parameter]
    grads: list[tuple[torch.Tensor | None, ...] | None] = field(default_factory=list)


@dataclass
class PendingWeights:
    """What ``W`` needs after ``I``: branch nodes with their captured gradients, and any fallback."""

    groups: list[_Group]
    # Parameters without a branch node: (roots, root gradients, parameters), or None.
    fallback: tuple[list[torch.Tensor], list[torch.Tensor | None], list[nn.Parameter]] | None
    # Fused layers (runtime.execute.wgrad_fusion): the gradient work their I recorded, per parameter, and
    # the fused parameters whose layers did not run in I (W's autograd passes add those, once).
    deferred: list[tuple[torch.Tensor, Callable[[], None]]] = field(default_factory=list)
    owed: list[nn.Parameter] = field(default_factory=list)


def backward_input(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[nn.Parameter],
    fused: Sequence[nn.Parameter] = (),
) -> tuple[tuple[torch.Tensor | None, ...], PendingWeights]:
    """``I``: the gradients of ``inputs`` only; returns them and what ``W`` needs.

    Args:
        roots: the stage's outputs that receive a gradient (or the loss).
        grads: their gradients (``None`` for a scalar loss).
        inputs: stage inputs that require grad.
        params: the stage's parameters that require grad.
        fused: those of ``params`` whose layers add their own gradients
            (``runtime.execute.wgrad_fusion``): their ``I`` records that work, ``W`` runs it.

    Returns:
        One gradient per input (``None`` where the input does not reach a root) and the pending
        weight work for :func:`backward_weight`.

    Example:
        >>> lin = nn.Linear(3, 2)
        >>> x = torch.randn(4, 3, requires_grad=True)
        >>> y = lin(x)
        >>> (gx,), pending = backward_input([y], [torch.ones(4, 2)], [x], list(lin.parameters()))
        >>> lin.weight.grad is None, len(pending.groups)
        (True, 1)
        >>> backward_weight(pending)
        >>> torch.allclose(lin.bias.grad, torch.full((2,), 4.0))
        True
    """
    roots, grads = list(roots), list(grads)
    fused_ids = {id(w) for w in fused}
    params = [p for p in params if id(p) not in fused_ids]
    if not inputs:  # nothing to send back: every parameter is W's, from the roots
        every = params + list(fused)
        return (), PendingWeights([], (roots, grads, every) if every else None, owed=list(fused))
    root_nodes = [_node(r) for r in roots]
    parents = _parents(root_nodes)
    boundary = _ancestors([_node(a) for a in inputs], parents)
    groups, rest = _branch_groups(params, parents, boundary, set(root_nodes))

    handles = []
    for group in groups:
        group.grads = [None] * len(group.nodes)
        for i, node in enumerate(group.nodes):
            handles.append(node.register_prehook(_capture(group.grads, i)))
    try:
        with deferring() as deferred:
            in_grads = torch.autograd.grad(roots, list(inputs), grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for group in groups:
        if any(g is None for g in group.grads):  # a branch node did not run: use the roots
            rest += group.params
    groups = [g for g in groups if all(x is not None for x in g.grads)]
    ran = {id(prm) for prm, _ in deferred}
    owed = [w for w in fused if id(w) not in ran]  # their layers are off the input paths
    rest += owed
    return in_grads, PendingWeights(groups, (roots, grads, rest) if rest else None, deferred, owed)


def backward_weight(pending: PendingWeights) -> None:
    """``W``: accumulate the parameter gradients into ``.grad`` from what ``I`` captured.

    Autograd starts at the branch nodes and is asked only for parameters, so it runs only the
    weight side of each; fused layers' recorded GEMMs run directly. Consumes ``pending`` (call
    once).
    """
    accumulate_deferred(pending.deferred)
    with owing(pending.owed):  # a fused layer met again below adds its gradient only if owed
        _weight_passes(pending)
    pending.groups = []
    pending.fallback = None
    pending.deferred = []
    pending.owed = []


def _weight_passes(pending: PendingWeights) -> None:
    for group in pending.groups:
        edges: list[GradientEdge] = []
        outs: list[torch.Tensor] = []
        for node, captured in zip(group.nodes, group.grads):
            assert captured is not None
            for i, g in enumerate(captured):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    outs.append(g)
        handles = []
        if len(group.nodes) > 1:
            # When one branch node lies below another (a parameter used twice, one use feeding
            # the other), the engine would add the upper one's gradient to the lower one's
            # captured one: pin every branch node's incoming gradient to what I captured.
            handles = [n.register_prehook(_replace(c)) for n, c in zip(group.nodes, group.grads)]
        try:
            if edges:
                # backward(inputs=...) accumulates through the parameters' AccumulateGrad nodes,
                # which lock: stages on two threads may share a tied parameter.
                torch.autograd.backward(edges, outs, retain_graph=True, inputs=group.params)
        finally:
            for h in handles:
                h.remove()
    if pending.fallback is not None:
        roots, grads, params = pending.fallback
        if roots and params:
            torch.autograd.backward(roots, grads, retain_graph=True, inputs=params)


def _node(t: torch.Tensor) -> Node:
    """The graph node a tensor's gradient enters: its grad_fn, or a leaf's gradient accumulator."""
    return get_gradient_edge(t).node


def _parents(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Reverse edges of the graph below ``roots``: node -> the nodes that feed it a gradient."""
    parents: dict[Node, list[Node]] = {}
    stack = []
    for r in roots:
        if r not in parents:
            parents[r] = []
            stack.append(r)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                stack.append(child)
            parents[child].append(node)
    return parents


def _ancestors(nodes: Sequence[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``nodes`` and every node above them: what autograd runs to reach them from the roots."""
    seen = {n for n in nodes if n in parents}
    stack = list(seen)
    while stack:
        for up in parents[stack.pop()]:
            if up not in seen:
                seen.add(up)
                stack.append(up)
    return seen


def _branch_groups(
    params: Sequence[nn.Parameter],
    parents: dict[Node, list[Node]],
    boundary: set[Node],
    roots: set[Node],
) -> tuple[list[_Group], list[nn.Parameter]]:
    """Group parameters by their branch nodes; return the groups and the parameters left to the roots.

    A parameter's branch nodes are the first nodes of ``boundary`` met walking up from its
    gradient accumulator. Parameters sharing a branch node go in one group (one autograd call
    must produce both, or the node would run twice). A parameter with no branch node, or with a
    path up to one of ``roots`` that meets none (a stage output computed from it but not from
    any input: T5's relative position bias, handed on to the next stage), is left to the plain
    pass from the roots, which gives it its whole gradient; the branch nodes alone would miss
    what arrives through that path.
    """
    owner: dict[Node, int] = {}  # branch node -> group index (union-find root)
    link: list[int] = []
    members: list[tuple[list[Node], list[nn.Parameter]]] = []
    rest: list[nn.Parameter] = []

    def find(i: int) -> int:
        while link[i] != i:
            link[i] = link[link[i]]
            i = link[i]
        return i

    for prm in params:
        acc = _node(prm)
        if acc not in parents:
            continue  # not used by this stage's graph: no gradient, as a fused backward gives
        hit: list[Node] = []
        seen = {acc}
        stack = [acc]
        escapes = acc in roots
        while stack:
            for up in parents[stack.pop()]:
                if up in seen:
                    continue
                seen.add(up)
                if up in boundary:
                    hit.append(up)
                else:
                    escapes = escapes or up in roots
                    stack.append(up)
        if not hit or escapes:
            rest.append(prm)
            continue
        gi = len(link)
        link.append(gi)
        members.append((hit, [prm]))
        for node in hit:
            if node in owner:
                a, b = find(owner[node]), find(gi)
                if a != b:
                    link[b] = a
            else:
                owner[node] = gi
    merged: dict[int, _Group] = {}
    for gi, (hit, prms) in enumerate(members):
        g = merged.setdefault(find(gi), _Group([], []))
        g.params += prms
        for node in hit:
            if node not in g.nodes:
                g.nodes.append(node)
    return list(merged.values()), rest


def _capture(
    store: list[tuple[torch.Tensor | None, ...] | None], i: int
) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
    # Holds only the list, not the node: a node -> hook -> node cycle would outlive the step.
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        store[i] = tuple(grad_outputs)

    return hook


def _replace(
    captured: tuple[torch.Tensor | None, ...] | None,
) -> Callable[[tuple[torch.Tensor | None, ...]], tuple[torch.Tensor | None, ...] | None]:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...] | None:
        return captured

    return hook
