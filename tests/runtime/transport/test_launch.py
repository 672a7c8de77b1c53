"""runtime.transport.launch.spawn's start methods: ranks forked from a fork server start as the
caller is at the call (its environment, working directory and ``sys.path``), and the server's
preload list is put back as it was."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
from pathlib import Path

import pytest

from runtime.transport.launch import START_METHODS, StartMethodError, spawn, start_context

pytestmark = pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(),
                                reason="this platform has no fork server")


def _seen(rank: int, world: int) -> tuple[int, str | None, str, bool]:
    import torch

    return rank, os.environ.get("PIPECUT_LAUNCH_TEST"), os.getcwd(), torch.get_num_threads() == 1


@pytest.mark.multiprocess
def test_forked_ranks_see_the_callers_environment_and_folder_at_each_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPECUT_LAUNCH_TEST", "first")
    first = spawn(_seen, 2, timeout=120)
    monkeypatch.setenv("PIPECUT_LAUNCH_TEST", "second")  # after the fork server started
    monkeypatch.chdir(tmp_path)
    second = spawn(_seen, 2, timeout=120)
    here = str(tmp_path)
    assert [r[:2] for r in first] == [(0, "first"), (1, "first")]
    assert second == [(0, "second", here, True), (1, "second", here, True)]


def test_start_context_leaves_the_preload_list_as_it_found_it() -> None:
    server = multiprocessing.forkserver._forkserver
    before = list(server._preload_modules)
    ctx = start_context("forkserver")
    assert ctx.get_start_method() == "forkserver"
    assert list(server._preload_modules) == before
    assert start_context("spawn").get_start_method() == "spawn"


def test_an_unknown_start_method_is_refused_with_the_choices() -> None:
    assert START_METHODS == ("forkserver", "spawn")
    with pytest.raises(StartMethodError, match=r"start_method='fork': one of 'forkserver', 'spawn'"):
        spawn(_seen, 2, start_method="fork")
