"""liveness.py: a rank's registered process is found gone once it exits (zombie or reaped), and a
collective cut short by it raises one line naming that rank; no peers needed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

from fake_work import FailingWork
from runtime.transport import collective, liveness
from runtime.transport.p2p import PeerFailed, PeerGone


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> dist.Store:
    store = dist.HashStore()
    monkeypatch.setattr(liveness, "default_store", lambda: store)
    monkeypatch.setattr(liveness.dist, "get_rank", lambda group=None: 0)
    return store


def test_a_dead_process_is_gone_a_live_one_is_not(store: dist.Store) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while liveness._alive(child.pid) and child.poll() is None:
        pass
    assert not liveness._alive(child.pid)  # exited: a zombie until reaped, then no process at all
    child.wait()
    liveness.register()  # rank 0: this process, alive
    store.set("pipecut/alive/1", f"{socket.gethostname()} {child.pid}")
    store.set("pipecut/alive/2", f"another-host {os.getpid()}")  # cannot be checked from here
    assert liveness.gone([0, 1, 2, 3], settle=0.1) == [liveness.Gone(1, child.pid, socket.gethostname())]
    assert liveness.gone([0, 2, 3], settle=0.1) == []


def test_a_collective_cut_short_by_a_dead_peer_names_it_in_one_line(
    store: dist.Store, monkeypatch: pytest.MonkeyPatch,
) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    store.set("pipecut/alive/1", f"{socket.gethostname()} {child.pid}")
    monkeypatch.setattr(collective.dist, "get_rank", lambda group=None: 0)
    work = FailingWork("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    with pytest.raises(PeerGone) as err:
        collective.wait_bounded(work, timeout=30, what="the sum over ranks [0, 1]", group=[0, 1])
    assert str(err.value) == (
        f"rank 0: rank 1 (process {child.pid} on {socket.gethostname()}) is gone (its process exited), so "
        "the sum over ranks [0, 1] failed after 0.0 s; restart the job (from its last checkpoint), "
        "and read that rank's log or exit code for why it died"
    )
    assert err.value.ranks == (1,)
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_a_peer_not_found_gone_keeps_the_general_message(store: dist.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    store.set("pipecut/alive/1", f"{socket.gethostname()} {os.getpid()}")  # this process: alive
    monkeypatch.setattr(collective.dist, "get_rank", lambda group=None: 0)
    work = FailingWork("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    with pytest.raises(PeerFailed) as err:
        collective.wait_bounded(work, timeout=30, what="the sum", group=[0, 1])
    assert type(err.value) is PeerFailed
