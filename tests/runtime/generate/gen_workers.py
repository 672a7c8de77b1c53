"""What each gloo process of the pipelined generation tests runs (module-level, so the pool can pickle it).

Each function is one case of a matrix (``rank_pool.Cases``): the pool's ranks run many cases, and
:func:`gen_cases.planned` traces a family once per stage count in each of them.
"""

from __future__ import annotations

from typing import Any

import torch
from gen_cases import EXAMPLE, planned

from runtime.generate import Generator, Sampling

__all__ = ["EXAMPLE", "NEW", "SAMPLING", "GROUPS", "generate_over_gloo", "family_over_gloo"]

NEW = 6
# Seeded sampling every transport and stage count must reproduce.
SAMPLING = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=3)
# Groups in flight per case of generate_over_gloo: llama with 3, gemma2 with 2, llama sampled with 2.
GROUPS = {"llama": 3, "gemma2": 2, "sampled": 2}


def generate_over_gloo(rank: int, world: int, key: tuple[str, int], prompts: list[list[int]]) -> Any:
    """Case ``(what, dp)`` on this rank of a ``dp`` x ``world / dp`` world of 2-stage pipelines: for
    ``what`` a family, its greedy sequences and this rank's steps; for ``'sampled'``, llama's seeded
    samples."""
    what, dp = key
    torch.set_num_threads(1)
    name = "llama" if what == "sampled" else what
    gen = Generator(planned(name, 2)[1], transport="dist", dp=dp, timeout=60)
    assert len(gen.modules) == 1  # this rank built its own stage only
    if what == "sampled":
        return gen.generate(prompts, max_new_tokens=NEW, eos_token_id=[], sampling=SAMPLING, groups=GROUPS[what]).tokens
    got = gen.generate(prompts, max_new_tokens=NEW, eos_token_id=2, pad_token_id=0, groups=GROUPS[what])
    return (got.sequences.tolist(),  # plain lists: tensors would cross as shared memory of a gone process
            [(s.rank, s.group, s.step, s.start, s.end) for s in got.timeline])


def family_over_gloo(rank: int, world: int, name: str, prompts: list[list[int]]) -> dict[str, Any]:
    """Family ``name`` planned into ``world`` stages, one per process: its greedy sequences (2 groups in flight, then
    groups of 2 sequences with 2 in flight, continuous batching, each prompt entering in pieces of 2 positions)
    and seeded samples (as the second, the prompt whole); on rank 0, the same samples from one process
    (every stage in this one, no messages)."""
    torch.set_num_threads(1)
    plan = planned(name, world)[1]
    gen = Generator(plan, transport="dist", timeout=60)
    assert len(gen.modules) == 1 and len(gen.stages) == 1  # this rank built and runs its own stage only
    flight = gen.generate(prompts, max_new_tokens=NEW, eos_token_id=2, pad_token_id=0, groups=2)
    rolling = gen.generate(prompts, max_new_tokens=NEW, eos_token_id=2, pad_token_id=0, groups=2, group_size=2,
                           prefill_chunk=2)
    sampled = gen.generate(prompts, max_new_tokens=NEW, eos_token_id=[], sampling=SAMPLING, groups=2, group_size=2)
    one = None
    if rank == 0:
        one = Generator(plan, transport="sequential").generate(prompts, max_new_tokens=NEW, eos_token_id=[],
                                                               sampling=SAMPLING).tokens
    return {"flight": flight.sequences.tolist(), "rolling": rolling.sequences.tolist(), "sampled": sampled.tokens,
            "groups": sorted({s.group for s in rolling.timeline}), "one": one}
