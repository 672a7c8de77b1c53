"""The family sweep: every decoder-only causal-LM family transformers ships is exact or refused, never different.

``tests/tiny_configs.py`` makes each entry of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` tiny from its
config's own names; ``tests/family_sweep.py`` checks a family's training (2 stages, loss and every
gradient) and generation (greedy tokens and logits against ``model.generate``). The default
profile runs a sample whose mechanisms no other default test runs:
Granite's embedding, residual and attention multipliers with its logit division, Cohere's logit
scale, Qwen3's per-head q/k norms, positions a forward makes itself, an embedding block's norm and
a layer argument that is None (soft-caps, sliding windows, packed qkv, MoE and tied heads are in
``tests/runtime/generate/test_generator.py`` and ``tests/test_families.py``; layers keeping a
state in ``tests/runtime/generate/test_state_layers.py``), and 2 pp x 2 tp
of the plans no other test runs (:data:`TP_SAMPLE`). The long profile sweeps every family on every
axis; ``python benchmarks/families.py`` writes the table (``docs/families.md``).
"""

from __future__ import annotations

import pytest
import torch

from family_sweep import check_generate, check_tp, check_train
from profiles import LONG
from tiny_configs import HIDDEN, LAYERS, _layer_list, sweep_entries, tiny_config

transformers = pytest.importorskip("transformers")

# CTRL's sinusoid positions (made in its forward from an arange), ModernBERT-decoder's embedding
# block (its norm is glue), Falcon's layers (an ALiBi argument, None without ALiBi).
SAMPLE = ("granite", "cohere", "qwen3", "ctrl", "modernbert-decoder", "falcon")
# 2 pp x 2 tp by default: Qwen3's per-head norms (whole weights read by split heads: their gradients
# all-reduced), Phi-3's colwise_gather_output / rowwise_split_input, Cohere's interleaved rotary
# (stack and flatten on split heads), OPT on pipecut's derived plan (its config has none); Llama,
# GPT-2 and Mixtral run in tests/runtime/parallel.
TP_SAMPLE = ("qwen3", "phi3", "cohere", "opt")


def test_a_tiny_config_is_made_from_the_configs_own_names() -> None:
    gpt2 = tiny_config("gpt2")  # GPT-2 spells them n_embd, n_layer, n_head: reached through attribute_map
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head, gpt2.resid_pdrop) == (HIDDEN, LAYERS, 4, 0.0)
    mixtral = tiny_config("mixtral")
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok, mixtral.num_key_value_heads) == (4, 2, 2)
    granite = tiny_config("granite")  # a multiplier left neutral would hide a path that skips it
    assert granite.embedding_multiplier == 1.5 and granite.logits_scaling == 1.5
    # Every kind of layer the full model has is kept: Qwen3-Next's one full-attention layer in four.
    assert set(tiny_config("qwen3_next").layer_types) == {"linear_attention", "full_attention"}


def test_a_per_layer_list_keeps_one_layer_of_each_kind() -> None:
    assert _layer_list(["s"] * 5 + ["f"], 4) == ["s", "s", "s", "f"]
    assert _layer_list(["a", "b", "c", "a"], 2) == ["a", "c"]  # as many kinds as fit, the first kept
    assert _layer_list(["x"] * 8, 4) == ["x"] * 4


def test_entries_that_are_not_decoder_only_families_say_why() -> None:
    entries = {e.model_type: e for e in sweep_entries(["bert", "bart", "gemma3", "llama"])}
    assert entries["bert"].config is None and "an encoder family" in entries["bert"].reason
    assert entries["bart"].config is None and "encoder-decoder" in entries["bart"].reason
    assert entries["gemma3"].config is None and "composite" in entries["gemma3"].reason
    assert entries["llama"].config is not None and entries["llama"].reason == ""


def _swept() -> list[str]:
    if not LONG:
        return list(SAMPLE)
    return [e.model_type for e in sweep_entries() if e.config is not None]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", _swept() if LONG else SAMPLE)
def test_a_family_trains_and_generates_exactly_or_is_refused(model_type: str) -> None:
    (entry,) = sweep_entries([model_type])
    train = check_train(entry)
    generate = check_generate(entry, (2, 4) if LONG else (2,))
    for axis, result in (("train", train), ("generate", generate)):
        assert result.status not in ("differs", "error"), (axis, result)
    if model_type in SAMPLE:  # the sample's families are exact on both axes
        assert (train.status, generate.status) == ("exact", "exact"), (train, generate)
    assert torch.is_grad_enabled()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", _swept() if LONG else TP_SAMPLE)
def test_a_family_splits_over_tp_exactly_or_is_refused(model_type: str) -> None:
    from rank_pool import spawn

    (entry,) = sweep_entries([model_type])
    result = check_tp(entry, spawner=spawn)
    assert result.status not in ("differs", "error"), result
    if model_type in TP_SAMPLE:
        assert result.status == "exact", result
