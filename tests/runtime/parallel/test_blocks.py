"""Outlining a stage's blocks (runtime.parallel.blocks): the same parameters under the same names,
bitwise the same outputs and gradients, and blocks that are not safe to move left in place."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import fx, nn

from partitioner import partition
from partitioner.zoo import gpt2
from runtime.parallel.blocks import outline_blocks


def _staged(stages: int) -> tuple[Any, torch.Tensor]:
    torch.manual_seed(0)
    model, _ = gpt2(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=16, batch=2, seq=8)
    x = torch.randint(0, 64, (2, 8))
    plan = partition(model, (x,), stages, microbatches=2)
    return plan.build_stages(), x


def _params(m: nn.Module) -> dict[str, nn.Parameter]:
    return dict(m.named_parameters(remove_duplicate=False))


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def test_a_gpt2_stage_computes_the_same_with_its_blocks_outlined() -> None:
    staged, x = _staged(2)
    plain = copy.deepcopy(staged)
    outlined = []
    for st in staged.stages:
        before = _params(st)
        outlined.append(outline_blocks(st))
        after = _params(st)
        assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)  # same tensors
        calls = [n.target for n in st.graph.nodes if n.op == "call_module"]
        assert calls == outlined[-1] and all(type(st.get_submodule(p)).__name__ == "Block" for p in calls)
    # A block the cut splits is outlined in both stages, each its own part of it.
    assert {p for o in outlined for p in o} == {f"model.transformer.h.{i}" for i in range(4)}
    got, want = _first(staged(x)), _first(plain(x))
    assert torch.equal(got, want)
    got.float().pow(2).mean().backward()
    want.float().pow(2).mean().backward()
    for a, b in zip(plain.stages, staged.stages):
        pa, pb = _params(a), _params(b)
        for n in pa:
            assert (pa[n].grad is None) == (pb[n].grad is None), n
            if pa[n].grad is not None:
                assert torch.equal(pa[n].grad, pb[n].grad), n


def test_a_weight_tied_inside_a_stage_stays_with_the_stage() -> None:
    # One stage holds GPT-2's tied embedding and head: the blocks move, the tie does not break.
    staged, x = _staged(1)
    (stage,) = staged.stages
    want = stage(x)
    before = _params(stage)
    done = outline_blocks(stage)
    assert done == [f"model.transformer.h.{i}" for i in range(4)]
    after = _params(stage)
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    tied = [n for n in after if n.endswith(("wte.weight", "lm_head.weight"))]
    assert len(tied) == 2 and after[tied[0]] is after[tied[1]]
    assert torch.equal(_first(stage(x)), _first(want))


def test_a_block_whose_weight_is_read_outside_it_is_not_moved() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = torch.tanh(b(x))
            return x @ self.blocks[0].weight  # block 0's weight read again after the others

    gm = fx.symbolic_trace(Shared())
    x = torch.randn(2, 4)
    want = gm(x)
    done = outline_blocks(gm)
    assert "blocks.0" not in done and done == ["blocks.1", "blocks.2"]
    assert torch.equal(gm(x), want)


def test_a_block_split_between_stages_is_a_part_in_each_or_stays_with_a_stage_without_its_weights() -> None:
    # Cut at node granularity inside block h.1: after its last weight (the second stage holds
    # only h.1's residual add: nothing of it to shard, it stays in the stage graph), and at its
    # MLP (each stage outlines the part of h.1 it holds).
    from tests.runtime.parallel.test_fsdp import cut_inside

    torch.manual_seed(0)
    model, _ = gpt2(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, batch=2, seq=8)
    x = torch.randint(0, 64, (2, 8))
    plan = partition(model, (x,), 2, microbatches=2)
    for where, second in (("tail", []), ("mid", ["model.transformer.h.1"])):
        staged = cut_inside(plan, "model.transformer.h.1", where).build_stages()
        plain = copy.deepcopy(staged)
        done = [outline_blocks(st) for st in staged.stages]
        assert done == [["model.transformer.h.0", "model.transformer.h.1"], second], where
        assert torch.equal(_first(staged(x)), _first(plain(x))), where
