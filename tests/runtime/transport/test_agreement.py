"""Ranks that disagree on the step raise ``RankDisagreementError`` on every rank, before any
message: micro-batches, batch sizes (was a gloo abort, "Received data size doesn't match"), and
the check costs one all-gather per new batch shape."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from partitioner.schedule.generators import forward_only
from rank_pool import spawn
from runtime.errors import RankDisagreementError
from runtime.transport.agreement import disagreement, step_facts
from tests.runtime.parity import case, make_trainer


def test_step_facts_name_the_schedule_the_count_and_each_batch_shape() -> None:
    micro = [{"x": torch.zeros(2, 16), "flag": 3} for _ in range(4)]
    facts = step_facts(forward_only(2, 4), micro)
    assert facts["micro-batches"] == 4
    assert facts["input 'x'"] == "(8, 16) float32"  # the batch: m micro-batches of 2 rows
    assert "input 'flag'" not in facts  # not a tensor: no message depends on it


def test_the_message_groups_ranks_by_value_and_gives_each_fix() -> None:
    a = {"micro-batches": 4, "input 'x'": "(8, 16) float32", "schedule": "1f1b on 2 ranks"}
    b = {"micro-batches": 2, "input 'x'": "(12, 16) float32", "schedule": "1f1b on 2 ranks"}
    text = disagreement({0: a, 1: b, 2: a, 3: b}, 3)
    assert text.startswith("rank 3: the ranks of this job disagree on the step they run")
    assert "  micro-batches: 4 on ranks [0, 2]; 2 on ranks [1, 3]\n" in text
    assert "  input 'x': (8, 16) float32 on ranks [0, 2]; (12, 16) float32 on ranks [1, 3]\n" in text
    assert "schedule" not in text.split("\n  Fix")[0]  # agreed: not listed
    assert "Fix: build every rank's trainer with the same microbatches=" in text
    assert "Fix: give every rank a batch of the same sizes" in text


def _each_case(rank: int, world: int, whats: list[str]) -> dict[str, dict[str, Any]]:
    """``_disagreeing_ranks`` for each case in turn, in one spawn (starting the processes costs more
    than a case; a disagreement is raised before any message, so the group stays usable): its
    result, or its traceback for its own test to report."""
    import traceback

    out = {}
    for what in whats:
        try:
            out[what] = {"result": _disagreeing_ranks(rank, world, what)}
        except Exception:
            out[what] = {"error": traceback.format_exc()}
    return out


def _disagreeing_ranks(rank: int, world: int, what: str) -> dict[str, Any]:
    import torch.distributed as dist

    gather = dist.all_gather
    try:
        return _disagree(rank, what)
    finally:  # the next case counts its own gathers
        dist.all_gather = gather  # type: ignore[assignment]


def _disagree(rank: int, what: str) -> dict[str, Any]:
    import torch.distributed as dist

    c = case("mlp", 2)
    m = 2 if what == "microbatches" and rank == 1 else 4
    trainer = make_trainer(c, 2, "1f1b", transport="dist", timeout=30, microbatches=m,
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    gathers = 0
    gather = dist.all_gather

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal gathers
        gathers += 1
        return gather(*args, **kwargs)

    dist.all_gather = counted  # type: ignore[assignment]
    if what == "agree":  # three steps of one shape, then one of another: two checks
        for rows in (8, 8, 8, 16):
            trainer.step(torch.randn(rows, 16), torch.randn(rows, 8))
        return {"type": "", "gathers": gathers}
    rows = 12 if what == "rows" and rank == 1 else 8
    start = time.monotonic()
    got = {"type": "", "message": "", "waited": 0.0}
    try:
        trainer.step(torch.randn(rows, 16), torch.randn(rows, 8))
    except RankDisagreementError as e:
        assert isinstance(e, ValueError)
        got = {"type": type(e).__name__, "message": str(e), "waited": time.monotonic() - start}
    if what == "rows":  # nothing was sent: the same trainers step together once the batches agree
        trainer.step(torch.randn(8, 16), torch.randn(8, 8))
    return got


@pytest.fixture(scope="module")
def over_gloo() -> list[dict[str, dict[str, Any]]]:
    # Agreeing first: its count of gathers is the least likely to be disturbed by an earlier case.
    return spawn(_each_case, 2, ["agree", "microbatches", "rows"], timeout=240)


def _case(results: list[dict[str, dict[str, Any]]], what: str) -> list[dict[str, Any]]:
    for r in results:
        assert "error" not in r[what], r[what]["error"]
    return [r[what]["result"] for r in results]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("what", "says"),
    [
        ("microbatches", ("  micro-batches: 4 on rank 0; 2 on rank 1\n  Fix: build every rank's trainer with the "
                          "same microbatches= (Execution(microbatches=...))")),
        ("rows", ("  input 'x': (8, 16) float32 on rank 0; (12, 16) float32 on rank 1\n  Fix: give every rank "
                  "a batch of the same sizes")),
    ],
)
def test_ranks_that_disagree_raise_on_every_rank(over_gloo: list[dict[str, Any]], what: str, says: str) -> None:
    results = _case(over_gloo, what)
    for rank, got in enumerate(results):
        assert got["type"] == "RankDisagreementError", (rank, got)
        assert got["message"].startswith(f"rank {rank}: the ranks of this job disagree on the step they run")
        assert says in got["message"], got["message"]
        assert got["waited"] < 5, got  # at once, not at the 30 s timeout


@pytest.mark.multiprocess
def test_ranks_that_agree_check_once_per_batch_shape(over_gloo: list[dict[str, Any]]) -> None:
    results = _case(over_gloo, "agree")
    assert [got["gathers"] for got in results] == [2, 2]
