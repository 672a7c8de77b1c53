"""Problems and reference solvers shared by the algorithm tests: hypothesis strategies, brute force,
an independent dynamic program, and a transformer-sized problem.

Legend: ``n`` units, ``p`` stages, ``s`` a stage, ``k`` a cut position.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator

import numpy as np
from hypothesis import strategies as st

from partitioner.algorithms import Partition, Problem, Tensor, check_assignment, evaluate
from partitioner.errors import PartitionError
from profiles import LONG

INF = math.inf


def examples(n: int) -> int:
    """Hypothesis examples for a property: ``n`` with ``PIPECUT_FUZZ=long``, a quarter (at least 25)
    in the default run, which CI's 2 cores pay for on every push; the long run is the search."""
    return n if LONG else max(25, n // 4)


@st.composite
def problems(draw: st.DrawFn, *, max_n: int = 9, max_p: int = 4, min_p: int = 1,
             cuts: bool = True, dyadic: bool = False, memory: bool = True) -> Problem:
    """Random small problems: skip connections, graph inputs and outputs, per-stage devices,
    memory caps (often infeasible), restricted cut sets.

    With ``dyadic`` every number is a small multiple of 1/8 and every bandwidth a power of two,
    so all sums are exact in floating point.
    """
    n = draw(st.integers(1, max_n))
    p = draw(st.integers(min_p, max_p))
    if dyadic:
        time = st.integers(0, 40).map(lambda x: x / 8)
    else:
        time = st.one_of(st.just(0.0), st.floats(0.0, 10.0, allow_nan=False), st.integers(1, 5).map(float))
    base = [draw(time) for _ in range(n)]
    rows = []
    for _ in range(p):
        kind = draw(st.sampled_from(["same", "scaled", "free"]))
        if kind == "same":
            rows.append(tuple(base))
        elif kind == "scaled":
            f = draw(st.sampled_from([0.5, 2.0, 3.0]))
            rows.append(tuple(x * f for x in base))
        else:
            rows.append(tuple(draw(time) for _ in range(n)))
    tensors = []
    for i in range(-1, n):
        if draw(st.integers(0, 9)) < 8:
            later = list(range(max(i + 1, 0), n + 1))  # n: the graph output
            readers = draw(st.sets(st.sampled_from(later), min_size=1, max_size=min(3, len(later))))
            if i >= 0 and i + 1 < n and draw(st.booleans()):
                readers.add(i + 1)  # a chain edge most of the time, as in real graphs
            tensors.append(Tensor(i, tuple(sorted(readers)), float(draw(st.integers(0, 40)))))
    state = tuple(float(draw(st.integers(0, 10))) for _ in range(n))
    act = tuple(float(draw(st.integers(0, 6))) for _ in range(n))
    inflight = tuple(draw(st.integers(1, 4)) for _ in range(p))
    most = sum(state) + max(inflight) * sum(act)
    cap_values = st.integers(0, int(most) + 1).map(float) if memory else st.nothing()
    capacity = tuple(draw(st.one_of(st.just(INF), cap_values)) for _ in range(p))
    if dyadic:
        bw = st.sampled_from([1.0, 4.0, 16.0, INF])
        lat = st.sampled_from([0.0, 0.25, 0.5])
    else:
        bw = st.sampled_from([1.0, 7.0, 100.0, INF])
        lat = st.one_of(st.just(0.0), st.floats(0.0, 1.0))
    bandwidth = tuple(draw(bw) for _ in range(p - 1))
    latency = tuple(draw(lat) for _ in range(p - 1))
    allowed = None
    if cuts and n > 1 and draw(st.booleans()):
        allowed = tuple(sorted(draw(st.sets(st.integers(1, n - 1)))))
    params = None
    if draw(st.booleans()):
        params = tuple(float(draw(st.integers(0, 9))) for _ in range(n))
    return Problem(compute=tuple(rows), state_bytes=state, act_bytes=act, tensors=tuple(tensors),
                   capacity=capacity, inflight=inflight, link_bandwidth=bandwidth,
                   link_latency=latency, cuts=allowed, param_counts=params)


def contiguous_partitions(pb: Problem) -> Iterator[Partition]:
    """Every contiguous partition into exactly p non-empty stages with allowed cuts."""
    for cuts in itertools.combinations(sorted(set(pb.allowed_cuts())), pb.p - 1):
        yield Partition.from_cuts(cuts, pb.n, "brute")


def brute_best(pb: Problem) -> float | None:
    """Least bottleneck of a memory-feasible contiguous partition, None if none fits."""
    best = None
    for part in contiguous_partitions(pb):
        ev = evaluate(pb, part)
        if ev.feasible and (best is None or ev.bottleneck < best):
            best = ev.bottleneck
    return best


def forward_valid(pb: Problem, stage: tuple[int, ...]) -> bool:
    """Independent statement of validity: all stages used, data forward, blocks whole."""
    if set(stage) != set(range(pb.p)):
        return False
    for t in pb.tensors:
        if t.producer >= 0 and any(c < pb.n and stage[c] < stage[t.producer] for c in t.consumers):
            return False
    cut_ok = pb.cuts is None or all(stage[k] == stage[k - 1] for k in range(1, pb.n) if k not in pb.cuts)
    return cut_ok


def all_assignments(pb: Problem) -> Iterator[tuple[int, ...]]:
    """Every forward-flowing assignment (contiguous or not): brute force over p ** n."""
    for stage in itertools.product(range(pb.p), repeat=pb.n):
        if forward_valid(pb, stage):
            yield stage


def is_valid(pb: Problem, part: Partition) -> bool:
    try:
        check_assignment(pb, part)
    except PartitionError:
        return False
    return True


def crossing(pb: Problem) -> np.ndarray:
    """Bytes over each cut position 0..n of a contiguous partition, by walking each tensor's span."""
    x = np.zeros(pb.n + 1)
    for t in pb.tensors:
        if t.producer < 0 or not t.consumers:
            continue
        for k in range(t.producer + 1, min(max(t.consumers), pb.n - 1) + 1):
            x[k] += t.nbytes
    return x


def dp_best(pb: Problem, upper: float = INF) -> tuple[float, list[int]] | None:
    """Least bottleneck by dynamic programming over (stage, end position): an algorithm unlike
    ``exact`` (no thresholds), vectorised over end positions and looping over stage lengths.

    ``upper`` must be the bottleneck of some feasible partition (or inf): stages whose compute
    alone exceeds it cannot be in an optimal partition, which bounds the lengths tried.
    Returns ``(bottleneck, cuts)`` or None when no partition fits memory.
    """
    n, p = pb.n, pb.p
    ok_pos = np.zeros(n + 1, dtype=bool)
    ok_pos[list(pb.allowed_cuts())] = True
    x = crossing(pb)
    state = np.concatenate(([0.0], np.cumsum(pb.state_bytes)))
    act = np.concatenate(([0.0], np.cumsum(pb.act_bytes)))
    best = np.full(n + 1, INF)
    best[0] = 0.0
    choice = np.zeros((p, n + 1), dtype=np.intp)
    ends = np.arange(n + 1)
    for s in range(p):
        comp = np.concatenate(([0.0], np.cumsum(pb.compute[s])))
        x_in = _link(pb, s, x) if s > 0 else np.zeros(n + 1)
        x_out = _link(pb, s + 1, x) if s < p - 1 else np.zeros(n + 1)
        new = np.full(n + 1, INF)
        arg = np.zeros(n + 1, dtype=np.intp)
        for length in range(1, n + 1):
            c = ends[length:]
            b = c - length
            cost = comp[c] - comp[b] + x_in[b] + x_out[c]
            mem = state[c] - state[b] + pb.inflight[s] * (act[c] - act[b])
            if np.all(comp[c] - comp[b] > upper):
                break
            cand = np.maximum(best[b], cost)
            cand[mem > pb.capacity[s]] = INF
            if s > 0:
                cand[~ok_pos[b]] = INF
            better = cand < new[c]
            new[c[better]] = cand[better]
            arg[c[better]] = b[better]
        if s < p - 1:
            new[~ok_pos] = INF
        else:
            new[:n] = INF
        best, choice[s] = new, arg
    if best[n] == INF:
        return None
    cuts, c = [], n
    for s in range(p - 1, 0, -1):
        c = int(choice[s, c])
        cuts.append(c)
    return float(best[n]), cuts[::-1]


def _link(pb: Problem, t: int, x: np.ndarray) -> np.ndarray:
    bw, lat = pb.link_bandwidth[t - 1], pb.link_latency[t - 1]
    with np.errstate(divide="ignore"):
        return np.where(x > 0, lat + x / bw, 0.0)


def transformer_problem(layers: int = 333, p: int = 64, *, seed: int = 0, module_cuts: bool = False,
                        mem_scale: float = 0.55) -> Problem:
    """A decoder-only transformer as the partitioner would see it at node granularity.

    ``1 + 12 * layers + 3`` units (embedding; per layer ln1, q, k, v, attention, projection, add,
    ln2, fc1, gelu, fc2, add with two residual skips; final norm, head, loss). Devices alternate
    a fast and a slow kind (rows are not proportional: per-op overheads differ), every 8th link is
    a slow inter-node one, activations are held 1F1B-style (``p - s`` micro-batches), and memory
    is scaled so that it binds on the early stages.
    """
    rng = random.Random(seed)
    hidden, tokens, vocab = 4096, 4096, 50304
    act = float(tokens * hidden * 2)
    names: list[str] = []
    flops: list[float] = []
    params: list[float] = []
    saved: list[float] = []
    tensors: list[Tensor] = []

    def unit(name: str, f: float, prm: float, sv: float) -> int:
        names.append(name)
        flops.append(f * (1 + 0.05 * rng.random()))
        params.append(prm)
        saved.append(sv)
        return len(names) - 1

    h2 = hidden * hidden
    e = unit("embed", 2 * tokens * hidden, vocab * hidden, act)
    tensors.append(Tensor(-1, (e,), tokens * 8.0))
    x = e
    layer_starts = []
    for ly in range(layers):
        layer_starts.append(len(names))
        ln1 = unit(f"h.{ly}.ln1", 5 * tokens * hidden, 2 * hidden, act)
        q = unit(f"h.{ly}.q", 2 * tokens * h2, h2, act)
        k = unit(f"h.{ly}.k", 2 * tokens * h2, h2, act)
        v = unit(f"h.{ly}.v", 2 * tokens * h2, h2, act)
        at = unit(f"h.{ly}.attn", 4 * tokens * 2048 * hidden, 0, 2 * act)
        pr = unit(f"h.{ly}.proj", 2 * tokens * h2, h2, act)
        a1 = unit(f"h.{ly}.add1", tokens * hidden, 0, 0)
        ln2 = unit(f"h.{ly}.ln2", 5 * tokens * hidden, 2 * hidden, act)
        f1 = unit(f"h.{ly}.fc1", 8 * tokens * h2, 4 * h2, 4 * act)
        ge = unit(f"h.{ly}.gelu", 8 * tokens * hidden, 0, 4 * act)
        f2 = unit(f"h.{ly}.fc2", 8 * tokens * h2, 4 * h2, act)
        a2 = unit(f"h.{ly}.add2", tokens * hidden, 0, 0)
        tensors += [Tensor(x, (ln1, a1), act), Tensor(ln1, (q, k, v), act), Tensor(q, (at,), act),
                    Tensor(k, (at,), act), Tensor(v, (at,), act), Tensor(at, (pr,), act),
                    Tensor(pr, (a1,), act), Tensor(a1, (ln2, a2), act), Tensor(ln2, (f1,), act),
                    Tensor(f1, (ge,), 4 * act), Tensor(ge, (f2,), 4 * act), Tensor(f2, (a2,), act)]
        x = a2
    layer_starts.append(len(names))
    lnf = unit("ln_f", 5 * tokens * hidden, 2 * hidden, act)
    head = unit("head", 2 * tokens * hidden * vocab, 0, tokens * vocab * 2.0)
    loss = unit("loss", 4 * tokens * vocab, 0, tokens * vocab * 4.0)
    n = len(names)
    tensors += [Tensor(x, (lnf,), act), Tensor(lnf, (head,), act),
                Tensor(head, (loss,), tokens * vocab * 2.0), Tensor(-1, (loss,), tokens * 8.0),
                Tensor(loss, (n,), 4.0)]
    fast = [s % 2 == 0 for s in range(p)]
    compute = tuple(tuple(3 * f / (989e12 if fs else 312e12) + (4e-6 if fs else 8e-6) for f in flops)
                    for fs in fast)
    state = tuple(16.0 * q for q in params)
    inflight = tuple(min(128, p - s) for s in range(p))
    per_stage = (sum(state) + sum(inflight) / p * sum(saved)) / p / mem_scale
    capacity = tuple(float(math.floor(per_stage * (1.0 if fs else 0.75))) for fs in fast)
    return Problem(
        compute=compute, state_bytes=state, act_bytes=tuple(saved), tensors=tuple(tensors),
        capacity=capacity, inflight=inflight,
        link_bandwidth=tuple(25e9 if s % 8 == 7 else 450e9 for s in range(p - 1)),
        link_latency=tuple(30e-6 if s % 8 == 7 else 8e-6 for s in range(p - 1)),
        cuts=tuple(layer_starts[1:]) if module_cuts else None, names=tuple(names),
        param_counts=tuple(params),
    )
