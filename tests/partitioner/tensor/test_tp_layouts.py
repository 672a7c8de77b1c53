"""The layout search with tensor parallelism: the space, a plan that needs tp to fit, a plan where tp
does not pay, cuts that keep each column/row pair on one stage, the table and the plan file."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from partitioner import Capture, Cluster, Costing, LayoutSpace, Plan
from partitioner.cost.devices import DeviceSpec
from partitioner.errors import PartitionOptionError
from partitioner.plan.layout import Option, layout_space
from partitioner.search import LayoutSearch
from tiny_modules import ResidualMLP


def test_the_space_spends_dp_x_pp_x_tp_devices() -> None:
    options = layout_space(16, 32, schedules=("1f1b",), zero=("none", "zero1", "fsdp"), tp_sizes=(1, 2, 4, 3))
    assert {o.tp for o in options} == {1, 2, 4}  # 3 does not divide 16
    assert all(o.dp * o.pp * o.tp == 16 == o.devices for o in options)
    assert not [o for o in options if o.zero == "fsdp" and o.tp > 1]  # FSDP2 x tp is not run yet
    assert {(o.dp, o.pp) for o in options if o.tp == 4} == {(1, 4), (2, 2), (4, 1)}
    assert Option(2, 2, "1f1b", 1, "none", 8, 4).label() == "dp2 x pp2 x tp4 1f1b b1 m4"


def _llama(intermediate: int) -> tuple[nn.Module, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=intermediate, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=1, vocab_size=64)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    return model, torch.randint(0, 64, (1, 16), device="meta")


@pytest.fixture(scope="module")
def big_block() -> tuple[nn.Module, torch.Tensor]:
    """One Llama block of about 200k parameters (3.3 MB of fp32 Adam state): more than a 2.5 MiB device."""
    return _llama(1024)


def _a100(memory: float) -> DeviceSpec:
    return replace(DeviceSpec.preset("A100-80GB"), memory=memory, memory_reserve=0)


def test_tp_is_chosen_when_memory_forces_it(big_block: tuple[nn.Module, torch.Tensor]) -> None:
    model, x = big_block
    found = LayoutSearch(model, (x,), cluster=Cluster.uniform(2, _a100(2.5 * 2**20)), global_batch=4)
    assert {o.tp for o in found.space()} == {1, 2}  # node of 8, 4 heads, 2 kv heads, 2 devices
    plan = found.run(LayoutSpace(top=3))
    lay = plan.layout
    assert lay is not None and lay.tp == 2 and lay.dp * lay.pp == 1
    # The block cannot be cut (a Hugging Face block stays whole): no layout without tp fits.
    assert all(not r.fits for r in plan.layouts if r.tp == 1)
    assert lay.allreduce_time > 0 and lay.memory <= lay.capacity
    # Each rank holds half of every sharded weight: its stage's parameters are the model's less half of them.
    whole = sum(p.numel() for p in model.parameters())
    sharded = sum(p.numel() for n, p in model.named_parameters() if "proj" in n)
    assert sum(st.params for st in plan.stages) == whole - sharded // 2
    assert "x 2-way tensor parallel" in str(plan) and "tp all-reduces" in str(plan)


def test_tp_is_left_out_when_it_does_not_pay(big_block: tuple[nn.Module, torch.Tensor]) -> None:
    model, x = big_block
    found = LayoutSearch(model, (x,), cluster=Cluster.uniform(2, "A100-80GB"), global_batch=4)
    plan = found.run(LayoutSpace(top=50, prune=False))
    assert plan.layout is not None and plan.layout.tp == 1
    lost = [r for r in plan.layouts if r.tp == 2 and r.fits]
    assert lost and all(r.step_time > plan.layout.step_time for r in lost)
    # Same stages and micro-batches, the tp layout computes less per rank but waits for its all-reduces.
    one, two = found.price(Option(1, 1, "1f1b", 1, "none", 4)), found.price(Option(1, 1, "1f1b", 1, "none", 4, 2))
    assert two.allreduce_time > 0 == one.allreduce_time and two.memory < one.memory


def test_no_cut_falls_between_a_column_layer_and_its_row_layer() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, vocab_size=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    x = torch.randint(0, 64, (1, 8))
    found = LayoutSearch(model, (x,), cluster=Cluster.uniform(16, "A100-80GB"), global_batch=8,
                         capture=Capture(granularity="node"))  # a cut may fall anywhere but inside a pair
    split = found._split
    for pp in (2, 4, 8):
        plan = found.plan(Option(1, pp, "1f1b", 1, "none", 8, 2))
        stage_of = {v: s for s, st in enumerate(plan.stages) for v in st.nodes}
        assert len(set(stage_of.values())) == pp
        graph = found._pricer.ctx.g
        for v in split.split:  # every split value is read on its own stage
            assert all(stage_of[u] == stage_of[v] for u in graph.successors(v)), (pp, v)


def test_a_tp_layout_survives_the_plan_file(big_block: tuple[nn.Module, torch.Tensor], tmp_path: Path) -> None:
    model, x = big_block
    plan = LayoutSearch(model, (x,), cluster=Cluster.uniform(2, _a100(2.5 * 2**20)), global_batch=4).run()
    assert plan.layout is not None
    plan.save(tmp_path / "plan.json")
    back = Plan.load(tmp_path / "plan.json")
    assert back.layout == plan.layout and back.layout is not None and back.layout.tp == 2
    assert [r.tp for r in back.layouts] == [r.tp for r in plan.layouts]


def test_a_model_without_a_config_searches_tp_only_when_told() -> None:
    model = nn.Sequential(*[ResidualMLP(32, 128) for _ in range(4)])
    found = LayoutSearch(model, (torch.randn(1, 32),), cluster=Cluster.uniform(8, "A100-80GB"), global_batch=8,
                         costing=Costing(precision="bf16"))
    assert {o.tp for o in found.space()} == {1}  # no heads known
    assert {o.tp for o in found.space(LayoutSpace(tp_sizes=(1, 2, 4)))} == {1, 2, 4}
    with pytest.raises(PartitionOptionError, match="node size"):
        found.space(LayoutSpace(tp_sizes=(16,)))
    lay = found.price(Option(1, 2, "1f1b", 1, "none", 8, 4))
    assert lay.tp == 4 and lay.devices == 8 and lay.allreduce_time > 0


def test_the_command_line_searches_tp_and_shows_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from pipecut.cli import main

    js = tmp_path / "plan.json"
    assert main(["plan", "gpt2-tiny", "--devices", "4", "--global-batch", "8", "--device", "A100-80GB",
                 "--tp", "1,2", "--json", str(js)]) == 0
    header = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("#"))
    assert header.split()[:3] == ["#", "layout", "tp"]
    assert {r.tp for r in Plan.load(js).layouts} == {1, 2}
    assert main(["plan", "gpt2-tiny", "--devices", "4", "--global-batch", "8", "--tp", "1,x"]) == 2
    assert "--tp" in capsys.readouterr().err
