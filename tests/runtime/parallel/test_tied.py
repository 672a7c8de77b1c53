"""Tied weights across ranks: the sum of their gradients is bounded by the trainer's timeout.

A rank that fails before the sum, or never reaches it, makes the other holder raise a typed
error (``PeerFailed`` / ``TransportTimeout``) within ``timeout``, not wait for the process
group's own timeout (30 minutes under torchrun)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import partition
from rank_pool import spawn
from runtime.trainer import PipelineTrainer

TIMEOUT = 5.0


class TiedEnds(nn.Module):
    """Input and output projections share one weight (as GPT-2's embeddings do), on different stages."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8, bias=False)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.out = nn.Linear(8, 8, bias=False)
        self.out.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(self.inp(x)))


def _tied_trainer() -> PipelineTrainer:
    torch.manual_seed(0)
    plan = partition(TiedEnds(), (torch.randn(2, 8),), 2, microbatches=2, schedule="1f1b")
    return PipelineTrainer(plan, nn.functional.mse_loss, schedule="1f1b", transport="dist", timeout=TIMEOUT)


def _rank_1_misses_the_tied_sum(rank: int, world: int, how: str, gave_up: str) -> dict[str, Any]:
    import runtime.trainer

    trainer = _tied_trainer()
    assert trainer._tied, "the plan has no tied weight across ranks"
    sum_tied_grads = runtime.trainer.sum_tied_grads
    if rank == 1:
        def miss(*args: Any, **kwargs: Any) -> None:
            if how == "late":  # never arrives while rank 0 waits: fails only once rank 0 gave up
                deadline = time.monotonic() + TIMEOUT + 60
                while not Path(gave_up).exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            raise RuntimeError("rank 1 failed before the tied reduction")

        runtime.trainer.sum_tied_grads = miss  # type: ignore[assignment]
    start = time.monotonic()
    try:
        trainer.forward_backward(torch.randn(8, 8), torch.randn(8, 8))
    except Exception as e:
        waited = time.monotonic() - start
        Path(gave_up).touch()
        return {"type": type(e).__name__, "message": str(e), "waited": waited}
    finally:  # the pool's rank runs later cases: the patch goes with this one
        runtime.trainer.sum_tied_grads = sum_tied_grads
    Path(gave_up).touch()
    return {"type": "", "message": "", "waited": time.monotonic() - start}


@pytest.mark.multiprocess
# "fails": rank 1 returns from its error and its process exits, announcing nothing: rank 0 names it
# gone (PeerGone) when the process has ended by the time it looks, else failed (PeerFailed).
@pytest.mark.parametrize(("how", "error"), [("fails", "PeerFailed|PeerGone"), ("late", "TransportTimeout")])
def test_the_tied_weight_sum_is_bounded_by_the_timeout(tmp_path: Path, how: str, error: str) -> None:
    got, missed = spawn(_rank_1_misses_the_tied_sum, 2, how, str(tmp_path / "rank-0-gave-up"), timeout=90)
    assert missed["type"] == "RuntimeError", missed
    assert got["type"] in error.split("|"), got
    assert "the all-reduce of tied weights' gradients (a tensor of (8, 8)) with ranks [0, 1]" in got["message"]
    if how == "fails":  # rank 1's connection closed: at once
        assert got["waited"] < TIMEOUT, got
        said = "before the 5 s timeout" if got["type"] == "PeerFailed" else "is gone"
        assert said in got["message"], got["message"]
    else:
        assert TIMEOUT * 0.9 < got["waited"] < TIMEOUT + 3, got
        assert "did not complete within 5 s (the timeout; waited" in got["message"], got["message"]
