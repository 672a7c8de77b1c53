"""Each unit's price for generation, read off the costed graph, and what a stage of units holds and takes.

Legend: ``n`` units, ``i`` a unit, ``p`` stages, ``s`` a stage, ``B`` sequences (the batch every stage
caches), ``g`` sequences in one decode step (a group in flight), ``L`` positions a sequence reaches,
``r x T`` the example's rows and positions (one prompt: the prefill), ``V`` the vocabulary.

Per unit (docs/generate.md, "What the planner counts"):

* **weights**: its parameters (a tied one on each stage that reads it) at the inference dtype, and
  its buffers; no gradients, no optimizer state;
* **cache**: per sequence, the keys and values of the layers it holds at ``L`` positions
  (:mod:`partitioner.inference.kv`);
* **working memory**: per sequence, the most bytes alive while one of its nodes runs in the
  prefill's forward (:mod:`partitioner.inference.liveness`, the example's ``r`` rows scaled to one),
  nodes from the head on counted at one position (the generator's head reads the last position only,
  so the last stage's includes the logits ``V``), or a layer's keys and values again, which the
  cache's concatenation holds twice for a moment at each decode step, whichever is larger;
* **decode step**: one position per sequence, priced as a roofline: the larger of its FLOPs
  (the matmuls' per position of the prefill, plus attention over the layer's cached positions,
  ``4 h d`` per position) at the device's peak and its bytes (every weight a matmul reads, read once
  per step whatever ``g``, plus per sequence its activations and its cache) at the device's memory
  bandwidth, plus the device's per-kernel overhead for each kernel it launches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from partitioner.algorithms.problem import Problem, Tensor
from partitioner.cost.devices import DeviceSpec
from partitioner.cost.nodecost import NodeCost
from partitioner.inference.kv import KVLayer
from partitioner.inference.liveness import live_bytes

__all__ = ["UnitPrice", "unit_prices", "decode_seconds", "inference_problem", "StageUse", "stage_use"]


@dataclass(frozen=True)
class UnitPrice:
    """What one unit holds and costs in generation, per sequence where it grows with the batch.

    Attributes:
        weight_bytes: its weights and buffers.
        kv_bytes: its layers' keys and values for one sequence of ``L`` positions.
        work_bytes: its working memory for one sequence (see the module docstring).
        flops: decode-step FLOPs for one sequence.
        read_fixed: bytes a decode step reads whatever the batch (the matmuls' weights).
        read_per_seq: bytes a decode step reads per sequence (activations, the cache).
        ops: kernels a decode step launches.

    Example:
        >>> u = UnitPrice(weight_bytes=8e6, kv_bytes=1e5, work_bytes=2e4, flops=4e6, read_fixed=8e6,
        ...               read_per_seq=1e5, ops=10)
        >>> dev = DeviceSpec("toy", peak_flops=1e12, peak_flops_fp32=1e12, mem_bandwidth=1e9, memory=1e9,
        ...                  op_overhead=1e-6)
        >>> round(decode_seconds([u], dev, group=20, dtype="torch.float32"), 6)   # (8e6 + 20 x 1e5) / 1e9 + 10 us
        0.01001
    """

    weight_bytes: float
    kv_bytes: float
    work_bytes: float
    flops: float
    read_fixed: float
    read_per_seq: float
    ops: int


def unit_prices(
    g: Any, units: Sequence[Any], *, weight_bytes: Sequence[float], layers: Sequence[KVLayer],
    layer_unit: Mapping[int, int], shape: tuple[int, int], max_len: int, dtype_bytes: float,
    head_from: int | None,
) -> tuple[UnitPrice, ...]:
    """Every unit's :class:`UnitPrice`.

    Args:
        g: the costed graph (``partitioner.cost.graph.build_graph``): nodes with ``cost`` and
            ``order``; ``inputs`` and ``outputs`` in its graph attributes.
        units: its units (``group_units``), in order.
        weight_bytes: per unit, its weights at the inference dtype and its buffers.
        layers: the model's decoder layers' caches (``kv_layers``).
        layer_unit: decoder layer index -> the unit charged with its cache (the first of its units).
        shape: ``(r, T)``, the example's rows and positions: the prefill the costs were counted for.
        max_len: ``L``.
        dtype_bytes: bytes per element of weights and cache.
        head_from: the graph order of the first node the generator runs on the last position only
            (the LM head), ``None`` if none.
    """
    rows, positions = shape
    tokens = rows * positions
    nodes = sorted(g.nodes, key=lambda v: g.nodes[v]["order"])
    inputs = list(g.graph["inputs"].items())
    index = {v: len(inputs) + j for j, v in enumerate(nodes)}
    out: list[float] = [float(nbytes) for _, (_, nbytes) in inputs]
    readers: list[set[int]] = [{index[r] for r in rs} for _, (rs, _) in inputs]
    views: set[int] = set()
    for v in nodes:
        c: NodeCost = g.nodes[v]["cost"]
        one_position = head_from is not None and g.nodes[v]["order"] >= head_from
        out.append(c.output_bytes / positions if one_position else float(c.output_bytes))
        readers.append({index[w] for w in g.successors(v)})
        if c.io_bytes == 0 and c.fwd_flops == 0:
            views.add(index[v])
    live = live_bytes(out, readers, views=views, kept={index[v] for v in g.graph["outputs"]})
    charged: dict[int, list[KVLayer]] = {}
    for i, u in layer_unit.items():
        charged.setdefault(u, []).append(layers[i])
    prices = []
    for u in units:
        held = charged.get(u.index, [])
        kv = [layer.positions(max_len) * layer.bytes_per_position(dtype_bytes) for layer in held]
        work = max((live[index[v]] for v in u.nodes), default=0.0) / rows
        flops = sum(4.0 * layer.heads * layer.head_dim * layer.attended(max_len) for layer in held)
        fixed, per_seq, ops = 0.0, float(sum(kv)), 0
        for v in u.nodes:
            c = g.nodes[v]["cost"]
            if c.fwd_flops > 0 and c.param_count > 0:  # a matmul on weights: its FLOPs grow with positions
                flops += c.fwd_flops / tokens
                fixed += c.param_count * dtype_bytes
            # Parameter-free FLOPs are attention over the prompt's positions: priced per layer above.
            per_seq += max(c.io_bytes - c.param_bytes - c.buffer_bytes, 0) / tokens
            ops += int(c.io_bytes > 0 or c.fwd_flops > 0)
        prices.append(UnitPrice(
            weight_bytes=float(weight_bytes[u.index]), kv_bytes=float(sum(kv)), work_bytes=max(work, *kv, 0.0),
            flops=flops, read_fixed=fixed, read_per_seq=per_seq, ops=ops,
        ))
    return tuple(prices)


def decode_seconds(prices: Sequence[UnitPrice], device: DeviceSpec, *, group: int, dtype: str) -> float:
    """Seconds of one decode step of ``group`` sequences through ``prices``' units on ``device`` (a
    roofline per unit: compute at the peak of ``dtype``, reads at the memory bandwidth, kernels' overhead)."""
    peak = device.flops_for(dtype)
    total = 0.0
    for u in prices:
        compute = u.flops * group / peak
        memory = (u.read_fixed + u.read_per_seq * group) / device.mem_bandwidth
        total += max(compute, memory) + u.ops * device.op_overhead
    return total


def inference_problem(
    base: Problem, prices: Sequence[UnitPrice], devices: Sequence[DeviceSpec], *, batch: int, group: int,
    dtype: str, tokens: int,
) -> Problem:
    """The cut's problem for generation: ``base`` (the graph's units, tensors and allowed cuts) with
    each unit's decode step of ``group`` sequences as its time, its weights and ``batch`` sequences'
    cache as its memory, the values crossing a cut at one position per sequence of the group
    (``tokens``: the example's), and each device's memory less the largest working memory of any
    unit for ``batch`` sequences (a stage needs its own largest; every stage is charged the model's:
    in a decoder every block's is the same, so only a stage of embedding or head alone is charged more)."""
    rows: dict[DeviceSpec, tuple[float, ...]] = {}
    for dev in devices:
        if dev not in rows:
            rows[dev] = tuple(decode_seconds([u], dev, group=group, dtype=dtype) for u in prices)
    work = batch * max((u.work_bytes for u in prices), default=0.0)
    return replace(
        base,
        compute=tuple(rows[dev] for dev in devices),
        state_bytes=tuple(u.weight_bytes + batch * u.kv_bytes for u in prices),
        act_bytes=(0.0,) * len(prices),
        inflight=(0,) * len(devices),
        tensors=tuple(Tensor(t.producer, t.consumers, t.nbytes * group / tokens) for t in base.tensors),
        capacity=tuple(cap - work for cap in base.capacity),
    )


@dataclass(frozen=True)
class StageUse:
    """What one stage holds for ``batch`` sequences.

    Attributes:
        weights: weights and buffers, bytes.
        kv: the key/value cache, bytes.
        work: working memory, bytes.
        per_seq: bytes each more sequence adds (cache and working memory).
    """

    weights: float
    kv: float
    work: float
    per_seq: float

    @property
    def memory(self) -> float:
        """Everything the stage holds at its peak."""
        return self.weights + self.kv + self.work

    def largest_batch(self, capacity: float) -> int:
        """The most sequences of ``L`` positions the stage holds within ``capacity`` bytes (0: not even its
        weights fit).

        Example:
            >>> StageUse(weights=100.0, kv=20.0, work=4.0, per_seq=6.0).largest_batch(200.0)
            16
        """
        room = capacity - self.weights
        if room < 0:
            return 0
        if self.per_seq <= 0 or math.isinf(room):
            return 2**31 - 1  # nothing grows with the batch, or no limit: any batch fits
        return int(room // self.per_seq)


def stage_use(prices: Sequence[UnitPrice], *, batch: int) -> StageUse:
    """What a stage of ``prices``' units holds for ``batch`` sequences: weights, cache, and its largest working memory.

    Example:
        >>> a = UnitPrice(weight_bytes=10.0, kv_bytes=2.0, work_bytes=3.0, flops=0, read_fixed=0, read_per_seq=0, ops=0)
        >>> stage_use([a, a], batch=4)
        StageUse(weights=20.0, kv=16.0, work=12.0, per_seq=7.0)
    """
    kv = sum(u.kv_bytes for u in prices)
    work = max((u.work_bytes for u in prices), default=0.0)
    return StageUse(weights=sum(u.weight_bytes for u in prices), kv=batch * kv, work=batch * work, per_seq=kv + work)
