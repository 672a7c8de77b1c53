"""``live_bytes`` against a brute force that walks the forward, freeing each value after its last reader."""

from __future__ import annotations

import random

from partitioner.inference.liveness import live_bytes


def _brute(out: list[float], readers: list[set[int]], views: set[int], kept: set[int]) -> list[float]:
    n = len(out)
    base = list(range(n))  # a view's storage is its (first) input's, transitively
    for v in range(n):
        if v in views:
            inputs = [i for i in range(v) if v in readers[i]]
            base[v] = base[inputs[0]] if inputs else v
    needed_until = {}
    for i in range(n):
        last = n - 1 if i in kept else max(readers[i], default=i)
        needed_until[base[i]] = max(needed_until.get(base[i], base[i]), last)
    result = []
    for j in range(n):
        alive = [i for i in range(n) if i not in views and i <= j <= needed_until[i]]
        result.append(float(sum(out[i] for i in alive)))
    return result


def test_live_bytes_matches_a_brute_force_on_random_graphs() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 12)
        out = [float(rng.randint(0, 9)) for _ in range(n)]
        readers = [{j for j in range(i + 1, n) if rng.random() < 0.3} for i in range(n)]
        # A view reads exactly one earlier value (its base), as a reshape or a slice does.
        views: set[int] = set()
        for v in range(1, n):
            if rng.random() < 0.3:
                for i in range(v):
                    readers[i].discard(v)
                readers[rng.randrange(v)].add(v)
                views.add(v)
        kept = {i for i in range(n) if rng.random() < 0.15}
        assert live_bytes(out, readers, views=views, kept=kept) == _brute(out, readers, views, kept)


def test_a_value_read_at_the_end_stays_alive_and_a_dead_one_is_freed_at_once() -> None:
    assert live_bytes([5, 1, 1], [set(), {2}, set()]) == [5.0, 1.0, 2.0]
    assert live_bytes([5, 1, 1], [set(), {2}, set()], kept={0}) == [5.0, 6.0, 7.0]
