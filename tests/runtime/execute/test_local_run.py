"""In-process execution: the rank threads."""

from __future__ import annotations

import torch

from runtime.execute.local_run import RankThreads


def test_rank_threads_use_the_callers_thread_count() -> None:
    """A worker thread runs with the caller's ``torch.set_num_threads``, not the core count."""
    before = torch.get_num_threads()
    seen: dict[int, int] = {}
    try:
        torch.set_num_threads(1)
        threads = RankThreads([0, 1])
        threads.run({r: (lambda r=r: seen.__setitem__(r, torch.get_num_threads())) for r in (0, 1)})
    finally:
        torch.set_num_threads(before)
    assert seen == {0: 1, 1: 1}
