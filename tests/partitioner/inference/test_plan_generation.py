"""``partition(..., costing=Costing(inference=Inference(...)))``: a plan for generation, end to end.

What each stage holds is checked against the generator running the plan (its caches' bytes), the
cut against the KV cache's memory, and the refusals against what they name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from partitioner import Cluster, Costing, Cut, DeviceSpec, InfeasibleMemoryError, Inference, Plan, partition
from partitioner.errors import PartitionOptionError
from partitioner.inference.kv import kv_cache_bytes, kv_layers

transformers = pytest.importorskip("transformers")

PROMPT = 8


def _llama(layers: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def _plan(model: torch.nn.Module, p: int, inference: Inference, cluster: Cluster | None = None, **cut: object) -> Plan:
    return partition(model, (torch.zeros(1, PROMPT, dtype=torch.long),), p, cluster=cluster,
                     cut=Cut(**cut), costing=Costing(inference=inference))  # type: ignore[arg-type]


def _layers_of(plan: Plan) -> list[int]:
    return [len(_modules(st.nodes, plan)) for st in plan.stages]


def _modules(nodes: tuple[str, ...], plan: Plan) -> set[str]:
    path = plan.traced.module_path
    by_name = {n.name: n for n in plan.traced.gm.graph.nodes}
    return {".".join(path(by_name[v]).split(".")[:3]) for v in nodes if path(by_name[v]).startswith("model.layers.")}


def test_each_stage_holds_its_layers_cache_and_the_generator_fills_exactly_that() -> None:
    from runtime.generate import Generator

    model = _llama()
    batch, new = 3, 5
    plan = _plan(model, 2, Inference(batch=batch, max_len=PROMPT + new))
    assert plan.schedule == "forward" and plan.inference is not None
    assert plan.inference.batch == batch and plan.inference.prompt_len == PROMPT and plan.inference.dtype == "fp32"
    layers = kv_layers(model.config)
    held = _layers_of(plan)
    assert sum(held) == 4 and all(held)
    for st, n in zip(plan.stages, held):  # each stage's cache at the maximum length: its layers' only
        assert st.kv_bytes == kv_cache_bytes(layers[:n], batch=batch, length=PROMPT + new, dtype_bytes=4)
        assert st.memory == st.state_bytes + st.kv_bytes + st.work_bytes
        assert st.work_bytes > 0 and st.bwd_time == 0
    gen = Generator(plan)
    gen.generate([[1] * PROMPT] * batch, max_new_tokens=new, eos_token_id=[])
    # The last new token is not fed back: the caches hold PROMPT + new - 1 positions.
    for stage, n in zip(gen.stages, held):
        assert stage.cached_bytes() == kv_cache_bytes(layers[:n], batch=batch, length=PROMPT + new - 1, dtype_bytes=4)


def test_weights_are_counted_at_the_inference_dtype_without_training_state() -> None:
    model = _llama()
    fp32 = _plan(model, 2, Inference(batch=2, max_len=16))
    bf16 = _plan(model, 2, Inference(batch=2, max_len=16, dtype="bf16"))
    params = sum(t.numel() for t in model.parameters())
    assert sum(st.state_bytes for st in fp32.stages) == pytest.approx(4 * params, rel=0.01)  # + rotary buffers
    for a, b in zip(fp32.stages, bf16.stages):
        assert b.kv_bytes * 2 == a.kv_bytes and b.state_bytes < 0.6 * a.state_bytes
    assert fp32.state_bytes_per_param == 4.0 and bf16.inference is not None and bf16.inference.dtype == "bf16"


def test_the_cut_moves_when_the_kv_cache_makes_a_stage_too_big() -> None:
    model = _llama()
    inference = Inference(batch=64, max_len=256)
    free = _plan(model, 2, inference)
    assert _layers_of(free) == [2, 2]
    st0 = free.stages[0]
    per_layer = st0.kv_bytes / 2
    # Device 0 holds its weights, its working memory and one layer's cache, not two.
    small = DeviceSpec("small", peak_flops=1e12, peak_flops_fp32=1e12, mem_bandwidth=1e10,
                       memory=st0.state_bytes + st0.work_bytes + 1.5 * per_layer)
    big = dataclasses.replace(small, name="big", memory=1e12)
    moved = _plan(model, 2, inference, Cluster((small, big)))
    assert _layers_of(moved) == [1, 3]
    assert all(st.memory <= st.capacity for st in moved.stages)
    assert moved.stages[0].kv_bytes == pytest.approx(per_layer)


def test_fits_is_the_largest_batch_every_stage_holds_and_more_is_refused_with_it() -> None:
    model = _llama()
    probe = _plan(model, 2, Inference(batch=8, max_len=256))
    per_seq = max(st.kv_bytes + st.work_bytes for st in probe.stages) / 8
    dev = DeviceSpec("box", peak_flops=1e12, peak_flops_fp32=1e12, mem_bandwidth=1e10,
                     memory=max(st.state_bytes for st in probe.stages) + 20.5 * per_seq)
    cluster = Cluster((dev, dev))
    fits = _plan(model, 2, Inference(batch=8, max_len=256), cluster).inference
    assert fits is not None and 18 <= fits.fits <= 20
    _plan(model, 2, Inference(batch=fits.fits, max_len=256), cluster)  # the count it says fits, fits
    with pytest.raises(InfeasibleMemoryError, match=rf"at most {fits.fits} sequences of 256 positions fit 2 stages"):
        _plan(model, 2, Inference(batch=fits.fits + 1, max_len=256), cluster)


def test_the_plan_round_trips_through_its_file(tmp_path: Path) -> None:
    plan = _plan(_llama(), 2, Inference(batch=4, max_len=32))
    plan.save(tmp_path / "p.json")
    back = Plan.load(tmp_path / "p.json")
    assert back.inference == plan.inference and back.stages == plan.stages
    assert "fits" in str(back) and "KV cache" in str(back)


def test_the_decode_step_grows_with_the_cached_positions() -> None:
    model = _llama()
    short = _plan(model, 2, Inference(batch=32, max_len=64))
    long = _plan(model, 2, Inference(batch=32, max_len=4096))
    assert long.bottleneck > short.bottleneck
    assert long.inference is not None and short.inference is not None
    assert long.inference.tokens_per_s < short.inference.tokens_per_s


def test_refusals_name_what_to_change() -> None:
    model = _llama()
    with pytest.raises(PartitionOptionError, match="no training schedule"):
        _plan(model, 2, Inference(batch=2, max_len=16), microbatches="auto")
    with pytest.raises(PartitionOptionError, match="Hugging Face"):
        partition(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), (torch.randn(1, 4),), 2,
                  costing=Costing(inference=Inference(batch=2, max_len=16)))
    with pytest.raises(PartitionOptionError, match="positive int"):
        Inference(batch=0, max_len=16)
    with pytest.raises(PartitionOptionError, match="dtype"):
        Inference(batch=1, max_len=16, dtype="int8")
    with pytest.raises(PartitionOptionError, match="Inference"):
        Costing(inference=(2, 16))  # type: ignore[arg-type]


def test_the_layout_search_refuses_inference_costing() -> None:
    from partitioner import plan_layout

    with pytest.raises(PartitionOptionError, match="layout search prices training"):
        plan_layout(_llama(), (torch.zeros(1, PROMPT, dtype=torch.long),), cluster=Cluster.uniform(2, "cpu"),
                    global_batch=4, costing=Costing(inference=Inference(batch=2, max_len=16)))
