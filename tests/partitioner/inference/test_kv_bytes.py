"""The key/value cache formula (``partitioner.inference.kv``) against transformers' own caches, filled.

Each family's small config runs a prompt and decode steps through the model with a ``DynamicCache``;
the formula's bytes at the positions reached must equal the bytes of the tensors the cache holds,
layer by layer (sliding layers keep ``window - 1`` positions, Gemma 2 alternates kinds).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from partitioner.errors import PartitionOptionError
from partitioner.inference.kv import FULL, NONE, SLIDING, KVLayer, kv_cache_bytes, kv_layers

transformers = pytest.importorskip("transformers")

B, PROMPT, STEPS = 3, 7, 5  # the cache reaches PROMPT + STEPS positions


def _configs() -> dict[str, Any]:
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48)
    return {
        "llama": transformers.LlamaConfig(**common, num_key_value_heads=2),
        "mistral-window": transformers.MistralConfig(**common, num_key_value_heads=2, sliding_window=4),
        "gemma2": transformers.Gemma2Config(**common, num_key_value_heads=1, head_dim=16, sliding_window=5),
        "gpt2": transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4),
        "qwen2-moe": transformers.Qwen2MoeConfig(
            **common, num_key_value_heads=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            num_experts=4, num_experts_per_tok=2,
        ),
        "qwen2-mixed": transformers.Qwen2Config(**common, num_key_value_heads=2, use_sliding_window=True,
                                                sliding_window=3, max_window_layers=1),
    }


def _filled(config: Any, dtype: torch.dtype) -> Any:
    """The model's DynamicCache after a prompt of PROMPT positions and STEPS decode steps of B sequences."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    ids = torch.randint(0, 64, (B, PROMPT))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = out.past_key_values
        for _ in range(STEPS):
            out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
            cache = out.past_key_values
    return cache


def _held(layer: Any) -> int:
    return sum(t.numel() * t.element_size() for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
               if t is not None)


@pytest.mark.parametrize("family", ["llama", "mistral-window", "gemma2", "gpt2", "qwen2-moe", "qwen2-mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_formula_is_the_bytes_a_filled_cache_holds(family: str, dtype: torch.dtype) -> None:
    config = _configs()[family]
    cache = _filled(config, dtype)
    layers = kv_layers(config)
    assert len(layers) == len(cache.layers) == 3
    length = PROMPT + STEPS
    size = torch.empty((), dtype=dtype).element_size()
    per_layer = [kv_cache_bytes([layer], batch=B, length=length, dtype_bytes=size) for layer in layers]
    assert per_layer == [_held(layer) for layer in cache.layers]
    assert kv_cache_bytes(layers, batch=B, length=length, dtype_bytes=size) == sum(map(_held, cache.layers))


def test_the_families_kinds_are_read_as_the_cache_reads_them() -> None:
    configs = _configs()
    assert {layer.kind for layer in kv_layers(configs["llama"])} == {FULL}
    assert [layer.window for layer in kv_layers(configs["mistral-window"])] == [4, 4, 4]
    gemma = kv_layers(configs["gemma2"])
    assert [layer.kind for layer in gemma] == [SLIDING, FULL, SLIDING]
    assert gemma[0].head_dim == 16 and gemma[0].kv_heads == 1
    assert [layer.kind for layer in kv_layers(configs["qwen2-mixed"])] == [FULL, SLIDING, SLIDING]
    assert kv_layers(configs["gpt2"])[0] == KVLayer(FULL, 4, 4, 8)


def test_a_sliding_layer_shorter_than_its_window_holds_every_position() -> None:
    layer = KVLayer(SLIDING, 4, 2, 8, window=100)
    assert layer.positions(10) == 10 and layer.positions(1000) == 99
    assert KVLayer(NONE, 4, 2, 8).positions(10) == 0


def test_a_config_without_heads_or_with_an_unknown_layer_kind_is_refused() -> None:
    from types import SimpleNamespace

    with pytest.raises(PartitionOptionError, match="num_attention_heads"):
        kv_layers(SimpleNamespace(num_hidden_layers=2))
    odd = SimpleNamespace(num_hidden_layers=2, num_attention_heads=2, hidden_size=8, layer_types=["conv", "conv"])
    with pytest.raises(PartitionOptionError, match="'conv'"):
        kv_layers(odd)
