"""The generator against ``model.generate``: the same greedy tokens for ragged prompts on 2 and 4
stages, per family; the cache used (one position per sequence per decode step, each stage caching
its own layers only); a stop per sequence; seeded sampling independent of the stage count; a meta
model built and loaded per stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gen_cases import CASES, EXAMPLE, PROMPTS, build, planned

from partitioner import partition
from profiles import LONG, long_only
from runtime import empty_weights
from runtime.generate import GenerateModelError, GenerateOptionError, Generator, Sampling, left_pad

transformers = pytest.importorskip("transformers")

NEW = 6  # new tokens: prompts of 3-7 tokens grow past the sliding windows (4)
# The family generated on 4 stages too by default (each of its stages holds one kind of layer on 2
# stages, a mixture of kinds on 4); the long profile runs every family on 4.
_FOUR_STAGES = ("qwen2_mixed",)
# Families whose mechanism another default family runs (the long profile runs them): Qwen2 is
# Llama with biases, Mistral's window is Gemma 2's and Qwen2-mixed's, Qwen2-MoE's experts Mixtral's.
_SAME_MECHANISM = ("qwen2", "mistral", "qwen2_moe")


def _reference(model: Any, eos: int | list[int] = 2, new: int = NEW) -> Any:
    """``model.generate``'s greedy output for PROMPTS: ``.sequences`` and each step's ``.logits``."""
    ids, mask = left_pad(PROMPTS, pad_token_id=0)
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, eos_token_id=eos,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)


def _positions_per_call(gen: Generator) -> list[list[int]]:
    """Per stage: the sequence length each of its layer calls received, recorded by hooks."""
    seen: list[list[int]] = [[] for _ in gen.stages]
    for s, span in enumerate(gen.spans):
        for i in span.layers:
            layer = gen.parts.module(gen.parts.layers[i])
            layer.register_forward_pre_hook(lambda _m, args, s=s: seen[s].append(args[0].shape[1]))
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("name", long_only(sorted(CASES), _SAME_MECHANISM))
def test_greedy_tokens_are_generates_on_2_and_4_stages(name: str) -> None:
    want = _reference(planned(name, 2)[0])
    for p in (2, 4) if LONG or name in _FOUR_STAGES else (2,):
        plan = planned(name, p)[1]
        gen = Generator(plan)
        assert [len(s.layers) for s in gen.spans] == [4 // p] * p
        got = gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=2, pad_token_id=0, output_logits=True)
        assert torch.equal(got.sequences, want.sequences), (p, got.sequences.tolist(), want.sequences.tolist())
        # A thread per stage, two groups in flight: the same tokens.
        threads = Generator(plan, transport="threads").generate(PROMPTS, max_new_tokens=NEW, eos_token_id=2,
                                                                pad_token_id=0, groups=2)
        assert torch.equal(threads.sequences, want.sequences), (p, threads.sequences.tolist())
        # The logits too: tiny random models attend almost uniformly, so a wrong mask (padding or
        # window) can leave the greedy tokens alone while it changes the logits.
        assert got.logits is not None
        torch.testing.assert_close(torch.stack(got.logits, 1), torch.stack(want.logits, 1), rtol=1e-5, atol=1e-5)
        # Each stage's cache holds its own layers' keys and values, and no other layer's.
        assert gen.cached_layers() == [list(s.layers) for s in gen.spans]


def test_the_cache_is_used_each_decode_step_sends_one_position_per_sequence() -> None:
    model = build("llama")
    gen = Generator(partition(model, EXAMPLE, 2))
    seen = _positions_per_call(gen)
    out = gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0)
    width = max(len(p) for p in PROMPTS)
    assert out.steps == NEW
    # Every layer: the prompt once, then one position per step (nothing computed again).
    assert seen == [[width] * 2 + [1] * 2 * (NEW - 1)] * 2
    # What crossed into each stage: token ids (B, T) into the first, hidden states (B, T, 32) after.
    assert gen.stages[0].calls == [(3, width)] + [(3, 1)] * (NEW - 1)
    assert gen.stages[1].calls == [(3, width, 32)] + [(3, 1, 32)] * (NEW - 1)
    # Keys and values of its 2 layers only: 2 layers x (K, V) x 3 seqs x 2 heads x positions x 8 x 4 bytes.
    positions = width + NEW - 1
    assert [s.cached_bytes() for s in gen.stages] == [2 * 2 * 3 * 2 * positions * 8 * 4] * 2
    assert gen.cached_layers() == [[0, 1], [2, 3]]


def test_each_sequence_stops_at_its_eos_or_its_own_limit() -> None:
    model, plan = planned("llama", 2)
    gen = Generator(plan)
    free = gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0)
    eos = free.tokens[0][1]  # sequence 0's second token: it stops there (others may too, later or not)
    stopped = gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(stopped.sequences, _reference(model, eos=eos).sequences)
    assert stopped.tokens[0] == free.tokens[0][:2]
    for b, tokens in enumerate(stopped.tokens):
        cut = free.tokens[b].index(eos) + 1 if eos in free.tokens[b] else NEW
        assert tokens == free.tokens[b][:cut]
    limited = gen.generate(PROMPTS, max_new_tokens=[1, 4, 0], eos_token_id=[], pad_token_id=0)
    assert [len(t) for t in limited.tokens] == [1, 4, 0]
    assert limited.tokens[1] == free.tokens[1][:4] and limited.steps == 4
    assert limited.sequences[0, -3:].tolist() == [0, 0, 0]  # padded after its limit


def test_sampling_with_a_seed_gives_the_same_tokens_on_2_and_4_stages() -> None:
    sampling = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=3)
    runs = [Generator(planned("gemma2", p)[1]).generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[],
                                                             sampling=sampling) for p in (2, 4)]
    assert runs[0].tokens == runs[1].tokens
    again = Generator(planned("gemma2", 2)[1])
    assert again.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[], sampling=sampling).tokens == runs[0].tokens
    other = again.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[], sampling=Sampling(0.8, 20, 0.9, seed=4))
    assert other.tokens != runs[0].tokens
    greedy = again.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[])
    assert greedy.tokens != runs[0].tokens
    pieces = again.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[], sampling=sampling, prefill_chunk=2)
    assert pieces.tokens == runs[0].tokens  # the prompt in pieces: each sequence's draws are the same


def test_a_meta_model_is_built_and_loaded_per_stage(tmp_path: Path) -> None:
    pretrained = build("qwen2_mixed", seed=7)
    pretrained.save_pretrained(tmp_path)
    config = pretrained.config
    with empty_weights():
        model = transformers.Qwen2ForCausalLM(config).eval()
    assert all(t.is_meta for t in model.parameters())
    gen = Generator(partition(model, EXAMPLE, 2), weights=tmp_path)
    assert gen.load_report is not None and len(gen.load_report.names) == len(pretrained.state_dict())
    assert not any(t.is_meta for t in model.parameters())
    got = gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=2, pad_token_id=0)
    assert torch.equal(got.sequences, _reference(pretrained).sequences)


def test_tensor_prompts_with_a_mask_and_bad_options() -> None:
    gen = Generator(planned("gpt2", 2)[1])
    ids, mask = left_pad(PROMPTS, pad_token_id=0)
    as_lists = gen.generate(PROMPTS, max_new_tokens=2, eos_token_id=[], pad_token_id=0)
    assert torch.equal(gen.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=[],
                                    pad_token_id=0).sequences, as_lists.sequences)
    with pytest.raises(GenerateOptionError, match=r"prompts \[1, 2\] are not left-padded"):
        gen.generate(ids, attention_mask=mask.flip(1), max_new_tokens=2)
    with pytest.raises(GenerateOptionError, match=r"empty: \[1\]"):
        gen.generate([[4], []], max_new_tokens=2)
    with pytest.raises(GenerateOptionError, match=r"one per prompt \(3\), got \[1, 2\]"):
        gen.generate(PROMPTS, max_new_tokens=[1, 2])


def test_a_model_that_is_not_a_causal_lm_is_refused() -> None:
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(GenerateModelError, match="Sequential is not a Hugging Face transformers model"):
        Generator(partition(mlp, (torch.randn(2, 4),), 1))


def test_bf16_reaches_every_rank_thread_whatever_the_transport() -> None:
    # autocast's state is per thread: a caller's torch.autocast must still reach the stage threads.
    from runtime.precision import AutocastConflictError, PrecisionError

    plan = planned("llama", 2)[1]
    run = dict(max_new_tokens=NEW, eos_token_id=[], output_logits=True, groups=1)
    sequential = Generator(plan, transport="sequential", precision="bf16").generate(PROMPTS, **run)
    threads = Generator(plan, transport="threads", precision="bf16").generate(PROMPTS, **run)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the caller's autocast, carried into the threads
        caller = Generator(plan, transport="threads").generate(PROMPTS, **run)
    fp32 = Generator(plan, transport="threads").generate(PROMPTS, **run)
    assert sequential.logits is not None and threads.logits is not None and caller.logits is not None
    assert sequential.logits[0].dtype == threads.logits[0].dtype == caller.logits[0].dtype == torch.bfloat16
    for other in (threads, caller):
        assert other.logits is not None
        assert all(torch.equal(a, b) for a, b in zip(sequential.logits, other.logits, strict=True))
        assert other.tokens == sequential.tokens
    assert fp32.logits is not None and fp32.logits[0].dtype == torch.float32  # the default stays fp32
    assert torch.is_autocast_enabled("cpu") is False  # the autocast each thread entered is left behind it
    with pytest.raises(PrecisionError, match="unknown precision 'int8'"):
        Generator(plan, precision="int8")
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(AutocastConflictError, match="precision='bf16'"):
        Generator(plan, transport="threads", precision="bf16").generate(PROMPTS, **run)


@pytest.mark.slow
# windowed and full layers by default, every family long
@pytest.mark.parametrize("name", long_only(sorted(CASES), set(CASES) - {"qwen2_mixed"}))
def test_a_prompt_in_pieces_gives_generates_tokens_and_logits(name: str) -> None:
    # A chunked prefill: the padded prompt (7 positions) enters in pieces of 3, 3 and 1; each stage
    # extends its cache piece by piece (sliding windows of 4 included), then decodes as before.
    model = planned(name, 2)[0]
    want = _reference(model)
    width = max(len(p) for p in PROMPTS)
    for p, transport, groups in ((2, "threads", 1), (2, "threads", 2), (4, "sequential", 2)):
        gen = Generator(planned(name, p)[1], transport=transport)
        got = gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=2, pad_token_id=0, output_logits=True,
                           groups=groups, prefill_chunk=3)
        assert torch.equal(got.sequences, want.sequences), (p, groups, got.sequences.tolist())
        assert got.logits is not None
        torch.testing.assert_close(torch.stack(got.logits, 1), torch.stack(want.logits, 1), rtol=1e-5, atol=1e-5)
        # Each group's first rank steps: three pieces (no token back between them), then one per new token.
        firsts = sorted((s.group, s.step) for s in got.timeline if s.rank == 0)
        assert [s for g, s in firsts if g == 0][:4] == [0, 1, 2, 3]
    # What each layer received, one group: the pieces' widths, then one position per step.
    gen = Generator(partition(model, EXAMPLE, 2), transport="threads")
    seen = _positions_per_call(gen)
    gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0, groups=1, prefill_chunk=3)
    assert width == 7 and seen == [[3, 3, 3, 3, 1, 1] + [1, 1] * (NEW - 1)] * 2
