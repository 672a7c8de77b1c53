"""Hugging Face models traced as they are (``partitioner.tracing.hf``): no wrapper, the cache off for
the trace only, the model's own names and ModelOutput, blocks kept whole, and errors that name the
fix that applies to such a model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from partitioner import partition, trace
from partitioner.errors import TraceError
from partitioner.tracing import hf

transformers = pytest.importorskip("transformers")


def _llama(**kw: object) -> nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32, **kw)
    return transformers.LlamaForCausalLM(cfg).train()


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    return _llama()


def _ids(rows: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, 64, (rows, seq))


def test_a_hugging_face_model_is_recognised_without_importing_transformers_for_others(llama: nn.Module) -> None:
    assert hf.is_hf_model(llama)
    assert not hf.is_hf_model(nn.Linear(2, 2))
    from partitioner.tracing.trace import CausalLMLogits

    assert not hf.is_hf_model(CausalLMLogits(llama))  # the wrapper is a plain module: traced as before


def test_raw_causal_lm_traces_with_its_own_names_and_output(llama: nn.Module) -> None:
    config_before = llama.config.to_dict()
    t = trace(llama, (_ids(),))
    assert t.method == "export"  # straight to export: transformers v5 has no fx tracer
    assert t.input_names == ("input_ids",)
    assert t.out_spec.type is transformers.modeling_outputs.CausalLMOutputWithPast
    assert t.out_spec.context == ["logits"]  # no cache among the outputs
    used = {str(n.target) for n in t.gm.graph.nodes if n.op == "get_attr"}
    params = dict(llama.named_parameters())
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= used
    assert all(t.gm.get_parameter(name) is params[name] for name in used if name in params)  # the model's own tensors
    assert llama.config.to_dict() == config_before  # use_cache and return_dict were not written
    assert llama.config.use_cache is True


def test_keyword_inputs_follow_the_positional_ones_by_name(llama: nn.Module) -> None:
    mask = torch.ones(2, 8, dtype=torch.long)
    t = trace(llama, (_ids(),), example_kwargs={"attention_mask": mask, "labels": _ids()})
    assert t.input_names == ("input_ids", "attention_mask", "labels")
    assert t.out_spec.context == ["loss", "logits"]
    # Batch and sequence stay free, keyword inputs included (export binds them by name).
    assert [i.dynamic for i in t.example_inputs] == [(0, 1)] * 3


def test_keyword_inputs_out_of_signature_order_keep_their_free_sizes() -> None:
    with torch.device("meta"):
        t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=4))
    ids = torch.randint(0, 32, (2, 8))
    kw = {"decoder_input_ids": torch.randint(0, 32, (2, 5)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    t = trace(t5.train(), (ids,), example_kwargs=kw)
    assert [(i.name, i.shape) for i in t.example_inputs] == [
        ("input_ids", (2, 8)), ("decoder_input_ids", (2, 5)), ("attention_mask", (2, 8))]
    assert all(i.dynamic == (0, 1) for i in t.example_inputs)


def test_blocks_are_the_no_split_modules_outermost() -> None:
    with torch.device("meta"):
        t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=1, num_heads=4))
        bert = transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=32, hidden_size=16, num_hidden_layers=3, num_attention_heads=4, intermediate_size=32))
    assert hf.blocks(t5) == ["encoder.block.0", "encoder.block.1", "decoder.block.0"]
    assert hf.block_depth(t5) == 3
    # BERT lists its embeddings as a block too (depth 2); its three layers win (depth 4).
    assert hf.blocks(bert)[0] == "bert.embeddings"
    assert hf.block_depth(bert) == 4
    assert hf.block_depth(nn.Sequential(nn.Linear(2, 2))) is None
    # BioGPT lists no _no_split_modules: its blocks are its one list of num_hidden_layers layers.
    with torch.device("meta"):
        biogpt = transformers.BioGptForCausalLM(transformers.BioGptConfig(
            vocab_size=32, hidden_size=16, num_hidden_layers=3, num_attention_heads=4, intermediate_size=32))
    assert not biogpt._no_split_modules and hf.blocks(biogpt) == [f"biogpt.layers.{i}" for i in range(3)]


def test_partition_keeps_blocks_whole_by_default_and_obeys_an_explicit_granularity(llama: nn.Module) -> None:
    plan = partition(llama, (_ids(),), 3, microbatches=2)
    assert plan.granularity == "module"
    stage_of = plan.stage_of()
    for block in hf.blocks(llama):
        stages = {stage_of[n.name] for n in plan.traced.gm.graph.nodes
                  if n.name in stage_of and (plan.traced.module_path(n) + ".").startswith(block + ".")}
        assert len(stages) == 1, f"{block} is cut across stages {stages}"
    assert partition(llama, (_ids(),), 2, microbatches=2, granularity="node").granularity == "node"


def test_a_model_that_returns_its_cache_is_told_to_turn_the_cache_off(llama: nn.Module) -> None:
    with pytest.raises(TraceError) as err:
        trace(llama, (_ids(),), example_kwargs={"use_cache": True})
    text = str(err.value)
    assert "key/value cache (DynamicCache)" in text and "use_cache=True" in text
    assert "leaf" not in text.split("To fix:")[1]  # not the generic advice, which export ignores


def test_fx_asked_for_a_hugging_face_model_is_told_to_use_export(llama: nn.Module) -> None:
    with pytest.raises(TraceError, match=r"has no torch\.fx tracer\); use method='auto' or method='export'"):
        trace(llama, (_ids(),), method="fx")


class _BranchyConfig(transformers.PretrainedConfig):
    model_type = "pipecut-branchy"


class _Branchy(transformers.PreTrainedModel):
    """A Hugging Face model whose forward branches on a tensor's value: no graph holds it."""

    config_class = _BranchyConfig

    def __init__(self, config: _BranchyConfig) -> None:
        super().__init__(config)
        self.lin = nn.Linear(4, 4)
        self.post_init()

    def forward(self, x: torch.Tensor, **kwargs: object) -> torch.Tensor:
        h = self.lin(x)
        if h.sum() > 0:
            h = h * 2
        return h  # type: ignore[no-any-return]


def test_an_unexportable_hugging_face_model_gets_the_export_advice() -> None:
    with pytest.raises(TraceError) as err:
        trace(_Branchy(_BranchyConfig()), (torch.randn(2, 4),))
    fix = str(err.value).split("To fix:")[1]
    assert "_Branchy is a Hugging Face model, traced with torch.export" in fix
    assert "torch.export.export(model, args" in fix and "leaf_modules=[" not in fix
    assert "test_hf.py" in str(err.value)  # the user's line that branches is named


def test_the_wrapper_still_traces_and_prefixes_names(llama: nn.Module) -> None:
    from partitioner.tracing.trace import CausalLMLogits

    wrapped = CausalLMLogits(copy.deepcopy(llama))
    t = trace(wrapped, (_ids(),))
    assert t.out_spec.type is None  # one tensor
    assert "model.model.embed_tokens.weight" in {str(n.target) for n in t.gm.graph.nodes if n.op == "get_attr"}
