"""The tests' memo of exported Hugging Face models (``tests/trace_memo.py``): a second model of the
same structure traced with the same example gets the first one's program, bound to its own
tensors, and computes what it computes; anything that could change the program misses."""

from __future__ import annotations

import pytest
import torch

import trace_memo
from partitioner.tracing.trace import trace

transformers = pytest.importorskip("transformers")


def _llama(layers: int = 2) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                   max_position_embeddings=32, attention_dropout=0.0)
    return transformers.LlamaForCausalLM(cfg)


def _counted(fn):  # type: ignore[no-untyped-def]
    before = trace_memo.stats()
    out = fn()
    after = trace_memo.stats()
    return out, after["hits"] - before["hits"], after["misses"] - before["misses"]


def test_a_same_structure_model_reuses_the_program_bound_to_its_own_weights() -> None:
    ids = torch.randint(0, 64, (2, 8))
    a, b = _llama(1), _llama(1)  # different random weights
    first, hits, misses = _counted(lambda: trace(a, (ids,)))
    second, hits2, misses2 = _counted(lambda: trace(b, (ids,)))
    assert (hits, misses, hits2, misses2) == (0, 1, 1, 0)
    assert second.fingerprint() == first.fingerprint()
    # Bound to b's tensors, not a's: the graph computes b's logits.
    names = dict(second.gm.named_parameters(remove_duplicate=False))
    assert names and all(p is dict(b.named_parameters(remove_duplicate=False))[n] for n, p in names.items())
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        got = second.unflatten_outputs(second.gm(x)).logits
        torch.testing.assert_close(got, b(x).logits)
        assert not torch.allclose(got, a(x).logits)


def test_what_changes_the_program_changes_the_key() -> None:
    ids = torch.randint(0, 64, (2, 8))

    def key(model: torch.nn.Module, x: torch.Tensor = ids) -> str | None:
        return trace_memo.key(model, (x,), {"use_cache": False}, None)

    base = key(_llama())
    assert base is not None and key(_llama()) == base  # the weights' values do not count
    assert key(_llama(3)) != base  # another config
    assert key(_llama(), torch.randint(0, 64, (2, 6))) != base  # another example
    assert trace_memo.key(_llama(), (ids,), {"use_cache": True}, None) != base  # another keyword
    assert key(_llama().eval()) != base  # another mode
    with torch.no_grad():
        assert key(_llama()) != base  # another grad mode
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert key(_llama()) != base
    frozen = _llama()
    frozen.lm_head.weight.requires_grad_(False)
    assert key(frozen) != base
    hooked = _llama()
    hooked.model.layers[0].register_forward_hook(lambda *_: None)
    assert key(hooked) is None  # a hook: never memoised
    checkpointed = _llama()
    checkpointed.gradient_checkpointing_enable()
    assert key(checkpointed) is None  # nor checkpoint calls the tracer watches
    with trace_memo.off():
        _, hits, misses = _counted(lambda: trace(_llama(1), (ids,)))
    assert (hits, misses) == (0, 0)


def test_only_transformers_models_are_keyed() -> None:
    assert trace_memo.key(torch.nn.Linear(2, 2), (torch.zeros(1, 2),), {}, None) is None
    m = _llama()
    assert trace_memo.key(m, (torch.zeros(1, 8, dtype=torch.long),), {}, None) is not None
    m.forward = m.forward  # an instance-level forward: someone wrapped it
    assert trace_memo.key(m, (torch.zeros(1, 8, dtype=torch.long),), {}, None) is None


def test_the_logits_wrapper_is_keyed_by_the_model_it_wraps() -> None:
    # The zoo's gpt2-tiny is CausalLMLogits(GPT2LMHeadModel): keyed like the model inside, its
    # config included (the wrapper has none of its own).
    from partitioner.tracing.trace import CausalLMLogits

    def gpt2(**overrides: object) -> torch.nn.Module:
        cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **overrides)
        return CausalLMLogits(transformers.GPT2LMHeadModel(cfg))

    ids = torch.randint(0, 64, (2, 8))
    base = trace_memo.key(gpt2(), (ids,), {}, None)
    assert base is not None and trace_memo.key(gpt2(), (ids,), {}, None) == base
    assert trace_memo.key(gpt2(layer_norm_epsilon=1e-3), (ids,), {}, None) != base  # a config value, same shapes
    assert trace_memo.key(CausalLMLogits(torch.nn.Linear(2, 2)), (ids,), {}, None) is None
    a, b = gpt2(), gpt2()
    first, _, misses = _counted(lambda: trace(a, (ids,)))
    second, hits, _ = _counted(lambda: trace(b, (ids,)))
    assert (misses, hits) == (1, 1) and second.fingerprint() == first.fingerprint()
    with torch.no_grad():
        torch.testing.assert_close(second.gm(ids)[0], b(ids))  # b's weights, not a's
