"""transport.py: messages arrive intact and in order, over threads and over gloo; waits are bounded."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
import torch

from fake_work import FailingWork
from rank_pool import LaunchError, spawn
from runtime.errors import InconsistentScheduleError
from runtime.transport import p2p
from runtime.transport.p2p import DistTransport, Key, LocalTransport, PeerFailed, TensorMeta, TransportTimeout

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
    with pytest.raises(TransportTimeout, match="gradients of micro-batch 2 from stage 1 to stage 0") as err:
        tr.recv(Key(1, 0, "grad", 2), [], CPU)
    assert type(err.value) is TransportTimeout
    assert str(err.value).startswith("no message within 0.2 s (the timeout)")


def test_local_transport_closed_while_waiting_says_another_stage_failed() -> None:
    tr = LocalTransport({0: CPU, 1: CPU}, timeout=30)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            tr.recv(Key(0, 1, "act", 3), [], CPU)
        except BaseException as e:  # handed to the test thread
            errors.append(e)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.2)
    tr.close()  # what the trainer does when a stage fails
    t.join(5)
    assert not t.is_alive()
    (e,) = errors
    assert isinstance(e, PeerFailed) and isinstance(e, TransportTimeout)
    m = re.fullmatch(
        r"stopped waiting for activations of micro-batch 3 from stage 0 to stage 1 after (\d+\.\d) s: "
        r"another stage failed.*",
        str(e),
    )
    assert m and float(m[1]) < 5, str(e)


def test_local_transport_rejects_a_duplicate_send() -> None:
    tr = LocalTransport({0: CPU, 1: CPU})
    tr.send(Key(0, 1, "act", 0), [torch.zeros(1)])
    with pytest.raises(RuntimeError, match="sent twice") as info:
        tr.send(Key(0, 1, "act", 0), [torch.zeros(1)])
    assert isinstance(info.value, InconsistentScheduleError)



def _unconnected_dist_transport(timeout: float) -> DistTransport:
    # Only the fields the error path reads: telling a timeout from a failure needs no peer.
    tr = DistTransport.__new__(DistTransport)
    tr._me, tr.timeout, tr._wait_for, tr.groups_messages, tr._waited = 1, timeout, timeout, False, {}
    return tr


@pytest.mark.parametrize(
    ("text", "delay", "timeout", "kind", "says"),
    [
        ("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234", 0.0, 30, PeerFailed,
         (r"^rank 1 stopped waiting for the send of gradients of micro-batch 4 from stage 1 to stage 0 "
          r"\(to rank 0\): peer rank 0 closed the connection after 0\.0 s, before the 30 s timeout")),
        ("[pair.cc:1] Read error [127.0.0.1]:1234: Connection reset by peer", 0.0, 30, PeerFailed,
         r"peer rank 0 closed the connection after 0\.0 s, before the 30 s timeout; rank 0 failed"),
        ("NCCL communicator was aborted on rank 0", 0.0, 30, PeerFailed,
         (r"the process group failed after 0\.0 s \(NCCL communicator was aborted on rank 0\), before the "
          r"30 s timeout; another rank failed")),
        ("[unbound_buffer.cc:129] Timed out waiting 300ms for send operation", 0.3, 0.3, TransportTimeout,
         r"did not complete within 0\.3 s \(the timeout\); rank 0 did not receive it"),
        ("[unbound_buffer.cc:129] Timed out waiting 10ms for send operation", 0.0, 30, TransportTimeout,
         r"did not complete within 0\.0 s, the process group's own timeout \(Timed out waiting 10ms"),
        (None, 0.2, 0.2, TransportTimeout, r"did not complete within 0\.2 s \(the timeout\)"),
    ],
)
def test_dist_transport_tells_a_failed_peer_from_a_timeout(
    text: str | None, delay: float, timeout: float, kind: type[Exception], says: str
) -> None:
    tr = _unconnected_dist_transport(timeout)
    with pytest.raises(TransportTimeout, match=says) as err:
        tr._wait(FailingWork(text, delay), Key(1, 0, "grad", 4), 0, sending=True)  # type: ignore[arg-type]
    assert type(err.value) is kind
    if text is not None:
        assert isinstance(err.value.__cause__, RuntimeError) and str(err.value.__cause__) == text


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


def _never_sent(rank: int, world: int, gave_up: str) -> None:
    tr = DistTransport([0, 1], timeout=2)
    if rank == 1:
        try:
            tr.recv(Key(0, 1, "act", 0), [TensorMeta((1,), torch.float32)], CPU)
        finally:
            Path(gave_up).touch()
    else:  # outlive rank 1's timeout, so its failure is the one reported
        deadline = time.monotonic() + 50
        while not Path(gave_up).exists() and time.monotonic() < deadline:
            time.sleep(0.05)


@pytest.mark.multiprocess
def test_dist_transport_wait_is_bounded(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="TransportTimeout") as err:
        spawn(_never_sent, 2, str(tmp_path / "rank-1-gave-up"), timeout=60)
    assert re.search(
        r"TransportTimeout: rank 1 got no message within 2 s \(the timeout\) while waiting for "
        r"activations of micro-batch 0 from stage 0 to stage 1 \(from rank 0\); rank 0 is stuck",
        str(err.value),
    ), str(err.value)
    assert "PeerFailed" not in str(err.value)


def _peer_leaves_early(rank: int, world: int, grouped: bool) -> tuple[str, str, float] | None:
    # The general message, for a peer not found gone (on another host, or still exiting): whether
    # rank 0's process has exited by then is a race here; test_bounded_collectives kills one.
    p2p.gone_error = lambda *args, **kwargs: None
    torch.set_num_threads(1)
    tr = DistTransport([0, 1], timeout=30, grouped=grouped)
    if rank == 0:
        time.sleep(1.0)
        return None  # spawn destroys rank 0's process group: its connections close
    start = time.monotonic()
    try:
        tr.recv(Key(0, 1, "act", 0), [TensorMeta((1,), torch.float32)], CPU)
    except TransportTimeout as e:
        cause = "PeerFailed" if isinstance(e, PeerFailed) else "TransportTimeout"
        return cause, str(e), time.monotonic() - start
    finally:
        tr.close()
    raise AssertionError("rank 1 received a message rank 0 never sent")


@pytest.mark.multiprocess
@pytest.mark.parametrize("grouped", [False, True])
def test_dist_transport_says_the_peer_closed_well_before_the_timeout(grouped: bool) -> None:
    _, got = spawn(_peer_leaves_early, 2, grouped, timeout=60)
    assert got is not None
    cause, message, waited = got
    assert cause == "PeerFailed"
    who = "a peer" if grouped else "peer rank 0"
    m = re.fullmatch(
        r"rank 1 stopped waiting for activations of micro-batch 0 from stage 0 to stage 1 \(from rank 0\): "
        rf"{who} closed the connection after (\d+\.\d) s, before the 30 s timeout; .* failed or exited early.*",
        message,
    )
    assert m, message
    assert float(m[1]) < 10 and waited < 10  # rank 0 left after 1 s; the timeout is 30 s


def _peer_already_gone(rank: int, world: int) -> str | None:
    # The general message, for a peer not found gone (on another host, or still exiting): whether
    # rank 0's process has exited by then is a race here; test_bounded_collectives kills one.
    p2p.gone_error = lambda *args, **kwargs: None
    torch.set_num_threads(1)
    tr = DistTransport([0, 1], timeout=30)
    if rank == 0:
        return None  # leaves at once: its process group is destroyed, its connections closed
    time.sleep(1.0)
    try:
        tr.recv(Key(0, 1, "grad", 2), [TensorMeta((1,), torch.float32)], CPU)
    except PeerFailed as e:
        return str(e)
    finally:
        tr.close()
    raise AssertionError("rank 1 received a message rank 0 never sent")


@pytest.mark.multiprocess
def test_dist_transport_says_the_peer_had_gone_when_posting() -> None:
    _, message = spawn(_peer_already_gone, 2, timeout=60)
    assert message is not None and message.startswith(
        "rank 1 could not post the receive of gradients of micro-batch 2 from stage 0 to stage 1 "
        "(from rank 0): peer rank 0 had already closed the connection; rank 0 failed or exited early"
    ), message


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
