"""The layout search on plain data: its space, its pruning against brute force, ties, and the exchange model."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.cost.devices import Cluster
from partitioner.cost.exchange import (
    Collective,
    allreduce_time,
    collective,
    exchange_end,
    pipeline_links,
    reduce_time,
)
from partitioner.cost.nodecost import NodeCost, scale_cost
from partitioner.errors import InfeasibleMemoryError
from partitioner.plan.layout import TIE, ZERO_OPTIONS, Layout, Option, divisors, layout_space, pick, search
from partitioner.schedule.registry import TRAINING_SCHEDULES, get_schedule, stages_per_rank
from partitioner.schedule.simulate import StageCosts, simulate


@given(st.integers(1, 12), st.integers(1, 48))
def test_the_space_is_every_layout_of_the_devices(devices: int, batch: int) -> None:
    got = set(layout_space(devices, batch, zero=ZERO_OPTIONS))
    want = set()
    for dp in range(1, devices + 1):
        for b in range(1, batch + 1):
            for sched in TRAINING_SCHEDULES:
                for zero in ZERO_OPTIONS:
                    pp = devices // dp
                    if (devices % dp or batch % (dp * b) or (zero != "none" and dp == 1)
                            or (pp == 1 and stages_per_rank(sched) > 1)):
                        continue
                    want.add(Option(dp, pp, sched, b, zero, batch))
    assert got == want
    for o in got:
        assert o.dp * o.pp == devices and o.dp * o.microbatches * o.microbatch_size == batch
    assert {o.dp for o in got if o.zero == "fsdp"} == {o.dp for o in got if o.dp > 1}  # fsdp: wherever dp > 1


def test_the_space_keeps_only_what_is_asked() -> None:
    space = layout_space(8, 16, schedules=("zbv",), microbatch_sizes=(2,), zero=("none",), max_stages=8,
                         dp_sizes=(1, 2))
    assert {(o.dp, o.pp, o.stages) for o in space} == {(2, 4, 8)}  # dp1 x pp8 would cut 16 stages


def _row(o: Option, step: float, fits: bool = True) -> Layout:
    return Layout(o.dp, o.pp, o.stages, o.schedule, o.microbatch_size, o.microbatches, o.global_batch, o.zero,
                  step, step, 0.0, 0.0, 0.1, 1.0, 2.0, 0.0, 0, fits=fits, priced=True)


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(1, 4))
def test_pruning_returns_the_brute_force_choice(data: st.DataObject, top: int) -> None:
    options = layout_space(4, 16)
    steps = {o: data.draw(st.floats(0.5, 2.0)) for o in options}
    slack = {o: data.draw(st.floats(0.0, 1.0)) for o in options}  # bound = step * slack: valid, sometimes loose
    fits = {o: data.draw(st.booleans()) or o == options[0] for o in options}
    priced: list[Option] = []

    def price(o: Option) -> Layout:
        priced.append(o)
        return _row(o, steps[o], fits[o])

    def bound(o: Option) -> tuple[float, str | None, float]:
        return steps[o] * slack[o], None, 0.0

    pruned = search(options, price, bound, capacity=2.0, top=top)
    n = len(priced)
    brute = search(options, price, bound, capacity=2.0, top=top, prune=False)
    assert pick(pruned)[0] == pick(brute)[0]
    ranked_pruned = [r for r in pruned if r.fits][:top]
    ranked_brute = [r for r in brute if r.fits][:top]
    assert [r.step_time for r in ranked_pruned] == [r.step_time for r in ranked_brute]
    assert len(pruned) == len(options) and n <= len(options)


def test_a_layout_whose_state_cannot_fit_is_not_priced() -> None:
    options = layout_space(2, 2, schedules=("1f1b",))

    def price(o: Option) -> Layout:
        assert o.pp == 2, "a layout whose state cannot fit was priced"
        return _row(o, 1.0)

    rows = search(options, price, lambda o: (0.0, "training state" if o.pp == 1 else None, 0.0), capacity=1.0)
    assert pick(rows)[0].pp == 2
    assert {r.note for r in rows if r.pp == 1} == {"training state"}


def test_ties_go_to_fewer_pipeline_ranks_then_larger_micro_batches() -> None:
    a = _row(Option(1, 4, "1f1b", 1, "none", 8), 1.0)
    b = _row(Option(2, 2, "1f1b", 1, "none", 8), 1.0 * (1 + TIE / 2))
    c = _row(Option(2, 2, "1f1b", 2, "none", 8), 1.0 * (1 + TIE / 2))
    d = _row(Option(4, 1, "1f1b", 2, "none", 8), 1.0 * (1 + 2 * TIE))  # not a tie
    best, why = pick([a, b, c, d])
    assert best == c and "within 1%" in why


def test_nothing_fits_says_so() -> None:
    with pytest.raises(InfeasibleMemoryError, match="No layout fits"):
        pick([_row(Option(1, 2, "1f1b", 1, "none", 2), 1.0, fits=False)])


# -- the exchange ---------------------------------------------------------------------------------


def test_ring_collectives() -> None:
    ring = Collective(bandwidth=10.0, latency=0.5)
    assert allreduce_time(40.0, 4, ring, bucket_bytes=40) == pytest.approx(2 * 3 / 4 * 4.0 + 6 * 0.5)
    assert allreduce_time(40.0, 4, ring, bucket_bytes=20) == pytest.approx(6.0 + 2 * 6 * 0.5)  # two buckets
    assert reduce_time(40.0, 4, ring, bucket_bytes=40) == pytest.approx(3 / 4 * 4.0 + 3 * 0.5)
    assert allreduce_time(40.0, 1, ring) == 0.0 == reduce_time(0.0, 4, ring)


def test_groups_and_pipelines_across_nodes() -> None:
    c = Cluster.uniform(32, "A100-80GB")  # nodes of 8
    dev = c.devices[0]
    assert collective(c, 4, 8).bandwidth == dev.inter_node_bandwidth  # ranks 0, 8, 16, 24: four nodes
    assert collective(c, 8, 4).bandwidth == dev.inter_node_bandwidth  # ranks 0, 4, ..., 28
    assert collective(c, 2, 4).bandwidth == dev.link_bandwidth  # ranks 0 and 4: one node
    links = pipeline_links(c, 16).link_bandwidth
    assert [i for i, bw in enumerate(links) if bw == dev.inter_node_bandwidth] == [7]
    measured = Cluster(c.devices, c.link_bandwidth, c.link_latency, collective_bandwidth=1e9, collective_latency=1e-4)
    assert collective(measured, 4, 8) == Collective(1e9, 1e-4)
    assert Cluster.from_dict(measured.to_dict()) == measured


@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0, 5)), min_size=1, max_size=6), st.integers(1, 3))
def test_exchange_ends_after_each_stage_is_ready_and_sent(stages: list[tuple[float, float]], ranks: int) -> None:
    ready, cost = [r for r, _ in stages], [c for _, c in stages]
    place = [s % ranks for s in range(len(stages))]
    ends = exchange_end(ready, cost, place, ranks)
    for r in range(ranks):
        mine = sorted((ready[s], cost[s]) for s in range(len(stages)) if place[s] == r)
        t = 0.0
        for rd, c in mine:
            t = max(t, rd) + c
        assert ends[r] == pytest.approx(t)
        assert all(ends[r] >= rd + c - 1e-9 for rd, c in mine)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(TRAINING_SCHEDULES), st.integers(1, 4), st.integers(1, 8), st.data())
def test_grads_ready_is_each_stages_last_backward_end(name: str, p: int, m: int, data: st.DataObject) -> None:
    sched = get_schedule(name, p, m)
    S = sched.num_stages
    times = st.lists(st.floats(0.1, 3.0), min_size=S, max_size=S)
    costs = StageCosts(forward=tuple(data.draw(times)), backward_input=tuple(data.draw(times)),
                       backward_weight=tuple(data.draw(times)))
    sim = simulate(sched, costs)
    last = [0.0] * S
    for span in sim.timeline.spans:
        if span.kind.value in ("B", "W"):
            last[span.stage] = max(last[span.stage], span.end)
    assert sim.grads_ready == pytest.approx(tuple(last))
    assert max(sim.grads_ready) <= sim.step_time + 1e-9


def test_costs_scale_with_the_rows_but_not_the_weights() -> None:
    c = NodeCost(fwd_flops=10.0, bwd_flops=20.0, param_bytes=64, buffer_bytes=16, io_bytes=180, saved_bytes=30,
                 output_bytes=50, measured_fwd_s=1.0)
    x = scale_cost(c, 3)
    assert (x.fwd_flops, x.bwd_flops, x.saved_bytes, x.output_bytes) == (30.0, 60.0, 90, 150)
    assert x.io_bytes == 80 + 3 * 100 and x.param_bytes == 64 and x.measured_fwd_s == 3.0
    assert scale_cost(c, 1) == c
    assert divisors(1) == [1] and math.prod(divisors(7)) == 7


# -- processes sharing a host: overheads and cores ---------------------------------------------


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(TRAINING_SCHEDULES), st.integers(1, 3), st.integers(1, 6), st.floats(0.0, 0.5))
def test_an_action_overhead_is_paid_once_per_action(name: str, p: int, m: int, extra: float) -> None:
    sched = get_schedule(name, p, m)
    S = sched.num_stages
    plain = StageCosts.uniform(S, forward=1.0, backward_input=1.0, backward_weight=0.5)
    taxed = StageCosts(plain.forward, plain.backward_input, plain.backward_weight, action_overhead=(extra,) * S)
    spans = simulate(sched, taxed).timeline.spans
    for span in spans:
        assert span.duration == pytest.approx(plain.duration(_action(span)) + extra)


def _action(span):  # type: ignore[no-untyped-def]
    from partitioner.schedule.actions import Action

    return Action(span.stage, span.kind, span.mb)


def test_busy_ranks_take_the_cores_idle_ones_leave() -> None:
    from dataclasses import replace as dc_replace

    from partitioner.search import _shared_cores_speedup

    c = dc_replace(Cluster.uniform(4, "cpu"), cores=2)
    assert _shared_cores_speedup(c, 4, 1, [2.0] * 4, 2.0) == 1.0  # all busy: the measured share
    assert _shared_cores_speedup(c, 4, 1, [0.5] * 4, 2.0) == 2.0  # one busy on average: a whole core
    assert _shared_cores_speedup(c, 4, 2, [2.0, 2.0], 2.0) == 1.0  # two replicas of two, all busy
    assert _shared_cores_speedup(c, 4, 2, [1.0, 1.0], 2.0) == 2.0  # half idle: two busy, a core each
    assert _shared_cores_speedup(Cluster.uniform(4, "cpu"), 4, 1, [0.5] * 4, 2.0) == 1.0  # not shared
    assert Cluster.from_dict(c.to_dict()) == c
