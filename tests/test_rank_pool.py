"""The shared pool of gloo ranks (tests/rank_pool.py): results in rank order, a process group per
case, the process put back as found between cases, and a failed case raised and followed by a
fresh pool, as a fresh spawn would be."""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rank_pool import LaunchError, RankPool
from test_errors import _exit_quietly_on_rank1, _raise_on_rank1  # what spawn's own tests run


def _sum_of_ranks(rank: int, world: int, scale: int) -> dict[str, Any]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "world": dist.get_world_size(), "sum": int(t.item()) * scale, "pid": os.getpid()}


def _leave_a_mess(rank: int, world: int) -> None:
    # Everything a case may change in its process, changed.
    os.environ["PIPECUT_POOL_MESS"] = "1"
    os.chdir("/")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.getLogger().addHandler(logging.NullHandler())
    logging.getLogger().setLevel(logging.DEBUG)
    torch.set_grad_enabled(False)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    import runtime.transport.launch

    runtime.transport.launch.start_context = lambda: None  # a patch of pipecut's, not put back


def _what_a_case_finds(rank: int, world: int) -> dict[str, Any]:
    import runtime.transport.launch

    root = logging.getLogger()
    return {"env": os.environ.get("PIPECUT_POOL_MESS"), "cwd": os.getcwd(),
            "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_IGN,
            "handlers": len(root.handlers), "level": root.level, "grad": torch.is_grad_enabled(),
            "dtype": str(torch.get_default_dtype()), "threads": torch.get_num_threads(),
            "patched": runtime.transport.launch.start_context.__name__, "pid": os.getpid()}


@pytest.mark.multiprocess
def test_one_pool_runs_many_cases_each_in_a_group_of_its_own() -> None:
    pool = RankPool(size=2, warm=())  # torch only: the cases need nothing else
    try:
        one = pool.run(_sum_of_ranks, 1, 10)
        two = pool.run(_sum_of_ranks, 2, 1)
        first = pool.run(_what_a_case_finds, 2)
        pool.run(_leave_a_mess, 2)
        after = pool.run(_what_a_case_finds, 2)
        with pytest.raises(LaunchError, match=r"of 2 failed; rank 1 failed first:(.|\n)*ValueError: rank 1 gives up"):
            pool.run(_raise_on_rank1, 2, timeout=60)
        again = pool.run(_sum_of_ranks, 2, 1)
        with pytest.raises(LaunchError, match=r"rank\(s\) \[1\] of 2 failed; rank 1 failed first:\n"
                                              r"process exited \(code 0\) without reporting a result"):
            pool.run(_exit_quietly_on_rank1, 2, timeout=60)
        fresh = pool.run(_sum_of_ranks, 2, 1)
    finally:
        pool.remove()
    assert [(r["rank"], r["world"], r["sum"]) for r in one] == [(0, 1, 0)]
    assert [(r["rank"], r["world"], r["sum"]) for r in two] == [(0, 2, 1), (1, 2, 1)]
    assert two[0]["pid"] == one[0]["pid"]  # the same process: a second rank was added beside it
    assert after == first  # the mess is cleared
    assert first[0]["env"] is None and not first[0]["sigterm"] and first[0]["grad"]
    assert first[0]["dtype"] == "torch.float32" and first[0]["threads"] == 1
    assert first[0]["patched"] == "start_context"
    assert {r["pid"] for r in fresh}.isdisjoint(r["pid"] for r in two) and pool.starts == 2  # a dead rank: new ones
    assert [r["pid"] for r in again] == [r["pid"] for r in two]  # every rank reported


def test_a_case_larger_than_the_pool_is_refused_before_anything_starts() -> None:
    pool = RankPool(size=2)
    with pytest.raises(ValueError, match="3 ranks does not fit a pool of 2"):
        pool.run(_sum_of_ranks, 3, 1)
    assert pool.starts == 0
    pool.remove()


def _where_families_is(rank: int, world: int) -> str:
    import families

    return str(families.__file__)


@pytest.mark.multiprocess
def test_a_benchmark_folder_ahead_on_the_path_does_not_shadow_the_tests_helpers() -> None:
    import sys
    from pathlib import Path

    benchmarks = str(Path(__file__).resolve().parents[1] / "benchmarks")  # holds a families.py too
    pool = RankPool(size=1, warm=())
    sys.path.insert(0, benchmarks)  # as a benchmark script run in the test process leaves it
    try:
        (found,) = pool.run(_where_families_is, 1)
    finally:
        sys.path.remove(benchmarks)
        pool.remove()
    assert Path(found) == Path(__file__).resolve().parent / "families.py"
