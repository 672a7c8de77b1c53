"""Bytes alive while each node of a forward runs, when nothing is kept for a backward (pure).

Legend: ``n`` nodes in execution order, ``i``/``j`` node indices.

Under ``torch.no_grad`` a value is freed once its last reader has run, so the memory a forward
needs beyond its weights is, at node ``j``, every value made at or before ``j`` that a node at or
after ``j`` still reads (``j``'s inputs and its output included). A view makes no new storage: it
counts nothing itself and keeps its base alive as long as it is read. Values the graph returns live
to the end. Written here, not read off torch's memory snapshots, because it runs on the costed
graph of a model that never had real tensors (``partitioner.cost``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

__all__ = ["live_bytes"]


def live_bytes(
    out_bytes: Sequence[float], readers: Sequence[Collection[int]], *, views: Collection[int] = (),
    kept: Collection[int] = (),
) -> list[float]:
    """Per node, the bytes of values alive while it runs.

    Args:
        out_bytes: per node, the bytes of its output (graph inputs may be nodes too, first).
        readers: per node, the later nodes that read its output.
        views: the nodes whose output is a view of an input (no storage of their own).
        kept: the nodes whose output the graph returns (alive to the end).

    Example:
        >>> # a (4 B) -> b (8 B) -> c (2 B); a is also read by c (a skip connection); b is a view of a
        >>> live_bytes([4, 8, 2], [{1, 2}, {2}, set()])
        [4.0, 12.0, 14.0]
        >>> live_bytes([4, 8, 2], [{1, 2}, {2}, set()], views={1})
        [4.0, 4.0, 6.0]
    """
    n = len(out_bytes)
    views = set(views)
    last = [max(readers[i], default=i) for i in range(n)]
    for i in kept:
        last[i] = n - 1
    inputs: list[list[int]] = [[] for _ in range(n)]
    for i, rs in enumerate(readers):
        for j in rs:
            inputs[j].append(i)
    for v in sorted(views, reverse=True):  # a view of a view extends the base through it
        for u in inputs[v]:
            last[u] = max(last[u], last[v])
    diff = [0.0] * (n + 1)
    for i in range(n):
        size = 0.0 if i in views else float(out_bytes[i])
        diff[i] += size
        diff[last[i] + 1] -= size
    out, running = [], 0.0
    for j in range(n):
        running += diff[j]
        out.append(running)
    return out
