"""What each gloo process of the pipelined generation tests runs (module-level, so ``spawn`` can pickle it)."""

from __future__ import annotations

from typing import Any

import torch
from gen_cases import build

from partitioner import partition
from runtime.generate import Generator, Sampling

EXAMPLE = (torch.zeros(1, 8, dtype=torch.long),)
NEW = 6
# Seeded sampling every transport and stage count must reproduce.
SAMPLING = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=3)


def generate_over_gloo(rank: int, world: int, prompts: list[list[int]], dp: int) -> dict[str, Any]:
    """Every case on this rank of a ``dp`` x ``world / dp`` world: each case's tokens and this rank's steps."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name, groups in (("llama", 3), ("gemma2", 2)):
        gen = Generator(partition(build(name), EXAMPLE, 2), transport="dist", dp=dp, timeout=60)
        got = gen.generate(prompts, max_new_tokens=NEW, eos_token_id=2, pad_token_id=0, groups=groups)
        out[name] = (got.sequences.tolist(),  # plain lists: tensors would cross as shared memory of a gone process
                      [(s.rank, s.group, s.step, s.start, s.end) for s in got.timeline])
        assert len(gen.modules) == 1  # this rank built its own stage only
    gen = Generator(partition(build("llama"), EXAMPLE, 2), transport="dist", dp=dp, timeout=60)
    out["sampled"] = gen.generate(prompts, max_new_tokens=NEW, eos_token_id=[], sampling=SAMPLING, groups=2).tokens
    return out


def families_over_gloo(rank: int, world: int, prompts: list[list[int]], names: list[str]) -> dict[str, Any]:
    """Each family planned into ``world`` stages, one per process: its greedy sequences (2 groups in flight, then
    groups of 2 sequences with 2 in flight, continuous batching, each prompt entering in pieces of 2 positions)
    and seeded samples (as the second, the prompt whole)."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in names:
        gen = Generator(partition(build(name), EXAMPLE, world), transport="dist", timeout=60)
        assert len(gen.modules) == 1 and len(gen.stages) == 1  # this rank built and runs its own stage only
        flight = gen.generate(prompts, max_new_tokens=NEW, eos_token_id=2, pad_token_id=0, groups=2)
        rolling = gen.generate(prompts, max_new_tokens=NEW, eos_token_id=2, pad_token_id=0, groups=2, group_size=2,
                               prefill_chunk=2)
        sampled = gen.generate(prompts, max_new_tokens=NEW, eos_token_id=[], sampling=SAMPLING, groups=2,
                               group_size=2)
        out[name] = (flight.sequences.tolist(), rolling.sequences.tolist(), sampled.tokens,
                     sorted({s.group for s in rolling.timeline}))
    return out
