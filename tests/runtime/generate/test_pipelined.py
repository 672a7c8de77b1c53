"""Pipelined decoding: ranks as threads and as gloo processes, several groups of ragged prompts in flight, the
same tokens as ``model.generate`` (greedy) and as one process (seeded sampling); the groups really overlap.

Each family is traced once per stage count in this process and in each rank of the pool
(``gen_cases.planned``), so a test pays only for the plans no earlier test made; the gloo matrices
run one case per test on the pool (``rank_pool.Cases``)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from gen_cases import PROMPTS, build, planned
from gen_workers import NEW, SAMPLING, family_over_gloo, generate_over_gloo

from rank_pool import Cases
from runtime.generate import GenerateOptionError, Generator, Sampling, left_pad, rank_spans, split_groups

transformers = pytest.importorskip("transformers")

# Six ragged prompts: several groups of them, of different lengths within each group.
MANY = [*PROMPTS, [7, 8], [11, 12, 13, 14, 15, 16, 17, 18, 19], [40]]


def _reference(name: str, prompts: list[list[int]] = MANY, eos: int | list[int] = 2) -> torch.Tensor:
    ids, mask = left_pad(prompts, pad_token_id=0)
    out = build(name).generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, eos_token_id=eos,
                               pad_token_id=0)
    return out  # type: ignore[no-any-return]


def test_groups_and_ranks_are_dealt_in_contiguous_runs() -> None:
    assert split_groups(6, 4) == [range(2), range(2, 4), range(4, 5), range(5, 6)]
    assert split_groups(1, 3) == [range(1)]
    with pytest.raises(GenerateOptionError, match="groups must be an int >= 1, got 0"):
        split_groups(3, 0)
    spans = Generator(planned("llama", 4)[1]).spans
    assert [[s.index for s in run] for run in rank_spans(spans, 2)] == [[0, 1], [2, 3]]
    with pytest.raises(GenerateOptionError, match="4 stages cannot be dealt to 3 pipeline ranks"):
        rank_spans(spans, 3)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_threads_give_generates_greedy_tokens_whatever_the_group_count(name: str) -> None:
    want = _reference(name)
    plan = planned(name, 2)[1]
    gen = Generator(plan, transport="threads")
    for groups in (None, 1, 3, 6):
        got = gen.generate(MANY, max_new_tokens=NEW, eos_token_id=2, pad_token_id=0, groups=groups)
        assert torch.equal(got.sequences, want), (groups, got.sequences.tolist(), want.tolist())
    # All in this thread, with groups taking turns.
    one = Generator(plan, transport="sequential")
    assert torch.equal(one.generate(MANY, max_new_tokens=NEW, eos_token_id=2, pad_token_id=0, groups=4).sequences,
                       want)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_four_stages_on_two_thread_ranks_give_generates_greedy_tokens(name: str) -> None:
    # Each rank runs 2 stages, 2 groups in flight.
    four = Generator(planned(name, 4)[1], transport="threads", pp=2)
    assert torch.equal(four.generate(MANY, max_new_tokens=NEW, eos_token_id=2, pad_token_id=0, groups=2).sequences,
                       _reference(name))


def test_stops_and_logits_per_group_are_the_sequential_ones() -> None:
    plan = planned("llama", 2)[1]
    plain = Generator(plan)
    threads = Generator(plan, transport="threads")
    free = plain.generate(MANY, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0)
    eos = free.tokens[0][1]  # sequence 0 (group 0) stops at its second token
    limits = [1, 4, 0, 6, 2, 3]
    want = plain.generate(MANY, max_new_tokens=limits, eos_token_id=eos, pad_token_id=0, output_logits=True)
    got = threads.generate(MANY, max_new_tokens=limits, eos_token_id=eos, pad_token_id=0, output_logits=True,
                           groups=3)
    assert got.tokens == want.tokens and torch.equal(got.sequences, want.sequences)
    assert got.steps == want.steps and got.logits is not None and want.logits is not None
    # A sequence's logits are the sequential run's until its stop; after it (it has left its group, or its
    # group has ended) its rows are NaN, in both runs.
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        for row, tokens in enumerate(want.tokens):
            if step < max(len(tokens), 1):
                torch.testing.assert_close(a[row], b[row], rtol=1e-5, atol=1e-5)
            else:
                assert bool(a[row].isnan().all()) and bool(b[row].isnan().all()), (step, row)


def test_sampled_tokens_are_the_same_across_transports_groups_and_stage_counts() -> None:
    sampling = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=3)
    want = Generator(planned("gemma2", 2)[1]).generate(MANY, max_new_tokens=NEW, eos_token_id=[],
                                                       sampling=sampling).tokens
    for p, groups in ((2, 2), (2, 6), (4, 3)):
        gen = Generator(planned("gemma2", p)[1], transport="threads")
        assert gen.generate(MANY, max_new_tokens=NEW, eos_token_id=[], sampling=sampling, groups=groups).tokens == want


def test_the_first_rank_starts_the_next_group_before_the_last_rank_returns_a_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The order each rank ran its steps in (not their timing): with groups in flight rank 0 runs group g + 1's
    step while group g's is on rank 1; with one group, the ranks take turns."""
    from runtime.generate.stage import StageRunner

    gen = Generator(planned("llama", 2)[1], transport="threads")
    real_call = StageRunner.__call__
    held: list[int] = []

    def holding(self: StageRunner, hop: Any) -> Any:
        # The last stage's first prefill (group 0's) takes a while: a first rank that did not wait
        # for group 0's tokens starts group 1 inside it, whatever the threads' scheduling (without
        # the hold, rank 1 may finish a tiny prefill before rank 0's thread is scheduled again).
        if self.span.head and not held:
            held.append(1)
            time.sleep(0.5)
        return real_call(self, hop)

    monkeypatch.setattr(StageRunner, "__call__", holding)
    out = gen.generate(MANY, max_new_tokens=4, eos_token_id=[], pad_token_id=0, groups=2)
    per_rank = {r: [(s.group, s.step) for s in out.timeline if s.rank == r] for r in (0, 1)}
    # Each rank takes the groups in turn: group 1's step k comes before group 0's step k + 1 on both ranks.
    assert per_rank[0] == per_rank[1] == [(g, k) for k in range(4) for g in (0, 1)]
    # Rank 0 ran group 1's prefill without waiting for group 0's tokens: before rank 1 finished group 0's prefill.
    first = {(s.rank, s.group, s.step): s for s in out.timeline}
    assert first[(0, 1, 0)].start <= first[(1, 0, 0)].end
    monkeypatch.setattr(StageRunner, "__call__", real_call)
    one = gen.generate(MANY, max_new_tokens=4, eos_token_id=[], pad_token_id=0, groups=1)
    ends = [(s.rank, s.step) for s in one.timeline]
    assert ends == [(r, k) for k in range(4) for r in (0, 1)]  # one group: the ranks strictly alternate


def test_bad_transport_options_say_what_to_do() -> None:
    plan = planned("llama", 2)[1]
    with pytest.raises(GenerateOptionError, match="transport must be 'auto', 'sequential', 'threads' or 'dist'"):
        Generator(plan, transport="local")
    with pytest.raises(GenerateOptionError, match="dp=2 needs transport='dist'"):
        Generator(plan, transport="threads", dp=2)


def test_groups_that_end_give_their_place_to_the_next_continuous_batching() -> None:
    want = _reference("llama")
    plan = planned("llama", 2)[1]
    gen = Generator(plan, transport="threads")
    got = gen.generate(MANY, max_new_tokens=NEW, eos_token_id=2, pad_token_id=0, groups=2, group_size=2)
    assert torch.equal(got.sequences, want)
    # Three groups of two, two in flight: the third starts only once one of the first two has ended everywhere.
    assert {s.group for s in got.timeline} == {0, 1, 2}
    last = {g: max(s.end for s in got.timeline if s.group == g) for g in (0, 1)}
    first_of_third = min(s.start for s in got.timeline if s.group == 2)
    assert first_of_third >= min(last.values()), (first_of_third, last)
    # One group at a time in one thread, and seeded samples, give the same tokens too.
    one = Generator(plan, transport="sequential")
    assert torch.equal(one.generate(MANY, max_new_tokens=NEW, eos_token_id=2, pad_token_id=0, group_size=4).sequences,
                       want)
    sampling = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=3)
    plain = one.generate(MANY, max_new_tokens=NEW, eos_token_id=[], sampling=sampling)
    rolled = gen.generate(MANY, max_new_tokens=NEW, eos_token_id=[], sampling=sampling, groups=2, group_size=2)
    assert rolled.tokens == plain.tokens
    with pytest.raises(GenerateOptionError, match="group_size must be an int >= 1, got 0"):
        gen.generate(MANY, max_new_tokens=NEW, group_size=0)


# llama by default (its plan is made already); qwen2 (biased projections) in the long profile.
@pytest.mark.parametrize("name", ["llama", pytest.param("qwen2", marks=pytest.mark.long)])
def test_a_sequence_that_stops_leaves_its_group_and_every_stages_cache(name: str) -> None:
    gen = Generator(planned(name, 2)[1])
    limits = [1, 4, 0, 6, 2, 3]
    out = gen.generate(MANY, max_new_tokens=limits, eos_token_id=[], pad_token_id=0)
    assert [len(t) for t in out.tokens] == limits
    # Each decode step carries only the sequences still running: those whose limit is beyond the tokens so far.
    running = [sum(1 for n in limits if n > step) for step in range(1, max(limits))]
    for stage in gen.stages:
        assert [shape[0] for shape in stage.calls] == [len(MANY), *running], stage.calls
    # The caches hold the last step's sequences only, and the tokens are those of a run without leaving.
    assert {layer.keys.shape[0] for stage in gen.stages for layer in stage.cache.layers if layer.keys is not None
            and layer.keys.numel()} == {running[-1]}
    full = gen.generate(MANY, max_new_tokens=max(limits), eos_token_id=[], pad_token_id=0)  # nobody leaves early
    assert all(len(shape) and shape[0] == len(MANY) for shape in gen.stages[0].calls)
    assert list(out.tokens) == [t[:n] for t, n in zip(full.tokens, limits)]


def _overlaps(timeline: list[Any]) -> int:
    """How many steps rank 1 ran on some group while rank 0 was running a step of another group."""
    ones, zeros = [s for s in timeline if s[0] == 1], [s for s in timeline if s[0] == 0]
    return sum(1 for x in ones for y in zeros if y[1] != x[1] and y[3] < x[4] and x[3] < y[4])


@pytest.fixture(scope="module")
def pipelines() -> dict[int, Cases]:
    """2-stage pipelines over gloo, keyed by (what, dp): 2 processes with dp=1, 4 with dp=2."""
    return {1: Cases(generate_over_gloo, 2, MANY, timeout=300),
            2: Cases(generate_over_gloo, 4, MANY, timeout=400)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_two_gloo_processes_give_generates_tokens_with_groups_in_flight(name: str, pipelines: dict[int, Cases]) -> None:
    results = pipelines[1]((name, 1))
    want = _reference(name)
    for r in (0, 1):
        assert results[r][0] == want.tolist(), (name, r)
    # Rank 1 ran some group's step while rank 0 ran another group's: both processes busy at once.
    timeline = results[0][1] + results[1][1]
    assert {s[0] for s in results[1][1]} == {1}
    assert _overlaps(timeline) > 0, timeline


@pytest.mark.multiprocess
def test_two_gloo_processes_sample_what_one_process_samples(pipelines: dict[int, Cases]) -> None:
    results = pipelines[1](("sampled", 1))
    one = Generator(planned("llama", 2)[1]).generate(MANY, max_new_tokens=NEW, eos_token_id=[], sampling=SAMPLING)
    assert results[0] == results[1] == one.tokens


@pytest.mark.multiprocess
@pytest.mark.slow
def test_data_parallel_replicas_split_the_prompts(pipelines: dict[int, Cases]) -> None:
    results = pipelines[2](("llama", 2))  # 2 replicas x 2 pipeline ranks
    want = _reference("llama")
    for r in range(4):
        assert results[r][0] == want.tolist(), r
    # Replica 1's ranks (world ranks 2, 3) ran rows 3-5 only: its groups are numbered from 0 in its own pipeline.
    assert {s[0] for s in results[3][1]} == {1}
    steps0 = results[0][1]
    assert {s[1] for s in steps0} == {0, 1, 2}


# Every family over gloo, on 2 and on 4 processes (a stage each): greedy as generate, groups in flight and rolling
# groups (continuous batching); seeded samples as one process. By default, one case: gpt2 on 4 processes
# (its own attention and positions; a rank between two others); on 2, the families over gloo above
# (llama, gemma2: a sliding window) stand for the rest. Every family runs in threads by default
# (test_generator.py); the long profile runs the rest of this matrix.
FAMILIES = ("llama", "qwen2", "mistral", "gemma2", "gpt2", "phi3", "mixtral", "qwen2_moe")
_DEFAULT: dict[int, tuple[str, ...]] = {2: (), 4: ("gpt2",)}


@pytest.fixture(scope="module")
def families() -> dict[int, Cases]:
    return {world: Cases(family_over_gloo, world, MANY, timeout=600) for world in (2, 4)}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("world, name", [
    (w, n) if n in _DEFAULT[w] else pytest.param(w, n, marks=pytest.mark.long) for w in (2, 4) for n in FAMILIES])
def test_every_family_over_gloo_gives_generates_tokens(world: int, name: str, families: dict[int, Cases]) -> None:
    results = families[world](name)
    want = _reference(name).tolist()
    one = results[0]["one"]  # the same plan's samples from one process, on rank 0
    for r in range(world):
        got = results[r]
        assert got["flight"] == want and got["rolling"] == want, (name, world, r)
        assert got["sampled"] == one, (name, world, r)
        assert got["groups"] == [0, 1, 2], (name, r)  # the six prompts as three groups of two, two in flight


def test_a_chunked_prefill_too_fine_or_too_many_groups_is_refused() -> None:
    from runtime.generate.pipelined import MAX_CHUNKED_GROUPS, Batch, _check_pieces

    ids = torch.zeros(1, 100_000, dtype=torch.long)
    batch = Batch(ids, ids, ids, torch.ones(1, dtype=torch.long), (), 0, None, False, prefill_chunk=1)
    assert [s.stop - s.start for s in Batch(ids[:, :7], ids, ids, ids, (), 0, None, False, 3).prefill_pieces()] == [
        3, 3, 1]
    _check_pieces(512, MAX_CHUNKED_GROUPS, 16, batch)  # the most there are keys and tags for
    with pytest.raises(GenerateOptionError, match=r"at most 512 pieces .* at least 196"):
        _check_pieces(100_000, 1, 16, batch)
    with pytest.raises(GenerateOptionError, match=f"at most {MAX_CHUNKED_GROUPS} groups"):
        _check_pieces(2, MAX_CHUNKED_GROUPS + 1, 2, batch)
