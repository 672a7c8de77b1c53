"""The plan's cost model under mixed precision (partitioner.cost.precision): pure checks on small models."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from partitioner import Cluster, partition
from partitioner.cost.costs import cost_graph, node_time
from partitioner.cost.devices import DeviceSpec
from partitioner.cost.precision import low_precision_nodes, with_precision
from partitioner.errors import PartitionOptionError
from partitioner.plan.plan import Plan
from partitioner.tracing.trace import trace

WIDTHS = (64, 256, 128, 256, 32)


def _mlp() -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(WIDTHS):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers)


def _plans() -> tuple[Plan, Plan]:
    model, x = _mlp(), torch.randn(16, 64)
    kw = dict(cluster=Cluster.uniform(2, "H100-80GB"), microbatches=4, split_points=["4"])
    return partition(model, (x,), 2, **kw), partition(model, (x,), 2, precision="bf16", **kw)


def test_bf16_halves_activations_adds_weight_copies_keeps_state() -> None:
    f32, b16 = _plans()
    assert [st.nodes for st in f32.stages] == [st.nodes for st in b16.stages]  # the same cut
    for s, (a, b) in enumerate(zip(f32.stages, b16.stages)):
        # Linears after the first keep a bf16 copy of their parameters for backward, per micro-batch.
        copies = sum(2 * (i * o + o) for j, (i, o) in enumerate(itertools.pairwise(WIDTHS))
                     if j > 0 and f"_{2 * j}" in b.nodes)
        assert b.act_bytes == a.act_bytes / 2 + copies, s
        assert b.state_bytes == a.state_bytes and b.params == a.params  # fp32 master weights
        assert b.fwd_flops == a.fwd_flops
    assert b16.stages[0].send_bytes == f32.stages[0].send_bytes / 2 == 16 * 128 * 2  # (16, 128) in bf16
    # Memory holds those copies per micro-batch in flight: with micro-batches of 16 rows the
    # copies outweigh the halved activations, and the model says so.
    assert all(b.memory == b.state_bytes + b.inflight * b.act_bytes for b in b16.stages)
    assert b16.stages[0].memory > f32.stages[0].memory


def test_bf16_matmuls_run_at_the_16_bit_peak() -> None:
    t = trace(nn.Linear(4096, 4096), (torch.randn(2048, 4096),))
    f32 = cost_graph(t)
    b16 = with_precision(t.gm, f32, "bf16")
    dev = DeviceSpec.preset("H100-80GB")
    (name,) = f32  # one node: the linear layer
    f, _ = node_time(f32[name], dev)
    g, _ = node_time(b16[name], dev)
    assert g < f / 10  # 989 vs 67 TFLOP/s, compute-bound
    _, b16plan = _plans()
    f32plan, _ = _plans()
    assert b16plan.stages[0].fwd_time < f32plan.stages[0].fwd_time


def test_autocast_fp32_ops_and_residual_sums_stay_fp32() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.fc(x))   # low: a matmul, then an op on a low input
            r = x + h                    # fp32: promoted with the fp32 input
            return self.norm(r) * 2      # fp32 norm, and its user then fp32 too

    t = trace(Block(), (torch.randn(2, 8),))
    costs = cost_graph(t)
    low = low_precision_nodes(t.gm, costs)
    names = {n.name: n for n in t.gm.graph.nodes}
    kinds = {name: str(getattr(names[name].target, "__name__", names[name].target)) for name in costs}
    assert {kinds[n] for n in low} == {"fc", "relu"}, kinds
    b16 = with_precision(t.gm, costs, "bf16")
    for name, c in costs.items():
        assert b16[name].output_bytes == c.output_bytes // 2  # every floating value crosses in bf16
        assert (b16[name].dtype == "torch.bfloat16") == (name in low)


def test_plan_records_prints_and_saves_the_precision(tmp_path: object) -> None:
    f32, b16 = _plans()
    assert (f32.precision, b16.precision) == ("fp32", "bf16")
    assert "precision bf16" in str(b16) and "precision fp32" in str(f32)
    assert "precision" not in f32.to_dict()  # fp32 plans are written as before
    path = f"{tmp_path}/plan.json"
    b16.save(path)
    assert Plan.load(path).precision == "bf16"
    f32.save(path)  # written as before mixed precision existed (no key): loads as fp32
    assert "precision" not in json.loads(Path(path).read_text()) and Plan.load(path).precision == "fp32"


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown precision 'fp8'; choose one of fp32, bf16, fp16") as info:
        partition(_mlp(), (torch.randn(2, 64),), 2, precision="fp8")
    assert isinstance(info.value, PartitionOptionError)


def test_trainer_defaults_to_the_plans_precision() -> None:
    from runtime import PipelineTrainer

    _, b16 = _plans()
    trainer = PipelineTrainer(b16, nn.functional.mse_loss, transport="sequential")
    assert trainer.precision.name == "bf16" and trainer.scaler is None
    fp32 = PipelineTrainer(b16, nn.functional.mse_loss, transport="sequential", precision="fp32")
    assert fp32.precision.name == "fp32"
