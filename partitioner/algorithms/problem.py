"""The partition problem as plain data: the contract between the costed graph and every algorithm.

Legend: ``n`` units (graph nodes or modules) in one topological order, ``p`` stages, ``s`` a stage
index, ``i``/``j`` unit indices, ``k`` a cut position (a cut at ``k`` puts units ``< k`` before it).

Cost of stage ``s`` holding a set of units ``U_s`` (contiguous ``[a, b)`` for most algorithms):

* compute:  ``sum(compute[s][i] for i in U_s)`` -- forward + backward seconds on device ``s``;
* transfer: for the boundary into ``s`` (``s > 0``) and the one out of it (``s < p - 1``),
  ``latency + crossing_bytes / bandwidth`` when ``crossing_bytes > 0``, else 0. A tensor crosses
  boundary ``t`` (between stage ``t - 1`` and ``t``) when its producer's stage is ``< t`` and its
  last consumer's stage is ``>= t``; so a skip connection is paid at every boundary it crosses;
* time = compute + transfer in + transfer out; the *bottleneck* is the largest stage time;
* memory = ``sum(state_bytes[i]) + inflight[s] * sum(act_bytes[i])`` over ``U_s``; it must not
  exceed ``capacity[s]``.

Graph inputs (producer ``-1``) are fed straight to the stages that read them and never cross a
boundary; the graph output (consumer ``n``) is needed on the last stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from partitioner.errors import AlgorithmInputError

__all__ = ["Tensor", "Problem", "Partition"]

GRAPH_INPUT = -1


@dataclass(frozen=True)
class Tensor:
    """A value produced by one unit and read by others.

    Attributes:
        producer: index of the producing unit, or ``-1`` for a graph input.
        consumers: indices of the units reading it; ``n`` (the unit count) means the graph output.
        nbytes: size of the value for one micro-batch.
    """

    producer: int
    consumers: tuple[int, ...]
    nbytes: float


@dataclass(frozen=True)
class Problem:
    """Everything an algorithm needs to cut ``n`` units into ``p`` stages.

    Attributes:
        compute: ``compute[s][i]`` is forward + backward seconds of unit ``i`` on the device of
            stage ``s`` (``p`` rows of ``n``; rows differ only for heterogeneous clusters).
        state_bytes: per unit, bytes of training state of the parameters it owns (weights, grads,
            optimizer). A parameter is owned by its first user in the order.
        act_bytes: per unit, activation bytes saved for backward for one micro-batch.
        tensors: the values flowing between units (and from inputs / to the output).
        capacity: per stage, memory of its device in bytes (``float('inf')`` for no limit).
        inflight: per stage, micro-batches whose activations it holds at peak
            (GPipe: ``m`` everywhere; 1F1B: ``min(m, p - s)``).
        link_bandwidth: per boundary ``s`` (stage ``s`` to ``s + 1``), bytes/s; ``p - 1`` entries.
        link_latency: per boundary ``s``, seconds; ``p - 1`` entries.
        cuts: the positions ``k`` where a cut is allowed (``1 <= k <= n - 1``), sorted; ``None``
            allows every position (``granularity='module'`` restricts them to module edges).
        names: optional unit names, for messages.
        param_counts: optional per-unit parameter counts (for parameter-balancing baselines);
            defaults to ``state_bytes``.
    """

    compute: tuple[tuple[float, ...], ...]
    state_bytes: tuple[float, ...]
    act_bytes: tuple[float, ...]
    tensors: tuple[Tensor, ...]
    capacity: tuple[float, ...]
    inflight: tuple[int, ...]
    link_bandwidth: tuple[float, ...]
    link_latency: tuple[float, ...]
    cuts: tuple[int, ...] | None = None
    names: tuple[str, ...] = ()
    param_counts: tuple[float, ...] | None = None

    @property
    def n(self) -> int:
        """Number of units."""
        return len(self.state_bytes)

    @property
    def p(self) -> int:
        """Number of stages."""
        return len(self.capacity)

    def __post_init__(self) -> None:
        n, p = self.n, self.p
        if p < 1:
            raise AlgorithmInputError("a Problem needs at least one stage")
        if len(self.compute) != p or any(len(row) != n for row in self.compute):
            raise AlgorithmInputError(f"compute must be {p} rows of {n} floats")
        if len(self.act_bytes) != n:
            raise AlgorithmInputError(f"act_bytes has {len(self.act_bytes)} entries, expected {n}")
        if len(self.inflight) != p:
            raise AlgorithmInputError(f"inflight has {len(self.inflight)} entries, expected {p}")
        if len(self.link_bandwidth) != p - 1 or len(self.link_latency) != p - 1:
            raise AlgorithmInputError(f"link_bandwidth and link_latency need {p - 1} entries")
        if self.cuts is not None and any(not 1 <= k <= n - 1 for k in self.cuts):
            raise AlgorithmInputError(f"cut positions must lie in 1..{n - 1}")
        if self.param_counts is not None and len(self.param_counts) != n:
            raise AlgorithmInputError(f"param_counts has {len(self.param_counts)} entries, expected {n}")

    def allowed_cuts(self) -> tuple[int, ...]:
        """Sorted cut positions an algorithm may use."""
        return tuple(range(1, self.n)) if self.cuts is None else tuple(self.cuts)

    def unit_name(self, i: int) -> str:
        return self.names[i] if i < len(self.names) else f"unit {i}"


@dataclass(frozen=True)
class Partition:
    """An assignment of units to stages.

    Attributes:
        assignment: ``assignment[i]`` is the stage of unit ``i``. Contiguous partitions are
            non-decreasing; every stage ``0..p-1`` holds at least one unit.
        method: the algorithm that produced it (``'exact'``, ``'exact+refine'``, ``'equal_count'``...).
    """

    assignment: tuple[int, ...]
    method: str

    @staticmethod
    def from_cuts(cuts: tuple[int, ...] | list[int], n: int, method: str) -> Partition:
        """Build a contiguous partition from ``p - 1`` increasing cut positions."""
        bounds = [0, *cuts, n]
        out: list[int] = []
        for s in range(len(bounds) - 1):
            out.extend([s] * (bounds[s + 1] - bounds[s]))
        return Partition(tuple(out), method)

    def cuts(self) -> tuple[int, ...]:
        """Cut positions of a contiguous partition (``p - 1`` of them)."""
        return tuple(i for i in range(1, len(self.assignment)) if self.assignment[i] != self.assignment[i - 1])

    def stage_units(self, p: int) -> list[list[int]]:
        """Unit indices of each of the ``p`` stages."""
        out: list[list[int]] = [[] for _ in range(p)]
        for i, s in enumerate(self.assignment):
            out[s].append(i)
        return out
