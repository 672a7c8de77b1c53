"""FSDP in the layout search: its memory and time against ZeRO-1's by hand, its bound, a layout only it fits."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from partitioner import Cluster, Plan, plan_layout
from partitioner.cost.devices import DeviceSpec
from partitioner.cost.exchange import DEFAULT_BUCKET_BYTES, collective, reduce_time
from partitioner.errors import InfeasibleMemoryError
from partitioner.plan.layout import DEFAULT_ZERO, ZERO_OPTIONS, Layout, Option, layout_space, pick
from partitioner.search import LayoutSearch

WIDTH = 96
BLOCK = WIDTH * WIDTH + WIDTH  # one Linear's parameters: a block of the MLP below


def _mlp(blocks: int = 6, width: int = WIDTH) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks)])


def _rows(**kw: object) -> dict[str, Layout]:
    """dp2 x pp1 1f1b with micro-batches of 4 (m = 1), priced under each sharding."""
    plan = plan_layout(_mlp(), (torch.randn(1, WIDTH),), cluster=Cluster.uniform(2, "cpu"), microbatch_sizes=(4,),
                       schedules=("1f1b",), dp_sizes=(2,), prune=False, zero=ZERO_OPTIONS, **kw)  # type: ignore[arg-type]
    return {r.zero: r for r in plan.layouts}


def test_fsdp_holds_the_weights_shard_and_two_gathered_blocks() -> None:
    params = 6 * BLOCK
    for precision in ("fp32", "bf16"):  # the runtime gathers the fp32 weights as stored, under autocast too
        rows = _rows(global_batch=8, precision=precision)
        # Adam in fp32, dp 2: none 16 bytes per parameter, zero1 8 + 8/2 = 12, fsdp 4/2 + 4 + 8/2 = 10
        # and two blocks gathered in fp32 (the MLP has no parameter outside its blocks).
        assert rows["none"].memory - rows["zero1"].memory == pytest.approx(params * 4)
        assert rows["zero1"].memory - rows["fsdp"].memory == pytest.approx(params * 2 - 2 * BLOCK * 4)


def test_a_split_backward_keeps_the_whole_stage_gathered() -> None:
    # ZB-H1's weight gradients may read a block's weights after its input gradients: the runtime
    # keeps each block gathered from its first backward to the last, the whole stage.
    plan = plan_layout(_mlp(), (torch.randn(1, WIDTH),), cluster=Cluster.uniform(2, "cpu"), microbatch_sizes=(4,),
                       schedules=("1f1b", "zbh1"), dp_sizes=(2,), zero=("fsdp",), prune=False, global_batch=8)
    rows = {r.schedule: r for r in plan.layouts}
    params = 6 * BLOCK
    assert rows["zbh1"].memory - rows["1f1b"].memory == pytest.approx(params * 4 - 2 * BLOCK * 4)


def test_fsdp_gathers_before_every_forward_and_backward_and_reduce_scatters_once() -> None:
    rows = _rows(global_batch=16)  # m = 2
    zero1, fsdp = rows["zero1"], rows["fsdp"]
    params, m = 6 * BLOCK, 2
    ring = collective(Cluster.uniform(2, "cpu"), 2, 1)
    gather = reduce_time(params * 4, 2, ring, DEFAULT_BUCKET_BYTES)  # fp32 weights, half an all-reduce
    # and FSDP2's copies: the shard into the gather's buffer, the whole weights out of it
    gather += 2 * 4 * params * (1 + 1 / 2) / DeviceSpec.preset("cpu").mem_bandwidth
    assert fsdp.pipeline_time - zero1.pipeline_time == pytest.approx(2 * m * gather)  # one rank: nothing hides it
    assert fsdp.gather_time == pytest.approx(2 * m * gather) and zero1.gather_time == 0.0
    assert zero1.note == "chosen" and "FSDP gathers" in fsdp.note  # what it loses on
    # One rank: each exchange starts when the pipeline ends; zero1 reduces and broadcasts, fsdp only reduce-scatters.
    assert fsdp.exchange_time == pytest.approx(zero1.exchange_time / 2)
    assert fsdp.optimizer_time == pytest.approx(zero1.optimizer_time)
    assert fsdp.exchange_bytes == pytest.approx(0.5 * params * (4 + 2 * m * 4))
    assert fsdp.step_time > zero1.step_time


@pytest.mark.parametrize("flop_bound", [False, True])
def test_the_bound_stays_below_every_price(flop_bound: bool) -> None:
    # FLOP-bound (no per-op or per-action overhead), a split backward's weight gradients are a
    # visible part of the work: with fewer micro-batches than ranks, they leave the chain.
    dev = replace(DeviceSpec.preset("cpu"), op_overhead=0.0, action_overhead=0.0, mem_bandwidth=1e15)
    cluster = (replace(Cluster.uniform(4, dev, link_bandwidth=1e15, link_latency=0.0), collective_bandwidth=1e9,
                       collective_latency=0.0) if flop_bound else Cluster.uniform(4, "cpu"))
    found = LayoutSearch(_mlp(8, 256), (torch.randn(1, 256),), cluster=cluster, global_batch=16)
    p = found._pricer
    checked = set()
    for o in found.space(zero=ZERO_OPTIONS):
        lb, impossible, floor = p.bound(o)
        assert impossible is None
        lay = p.price(o)
        assert lb <= lay.step_time * (1 + 1e-9) and floor <= lay.memory * (1 + 1e-9), o.label()
        checked.add(o.zero)
    assert checked == {"none", "zero1", "fsdp"}


def _small(memory_blocks: int) -> Cluster:
    """Four devices of ``memory_blocks`` 256-wide blocks' bytes each (all usable: no reserve), bound by FLOPs,
    with a free collective."""
    block = 256 * 256 + 256
    dev = replace(DeviceSpec.preset("cpu"), name="small", memory=memory_blocks * block, memory_reserve=0.0,
                  op_overhead=0.0, mem_bandwidth=1e15)
    return replace(Cluster.uniform(4, dev), collective_bandwidth=1e15, collective_latency=0.0)


@pytest.fixture(scope="module")
def squeezed() -> tuple[Plan, Plan]:
    """16 blocks on four devices of 140 blocks' bytes: per block-byte, one replica's 16 blocks need
    160 with zero1 over dp 4, 7 x 16 + 2 x 4 = 120 with fsdp (two blocks gathered in fp32)."""
    kw = dict(cluster=_small(140), global_batch=16, zero=ZERO_OPTIONS)
    model = _mlp(16, 256)
    return (plan_layout(model, (torch.randn(1, 256),), **kw),  # type: ignore[arg-type]
            plan_layout(model, (torch.randn(1, 256),), prune=False, **kw))  # type: ignore[arg-type]


def test_fsdp_fits_fewer_pipeline_ranks_than_zero1_and_wins(squeezed: tuple[Plan, Plan]) -> None:
    pruned, brute = squeezed
    assert pruned.layout == brute.layout
    chosen = brute.layout
    assert chosen is not None and chosen.zero == "fsdp" and (chosen.dp, chosen.pp) == (4, 1)
    fewest = min(r.pp for r in brute.layouts if r.fits and r.zero != "fsdp")
    assert fewest == 2  # without fsdp, a replica needs two ranks (and a bubble)
    assert not any(r.fits for r in brute.layouts if r.pp == 1 and r.zero != "fsdp")
    assert pick(brute.layouts)[0].option == chosen.option


def test_a_fsdp_plan_round_trips_and_says_so(squeezed: tuple[Plan, Plan], tmp_path) -> None:
    plan, _ = squeezed
    path = tmp_path / "plan.json"
    plan.save(path)
    back = Plan.load(path)
    assert back.layout == plan.layout and back.layout is not None and back.layout.zero == "fsdp"
    assert back.layouts == plan.layouts
    text = " ".join(str(back).split())  # the layout line wraps at the console width
    assert "parameters, gradients and optimizer state sharded over the replicas (FSDP)" in text
    assert plan.layout is not None and plan.layout.label().endswith(" fsdp")


def test_ties_go_to_the_least_sharding() -> None:
    def row(zero: str) -> Layout:
        o = Option(2, 2, "1f1b", 1, zero, 8)
        return Layout(o.dp, o.pp, o.stages, o.schedule, o.microbatch_size, o.microbatches, o.global_batch, zero,
                      1.0, 1.0, 0.0, 0.0, 0.1, 1.0, 2.0, 0.0, 0, fits=True, priced=True)

    assert pick([row("fsdp"), row("zero1"), row("none")])[0].zero == "none"
    assert pick([row("fsdp"), row("zero1")])[0].zero == "zero1"


def test_reusing_infeasibility_changes_no_outcome() -> None:
    # Tight enough that cuts fail (activations of up to 512 rows), with every sharding: pricing in
    # the search's order with the pricer's shortcuts (_no_fit, _too_big) gives what pricing each
    # layout afresh gives.
    found = LayoutSearch(_mlp(16, 256), (torch.randn(1, 256),), cluster=_small(130), global_batch=512,
                         recompute=False)
    p = found._pricer
    options = [o for o in found.space(zero=ZERO_OPTIONS) if p.bound(o)[1] is None]

    def outcome(o: Option) -> tuple[object, ...]:
        try:
            lay = p.price(o)
        except InfeasibleMemoryError:
            return ("no cut fits",)
        return (lay.fits, lay.step_time, lay.memory)

    reused = {o: outcome(o) for o in sorted(options, key=lambda o: (p.bound(o)[0], o))}
    assert p._no_fit or p._too_big  # the shortcuts were taken
    for o in options:
        p._no_fit.clear()
        p._too_big.clear()
        assert outcome(o) == reused[o], o.label()
    assert {o.zero for o, r in reused.items() if r == ("no cut fits",)} == {"none", "zero1", "fsdp"}


def test_fsdp_is_searched_only_when_asked_for() -> None:
    assert DEFAULT_ZERO == ("none", "zero1") and set(DEFAULT_ZERO) < set(ZERO_OPTIONS)
    assert {o.zero for o in layout_space(4, 16)} == {"none", "zero1"}
    assert "fsdp" in {o.zero for o in layout_space(4, 16, zero=ZERO_OPTIONS)}
