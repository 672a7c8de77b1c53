"""Gradient clipping over all stages equals torch.nn.utils.clip_grad_norm_ on the plain model (issue 11, part 2)."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

from parity import TOL, case, make_trainer, reference_grads
from rank_pool import spawn


def _clip_case(
    rank: int, world: int, stages: int, schedule: str, norm_types: tuple[float, ...], transport: str
) -> dict[str, Any]:
    """For each norm type: a fresh step's gradients clipped over the stages equal the plain model's."""
    c = case("gpt2", stages)  # tied embedding on the first and last stage
    ref = copy.deepcopy(c["model"])
    trainer = make_trainer(c, stages, schedule, transport=transport)
    out: dict[str, Any] = {"norms": [], "clipped": []}
    for k, norm_type in enumerate(norm_types):
        gen = torch.Generator().manual_seed(7 + k)
        x, y = torch.randint(0, 64, (8, 8), generator=gen), torch.randint(0, 64, (8, 8), generator=gen)
        trainer.zero_grad()
        trainer.forward_backward(x, y)
        reference_grads(c, ref, x, y)
        max_norm = 0.05
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
        got = trainer.clip_grad_norm_(max_norm, norm_type)
        torch.testing.assert_close(got, want, **TOL)
        grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
        for name, prm in trainer.named_parameters():
            torch.testing.assert_close(prm.grad, grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
        out["norms"].append(float(got))
        out["clipped"].append(bool(want > max_norm))
    return out


@pytest.mark.parametrize(("stages", "schedule"), [(2, "1f1b"), (4, "zbv"), (3, "gpipe")])
def test_clipping_over_stages_equals_the_plain_model(stages: int, schedule: str) -> None:
    out = _clip_case(0, 1, stages, schedule, (2.0, 1.0, math.inf), "local")
    assert all(out["clipped"])  # the cases exercise the scaling, not only the norm


@pytest.mark.multiprocess
def test_clipping_over_gloo_ranks_counts_the_tied_weight_once() -> None:
    results = spawn(_clip_case, 2, 2, "1f1b", (2.0,), "dist", timeout=240)
    assert results[0]["norms"] == results[1]["norms"]
