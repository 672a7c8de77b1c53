"""Tiny decoder-only LMs of the families the generator is checked on, 4 layers each, built from configs.

Every dropout is zeroed (``families.zero_dropout``) and the model is in eval mode, so ``model.generate``
and the generator run the same arithmetic. ``transformers`` is imported only when a model is built.
:func:`planned` traces each family once per stage count per process (the test process, and each
rank of the pool, which runs many cases).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from families import zero_dropout

if TYPE_CHECKING:
    from partitioner import Plan

__all__ = ["CASES", "VOCAB", "PROMPTS", "EXAMPLE", "build", "planned"]

VOCAB = 96
# Ragged prompts, longer than the sliding windows below (4), of tokens above the special ids.
PROMPTS = [[5, 17, 33, 8, 91, 40, 12], [60, 3, 77], [9, 9, 21, 54, 30]]
EXAMPLE = (torch.zeros(1, 8, dtype=torch.long),)  # what the plans are traced with
_LM = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=64, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
           eos_token_id=2)

CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _LM),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _LM),
    # Full layers 0-1 then sliding layers 2-3: on 2 stages, each stage holds one kind only.
    "qwen2_mixed": ("Qwen2Config", "Qwen2ForCausalLM", dict(_LM, use_sliding_window=True, sliding_window=4,
                                                           max_window_layers=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_LM, sliding_window=4)),
    # Sliding and full layers alternate; logits and attention scores soft-capped.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_LM, query_pre_attn_scalar=8, sliding_window=4)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=64,
                                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", _LM),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_LM, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        _LM, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
}


def build(name: str, seed: int = 0) -> nn.Module:
    """Family ``name``'s tiny model, in eval mode, the same weights for the same seed."""
    import transformers

    config_class, model_class, kwargs = CASES[name]
    cfg = zero_dropout(getattr(transformers, config_class)(**kwargs))
    torch.manual_seed(seed)
    return getattr(transformers, model_class)(cfg).eval()  # type: ignore[no-any-return]


_PLANNED: dict[tuple[str, int], tuple[nn.Module, Plan]] = {}


def planned(name: str, p: int) -> tuple[nn.Module, Plan]:
    """Family ``name``'s model (seed 0) and its plan on ``p`` stages, traced once per process:
    tracing (torch.export) is most of a generation test's time, and a generator leaves the plan
    and the model as they were. A test that hooks the plan's modules partitions its own."""
    from partitioner import partition

    if (name, p) not in _PLANNED:
        model = next((m for (n, _), (m, _) in _PLANNED.items() if n == name), None) or build(name)
        _PLANNED[name, p] = (model, partition(model, EXAMPLE, p))
    return _PLANNED[name, p]
