"""Tensor parallelism in the planner, on plain data and traced graphs: what a tp group splits
(``partitioner.tensor.split``), what it costs, the tp sizes a model and its nodes take, and where
the layout's ranks sit (``partitioner.tensor.sizes``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from partitioner.cost.devices import Cluster
from partitioner.cost.exchange import Collective, pipeline_links
from partitioner.cost.nodecost import NodeCost, node_time, scale_cost, wgrad_time
from partitioner.errors import PartitionOptionError
from partitioner.tensor.sizes import model_heads, tp_groups, tp_sizes
from partitioner.tensor.split import TensorSplit, find_split, shard_costs, shard_numel
from partitioner.tracing.trace import trace

# -- pricing on plain data ------------------------------------------------------------------

PAIR = TensorSplit(column=frozenset({"up"}), row=frozenset({"down"}), split=frozenset({"up", "act"}),
                   sharded={"up.w": 4096, "up.b": 64, "down.w": 4096}, sizes={"up": 64, "down": 64},
                   fwd_allreduce={"down": "down"}, bwd_allreduce={"up": "x"})
COSTS = {
    "norm": NodeCost(fwd_flops=0, saved_bytes=1000, output_bytes=1000, io_bytes=2000, param_names=("n",)),
    "up": NodeCost(fwd_flops=8e6, bwd_flops=16e6, saved_bytes=1000, output_bytes=4000, param_bytes=1000,
                   io_bytes=6000, param_names=("up.w", "up.b")),
    "act": NodeCost(saved_bytes=4000, output_bytes=4000, io_bytes=8000),
    "down": NodeCost(fwd_flops=8e6, bwd_flops=16e6, saved_bytes=4000, output_bytes=1000, param_bytes=1000,
                     io_bytes=6000, param_names=("down.w", "down.b")),
}


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_the_sharded_weights_are_divided_and_the_rest_stays_whole(tp: int) -> None:
    numel = {"up.w": 4096, "up.b": 64, "down.w": 4096, "down.b": 64, "n": 64}
    per_rank = shard_numel(numel, PAIR, tp)
    # Weights, and with them gradients and optimizer state (the state is bytes per element).
    assert per_rank == {"up.w": 4096 // tp, "up.b": 64 // tp, "down.w": 4096 // tp, "down.b": 64, "n": 64}


@pytest.mark.parametrize("tp", [2, 4])
def test_compute_and_activations_inside_the_pair_are_divided(tp: int) -> None:
    out = shard_costs(COSTS, PAIR, tp, Collective(1e9, 0.0), {"x": 1000})
    assert out["norm"] == COSTS["norm"]  # outside the pair: whole
    up, act, down = out["up"], out["act"], out["down"]
    assert (up.fwd_flops, up.bwd_flops, down.fwd_flops) == (8e6 / tp, 16e6 / tp, 8e6 / tp)
    assert up.saved_bytes == 1000  # the column layer saves its whole input
    assert up.output_bytes == 4000 // tp and act.output_bytes == 4000 // tp and act.saved_bytes == 4000 // tp
    assert down.saved_bytes == 4000 // tp  # the row layer saves its split input
    assert down.output_bytes == 1000  # whole after its all-reduce
    assert up.io_bytes == round(1000 / tp + 1000 + 4000 / tp)  # weights and output split, input whole
    assert down.io_bytes == round((1000 + 4000) / tp + 1000)


@pytest.mark.parametrize(("tp", "bandwidth", "latency"), [(2, 1e9, 0.0), (8, 3e11, 1e-5), (4, 1e10, 5e-6)])
def test_each_allreduce_is_one_ring_with_its_latency(tp: int, bandwidth: float, latency: float) -> None:
    out = shard_costs(COSTS, PAIR, tp, Collective(bandwidth, latency), {"x": 1000})
    ring = 2 * (tp - 1)
    assert out["down"].comm_fwd_s == pytest.approx(ring / tp * 1000 / bandwidth + ring * latency)  # its output
    assert out["up"].comm_bwd_s == pytest.approx(ring / tp * 1000 / bandwidth + ring * latency)  # x's gradient
    assert sum(c.comm_bwd_s for c in out.values()) == out["up"].comm_bwd_s
    assert sum(c.comm_fwd_s for c in out.values()) == out["down"].comm_fwd_s


def test_the_allreduces_are_in_the_times_and_not_in_the_weight_gradients() -> None:
    dev = Cluster.uniform(1, "A100-80GB").devices[0]
    c = NodeCost(fwd_flops=1e12, bwd_flops=2e12, param_names=("w",))
    with_comm = NodeCost(fwd_flops=1e12, bwd_flops=2e12, param_names=("w",), comm_fwd_s=0.25, comm_bwd_s=0.5)
    (f0, b0), (f1, b1) = node_time(c, dev), node_time(with_comm, dev)
    assert (f1 - f0, b1 - b0) == pytest.approx((0.25, 0.5))
    assert wgrad_time(with_comm, b1) == pytest.approx(wgrad_time(c, b0))  # W is compute only
    assert scale_cost(with_comm, 2).comm_fwd_s == 0.5


def test_tp_one_changes_nothing() -> None:
    assert shard_costs(COSTS, PAIR, 1, Collective(1e9, 1e-5), {}) == COSTS
    assert shard_numel({"up.w": 10}, PAIR, 1) == {"up.w": 10}


# -- the pairs found in traced models --------------------------------------------------------


def _llama(layers: int = 2) -> tuple[nn.Module, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=layers, vocab_size=96)
    return transformers.LlamaForCausalLM(cfg).eval(), torch.randint(0, 96, (2, 16))


def _found(model: nn.Module, x: torch.Tensor) -> tuple[TensorSplit, dict[str, NodeCost]]:
    from partitioner.cost.costs import cost_graph

    t = trace(model, (x,))
    found = find_split(t.gm, {n.name: t.module_path(n) for n in t.gm.graph.nodes if n.op == "call_function"})
    return found, cost_graph(t)


def test_a_llama_splits_as_the_runtime_does() -> None:
    found, costs = _found(*_llama())
    assert found.problem is None and found.blocks == 2 and found.pairs == 4
    names = sorted(found.sharded)
    assert names == sorted(f"model.layers.{i}.{m}.weight" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    # Per block two all-reduces forward (after o and down) and two backward (q/k/v's input, gate/up's input).
    assert len(found.fwd_allreduce) == 2 * 2 and len(found.bwd_allreduce) == 2 * 2
    assert sorted(set(found.sizes.values())) == [32, 64, 128]  # k/v out (2 kv heads x 16), hidden, intermediate
    out = shard_costs(costs, found, 2, Collective(1e9, 1e-6), {})
    assert sum(c.comm_fwd_s > 0 for c in out.values()) == 4 and sum(c.comm_bwd_s > 0 for c in out.values()) == 4


def test_gpt2_packs_qkv_and_keeps_the_row_bias_whole(gpt2: tuple[nn.Module, object]) -> None:
    model, _ = gpt2
    found, _ = _found(model, torch.randint(0, 128, (2, 16)))
    assert found.problem is None and found.pairs == 2 * found.blocks
    sharded = set(found.sharded)
    assert "model.transformer.h.0.attn.c_attn.bias" in sharded and "model.transformer.h.0.mlp.c_fc.bias" in sharded
    assert "model.transformer.h.0.attn.c_proj.weight" in sharded
    assert "model.transformer.h.0.attn.c_proj.bias" not in sharded  # added after the all-reduce, whole
    assert not any("wte" in n or "ln_" in n or "lm_head" in n for n in sharded)
    assert model_heads(model) == (4, 4)  # from the wrapped model's config


class _Leaky(nn.Module):
    """A block whose only linear layer writes the residual stream: nothing closes its split."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def test_a_split_that_leaves_its_block_is_not_searched() -> None:
    t = trace(_Leaky(), (torch.randn(2, 16),))
    found = find_split(t.gm, {n.name: t.module_path(n) for n in t.gm.graph.nodes if n.op != "placeholder"})
    assert found.problem is not None and "outside its block" in found.problem
    assert tp_sizes(None, heads=(4, 4), found=found, node_size=8, devices=8) == (1,)
    with pytest.raises(PartitionOptionError, match="cannot split this model"):
        tp_sizes((1, 2), heads=None, found=found, node_size=8, devices=8)


# -- the sizes a model and a cluster take ------------------------------------------------------


def test_explicit_sizes_are_checked_with_the_reason() -> None:
    found = TensorSplit(sizes={"a": 96, "b": 384})
    with pytest.raises(PartitionOptionError, match="node size"):
        tp_sizes((16,), heads=(32, 32), found=found, node_size=8, devices=64)
    with pytest.raises(PartitionOptionError, match=r"heads \(12 attention, 4 key/value\)"):
        tp_sizes((8,), heads=(12, 4), found=found, node_size=8, devices=64)
    with pytest.raises(PartitionOptionError, match=r"\[96\]"):
        tp_sizes((64,), heads=None, found=found, node_size=0, devices=64)
    assert tp_sizes((2, 1, 2), heads=None, found=found, node_size=0, devices=4) == (1, 2)


@settings(max_examples=200, deadline=None)
@given(node=st.sampled_from([0, 1, 2, 4, 6, 8, 16]), heads=st.integers(1, 48), kv=st.integers(1, 48),
       size=st.integers(1, 512), devices=st.integers(1, 256))
def test_the_candidates_are_exactly_the_common_divisors(node: int, heads: int, kv: int, size: int,
                                                        devices: int) -> None:
    found = TensorSplit(sizes={"x": size})
    got = tp_sizes(None, heads=(heads, kv), found=found, node_size=node, devices=devices)
    want = tuple(t for t in range(1, node + 1) if all(n % t == 0 for n in (node, heads, kv, size, devices)))
    assert got == (want if node > 0 else (1,))
    for tp in got:  # a tp group never crosses a node: (d * pp + r) * tp + t, t < tp, in one node
        for first in range(0, devices, tp):
            assert node == 0 or first // node == (first + tp - 1) // node


@pytest.mark.parametrize(("n", "tp", "pp"), [(64, 8, 8), (64, 2, 16), (32, 4, 8), (16, 1, 16)])
def test_the_layouts_ranks_see_nodes_of_node_size_over_tp(n: int, tp: int, pp: int) -> None:
    full = Cluster.uniform(n, "A100-80GB")
    links = pipeline_links(tp_groups(full, tp), pp)
    node = full.devices[0].node_size
    for r in range(pp - 1):  # rank r's group starts at device r * tp: its hand-off crosses a node when r + 1's does
        crosses = (r * tp) // node != ((r + 1) * tp) // node
        assert (links.link_bandwidth[r] == full.devices[0].inter_node_bandwidth) == crosses
