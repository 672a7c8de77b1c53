"""Tests of partitioner.cost.costs: counted FLOPs, saved activations, parameters, roofline and profiling."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from gpt2_case import gpt2_config
from partitioner.cost.costs import NodeCost, cost_graph, node_time
from partitioner.cost.devices import DeviceSpec
from partitioner.errors import CostOptionError
from partitioner.tracing.trace import CausalLMLogits, TracedModel, trace

F32 = 4


def _mlp(widths: list[int], *, inplace: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU(inplace=inplace)]
    return nn.Sequential(*layers[:-1])


def _by_target(t: TracedModel, costs: dict[str, NodeCost], op: str) -> list[NodeCost]:
    return [costs[n.name] for n in t.gm.graph.nodes if n.op == "call_function" and op in str(n.target)]


# --- FLOPs ---------------------------------------------------------------------------------------


def test_mlp_chain_flops_forward_and_backward() -> None:
    widths, batch = [32, 64, 48, 16], 8
    t = trace(_mlp(widths), (torch.randn(batch, widths[0]),))
    costs = cost_graph(t)
    assert set(costs) == {"_0", "_1", "_2", "_3", "_4"}
    linears = [costs["_0"], costs["_2"], costs["_4"]]
    for c, (a, b) in zip(linears, itertools.pairwise(widths)):
        assert c.fwd_flops == 2 * batch * a * b
    # The graph input needs no grad, so the first Linear only computes its weight gradient.
    assert linears[0].bwd_flops == linears[0].fwd_flops
    assert [c.bwd_flops for c in linears[1:]] == [2 * c.fwd_flops for c in linears[1:]]
    assert costs["_1"].fwd_flops == 0 and costs["_1"].bwd_flops == 0  # ReLU: priced by bytes
    assert all(c.requires_grad for c in costs.values())


def test_input_that_needs_grad_doubles_the_first_backward() -> None:
    x = torch.randn(8, 32, requires_grad=True)
    costs = cost_graph(trace(_mlp([32, 64]), (x,)))
    assert costs["_0"].bwd_flops == 2 * costs["_0"].fwd_flops == 2 * 2 * 8 * 32 * 64


def test_conv_flops() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))
    costs = cost_graph(trace(model, (torch.randn(2, 3, 16, 16),)))
    first = 2 * 2 * 16 * 16 * 8 * 3 * 3 * 3  # 2 * B * H * W * C_out * C_in * k * k
    second = 2 * 2 * 16 * 16 * 4 * 8 * 3 * 3
    assert costs["_0"].fwd_flops == first and costs["_0"].bwd_flops == first
    assert costs["_2"].fwd_flops == second and costs["_2"].bwd_flops == 2 * second
    assert costs["_0"].param_count == 8 * 3 * 3 * 3 + 8


def test_gpt2_flops_are_exact(gpt2: tuple[nn.Module, TracedModel]) -> None:
    _, t = gpt2
    costs = cost_graph(t)
    b, s, e, v, layers, heads = 2, 16, 64, 128, 2, 4
    per_layer = 2 * b * s * (e * 3 * e + e * e + e * 4 * e + 4 * e * e)  # qkv, proj, fc, proj
    attention = 2 * 2 * b * heads * s * s * (e // heads)  # q @ k^T and p @ v
    lm_head = 2 * b * s * e * v
    assert sum(c.fwd_flops for c in costs.values()) == layers * (per_layer + attention) + lm_head
    attn = _by_target(t, costs, "scaled_dot_product_attention")
    assert len(attn) == layers and all(c.fwd_flops == attention for c in attn)
    assert all(c.bwd_flops == 5 * attention // 2 for c in attn)  # dq, dk, dv and the recompute


# --- parameters, bytes, grads --------------------------------------------------------------------


def test_tied_weights_share_one_name(gpt2: tuple[nn.Module, TracedModel]) -> None:
    _, t = gpt2
    costs = cost_graph(t)
    readers = [name for name, c in costs.items() if "model.lm_head.weight" in c.param_names]
    assert len(readers) == 2  # the token embedding and the LM head
    assert not any("model.transformer.wte.weight" in c.param_names for c in costs.values())
    assert t.param_aliases["model.lm_head.weight"][1:] == ("model.transformer.wte.weight",)
    emb = costs[readers[0]]
    assert emb.param_count == 128 * 64 and emb.param_bytes == 128 * 64 * F32


def test_integer_nodes_need_no_grad_and_views_move_no_bytes(gpt2: tuple[nn.Module, TracedModel]) -> None:
    _, t = gpt2
    costs = cost_graph(t)
    nodes = {n.name: n for n in t.gm.graph.nodes}
    ints = [k for k, n in nodes.items() if k in costs and str(getattr(n.meta.get("val"), "dtype", "")) == "torch.int64"]
    assert ints and all(not costs[k].requires_grad and node_time(costs[k], _DEV)[1] == 0 for k in ints)
    views = _by_target(t, costs, "aten.view") + _by_target(t, costs, "aten.transpose")
    assert views and all(c.io_bytes == 0 and c.saved_bytes == 0 and c.output_bytes > 0 for c in views)


def test_saved_bytes_are_counted_once_per_tensor() -> None:
    batch = 4
    costs = cost_graph(trace(_mlp([64, 32, 8]), (torch.randn(batch, 64),)))
    assert costs["_0"].saved_bytes == batch * 64 * F32  # its input, for the weight gradient
    assert costs["_1"].saved_bytes == batch * 32 * F32  # the ReLU output (for its mask)...
    assert costs["_2"].saved_bytes == 0  # ...which the next Linear saves too: not counted twice
    assert costs["_1"].output_bytes == batch * 32 * F32
    assert costs["_1"].io_bytes == 2 * batch * 32 * F32


def test_buffers_and_inplace_modules() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    costs = cost_graph(trace(model, (x,)))
    bn = costs["_1"]
    assert bn.param_names == ("1.weight", "1.bias")
    assert bn.buffer_bytes == 8 * F32 * 2 + 8  # running mean and var, num_batches_tracked (int64)
    assert costs["_2"].io_bytes > 0 and costs["_2"].requires_grad  # in-place ReLU still costs
    assert costs["_3"].fwd_flops == 2 * 4 * 8 * 2


def test_meta_model_is_costed_without_weights() -> None:
    with torch.device("meta"):
        model = _mlp([4096, 16384, 4096])  # 512 MiB if real
    t = trace(model, (torch.randn(2, 4096),))
    costs = cost_graph(t)
    assert costs["_0"].fwd_flops == 2 * 2 * 4096 * 16384
    assert costs["_0"].param_bytes == (4096 * 16384 + 16384) * F32
    assert costs["_2"].bwd_flops == 2 * costs["_2"].fwd_flops
    assert all(p.is_meta for p in model.parameters())


def test_gpt2_on_meta_costs_like_the_real_one(gpt2: tuple[nn.Module, TracedModel]) -> None:
    transformers = pytest.importorskip("transformers")
    _, real = gpt2
    with torch.device("meta"):
        model = CausalLMLogits(transformers.GPT2LMHeadModel(gpt2_config()))
    meta = cost_graph(trace(model, (torch.randint(0, 128, (2, 16)),)))
    want = cost_graph(real)
    assert sum(c.fwd_flops for c in meta.values()) == sum(c.fwd_flops for c in want.values())
    assert sum(c.bwd_flops for c in meta.values()) == sum(c.bwd_flops for c in want.values())


# --- time ----------------------------------------------------------------------------------------

_DEV = DeviceSpec("toy", peak_flops=1e12, peak_flops_fp32=1e11, mem_bandwidth=1e9, memory=1e9, op_overhead=1e-6)


def test_node_time_roofline() -> None:
    compute = NodeCost(fwd_flops=1e11, bwd_flops=2e11, io_bytes=1e6, dtype="torch.float32")
    assert node_time(compute, _DEV) == pytest.approx((1.0 + 1e-6, 2.0 + 1e-6))
    half = NodeCost(fwd_flops=1e11, bwd_flops=2e11, io_bytes=1e6, dtype="torch.bfloat16")
    assert node_time(half, _DEV) == pytest.approx((0.1 + 1e-6, 0.2 + 1e-6))
    memory = NodeCost(fwd_flops=0, bwd_flops=0, io_bytes=3e9)
    assert node_time(memory, _DEV) == pytest.approx((3.0 + 1e-6, 6.0 + 1e-6))  # bwd moves ~2x
    frozen = NodeCost(fwd_flops=1e11, bwd_flops=2e11, requires_grad=False)
    assert node_time(frozen, _DEV) == (pytest.approx(1.0 + 1e-6), 0.0)
    measured = NodeCost(fwd_flops=1e11, bwd_flops=2e11, measured_fwd_s=0.5, measured_bwd_s=0.25)
    assert node_time(measured, _DEV) == (0.5, 0.25)


def test_profile_measures_positive_times_on_cpu() -> None:
    t = trace(_mlp([64, 128, 32]), (torch.randn(16, 64),))
    costs = cost_graph(t, profile=True, device="cpu", warmup=1, repeat=3)
    for c in costs.values():
        assert c.measured_fwd_s is not None and c.measured_fwd_s > 0
        assert c.measured_bwd_s is not None and c.measured_bwd_s > 0
        assert node_time(c, _DEV) == (c.measured_fwd_s, c.measured_bwd_s)
    analytic = cost_graph(t)
    assert all(costs[k].fwd_flops == analytic[k].fwd_flops for k in costs)


def test_profile_runs_a_meta_trace_on_real_tensors() -> None:
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = CausalLMLogits(transformers.GPT2LMHeadModel(gpt2_config()))
    t = trace(model, (torch.randint(0, 128, (2, 16)),))  # device=meta constants in the graph
    costs = cost_graph(t, profile=True, device="cpu", warmup=0, repeat=1)
    measured = [c for c in costs.values() if c.measured_fwd_s is not None]
    assert len(measured) == len(costs)
    assert all(math.isfinite(c.measured_fwd_s or 0.0) for c in measured)


def test_bad_profile_arguments() -> None:
    t = trace(_mlp([4, 4]), (torch.randn(2, 4),))
    with pytest.raises(ValueError, match="repeat") as info:
        cost_graph(t, profile=True, repeat=0)
    assert isinstance(info.value, CostOptionError)
