"""transport.py: messages arrive intact and in order, over threads and over gloo; waits are bounded."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from runtime.launch import LaunchError, spawn
from runtime.transport import DistTransport, Key, LocalTransport, TensorMeta, TransportTimeout

CPU = torch.device("cpu")


def test_local_transport_delivers_across_threads() -> None:
    tr = LocalTransport({0: CPU, 1: CPU}, timeout=10)
    sent = [torch.randn(3, 4), torch.arange(5)]
    got: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: got.extend(tr.recv(Key(0, 1, "act", 7), [], CPU)))
    t.start()
    tr.send(Key(0, 1, "act", 7), sent)
    t.join(5)
    assert not t.is_alive()
    for a, b in zip(got, sent):
        torch.testing.assert_close(a, b)
    assert tr.pending() == []


def test_local_transport_times_out_naming_the_message() -> None:
    tr = LocalTransport({0: CPU, 1: CPU}, timeout=0.2)
    with pytest.raises(TransportTimeout, match="gradients of micro-batch 2 from stage 1 to stage 0"):
        tr.recv(Key(1, 0, "grad", 2), [], CPU)


def test_local_transport_rejects_a_duplicate_send() -> None:
    tr = LocalTransport({0: CPU, 1: CPU})
    tr.send(Key(0, 1, "act", 0), [torch.zeros(1)])
    with pytest.raises(RuntimeError, match="sent twice"):
        tr.send(Key(0, 1, "act", 0), [torch.zeros(1)])


def _ping_pong(rank: int, world: int) -> list[float]:
    tr = DistTransport([0, 1], timeout=30)
    metas = [TensorMeta((2, 3), torch.float32), TensorMeta((4,), torch.int64)]
    out: list[float] = []
    for mb in range(3):
        if rank == 0:
            tr.send(Key(0, 1, "act", mb), [torch.full((2, 3), float(mb)), torch.arange(4) + mb])
            (g,) = tr.recv(Key(1, 0, "grad", mb), [TensorMeta((2, 3), torch.float32)], CPU)
            out.append(float(g.sum()))
        else:
            a, i = tr.recv(Key(0, 1, "act", mb), metas, CPU)
            assert i.tolist() == [mb, mb + 1, mb + 2, mb + 3]
            tr.send(Key(1, 0, "grad", mb), [a * 2])
    tr.wait_sends()
    return out


@pytest.mark.multiprocess
def test_dist_transport_over_gloo_round_trips() -> None:
    results = spawn(_ping_pong, 2, timeout=120)
    assert results[0] == [0.0, 12.0, 24.0]


def _never_sent(rank: int, world: int) -> None:
    tr = DistTransport([0, 1], timeout=2)
    if rank == 1:
        tr.recv(Key(0, 1, "act", 0), [TensorMeta((1,), torch.float32)], CPU)
    else:
        time.sleep(6)  # outlive rank 1's timeout, so its failure is the one reported


@pytest.mark.multiprocess
def test_dist_transport_wait_is_bounded() -> None:
    with pytest.raises(LaunchError, match="TransportTimeout"):
        spawn(_never_sent, 2, timeout=60)


def _send_then_receive_both(rank: int, world: int) -> list[float]:
    """1F1B's steady state on both ranks at once: send, then receive from the same peer.

    Grouped (NCCL's program), each rank's send goes out with its next receive as one group, and
    every work is waited once even though a group is waited by its receive and at the end.
    """
    tr = DistTransport([0, 1], timeout=20, grouped=True)
    assert tr.groups_messages and not tr.posts_receives
    meta = [TensorMeta((2, 2), torch.float32)]
    me, peer = rank, 1 - rank
    out: list[float] = []
    for mb in range(4):
        tr.send(Key(me, peer, "act", mb), [torch.full((2, 2), 10.0 * me + mb)])
        key = Key(peer, me, "act", mb)
        tr.post_group([(key, meta, CPU)])
        (got,) = tr.recv(key, meta, CPU)
        out.append(float(got[0, 0]))
    tr.send(Key(me, peer, "act", 99), [torch.zeros(2, 2)])  # held back...
    (last,) = tr.recv(Key(peer, me, "act", 99), meta, CPU)  # a bare recv posts what is held too
    tr.wait_sends()
    return [*out, float(last.sum())]


@pytest.mark.multiprocess
def test_grouped_dist_transport_pairs_sends_with_receives() -> None:
    results = spawn(_send_then_receive_both, 2, timeout=120)
    assert results[0] == [10.0, 11.0, 12.0, 13.0, 0.0]
    assert results[1] == [0.0, 1.0, 2.0, 3.0, 0.0]
