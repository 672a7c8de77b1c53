"""Layers that keep a state, not keys and values: the generator keeps it in transformers' cache and stays exact.

A state-space model without attention (Mamba) and a hybrid of convolution and attention layers
(LFM3, whose rotary serves its attention layers only) generate ``model.generate``'s tokens and
logits on 2 stages, also when a sequence stops early and leaves the batch (its rows of every state
go, :func:`~runtime.generate.parts.drop_rows`). The self-check reads the cache as well as writing
it: a cache that loses its past passes a prefill and is refused at the first decode step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from family_sweep import NEW, PROMPTS, SEQ
from partitioner import partition
from runtime.generate import Generator, SelfCheckError, left_pad
from runtime.generate.parts import drop_rows
from tiny_configs import build_model, sweep_entries

transformers = pytest.importorskip("transformers")

EXAMPLE = (torch.zeros(1, SEQ, dtype=torch.long),)


def _model(model_type: str) -> Any:
    (entry,) = sweep_entries([model_type])
    return build_model(entry).eval()


def _reference(model: Any, eos: int | list[int]) -> Any:
    ids, mask = left_pad(PROMPTS, pad_token_id=0)
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, eos_token_id=eos,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)


@pytest.mark.parametrize("model_type", ["mamba", "lfm3"])
def test_a_family_keeping_states_generates_its_tokens_and_logits_also_as_sequences_stop(model_type: str) -> None:
    model = _model(model_type)
    gen = Generator(partition(model, EXAMPLE, 2))
    assert {"linear_attention", "conv"} & set(gen.parts.kinds)
    free = gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0, output_logits=True)
    want = _reference(model, [])
    assert torch.equal(free.sequences, want.sequences)
    assert free.logits is not None
    torch.testing.assert_close(torch.stack(free.logits, 1), torch.stack(want.logits, 1), rtol=1e-4, atol=1e-5)
    assert any(gen.stages[0].cached_layers()) and gen.stages[0].cached_bytes() > 0  # states, counted
    eos = free.tokens[0][1]  # sequence 0 stops at its second token; the others run on without it
    stopped = gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    assert any(len(t) < NEW for t in stopped.tokens) and any(len(t) == NEW for t in stopped.tokens)
    assert torch.equal(stopped.sequences, _reference(model, eos).sequences)


def test_dropping_rows_drops_them_from_keys_values_and_states() -> None:
    from transformers.cache_utils import (
        DynamicCache,
        DynamicLayer,
        LinearAttentionAndFullAttentionLayer,
        LinearAttentionLayer,
    )

    cache = DynamicCache()
    cache.layers = [DynamicLayer(), LinearAttentionLayer(), LinearAttentionAndFullAttentionLayer()]
    rows = torch.arange(3.0).view(3, 1, 1, 1)  # row b holds b everywhere
    for i in (0, 2):
        cache.layers[i].update(rows.expand(3, 2, 5, 4).clone(), rows.expand(3, 2, 5, 4).clone())
    for i in (1, 2):
        cache.layers[i].update_conv_state(rows.view(3, 1, 1).expand(3, 6, 4).clone())
        cache.layers[i].update_recurrent_state(rows.expand(3, 2, 4, 4).clone())
    drop_rows(cache, torch.tensor([0, 2]))
    held = [cache.layers[0].keys, cache.layers[0].values, cache.layers[1].conv_states[0],
            cache.layers[1].recurrent_states[0], cache.layers[2].keys, cache.layers[2].conv_states[0],
            cache.layers[2].recurrent_states[0]]
    for t in held:
        assert t.shape[0] == 2 and t[0].eq(0).all() and t[1].eq(2).all(), t.shape


def test_a_cache_that_loses_its_past_is_refused_at_the_first_decode_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.cache_utils import DynamicLayer

    import runtime.generate.stage as stage

    class Forgetful(DynamicLayer):  # the past's values fade each call: the prefill cannot tell
        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
            if self.is_initialized:
                self.values = self.values * 0.5
            return super().update(key_states, value_states, *args, **kwargs)

    real = stage.new_cache

    def forgetful_cache(parts: Any) -> Any:
        cache = real(parts)
        cache.layers = [Forgetful() for _ in cache.layers]
        return cache

    monkeypatch.setattr(stage, "new_cache", forgetful_cache)
    with pytest.raises(SelfCheckError, match=r"\(the logits\), decode step 1 of 2 \(stage 1\)"):
        Generator(partition(_model("llama"), EXAMPLE, 2))
