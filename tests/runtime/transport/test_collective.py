"""``wait_bounded`` tells a collective that failed early (``PeerFailed``) from one that ran out of
time (``TransportTimeout``), as the point-to-point transport does; no peers needed."""

from __future__ import annotations

import pytest

from fake_work import FailingWork
from runtime.transport import collective
from runtime.transport.p2p import PeerFailed, TransportTimeout


@pytest.mark.parametrize(
    ("text", "delay", "timeout", "kind", "says"),
    [
        ("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234", 0.0, 30, PeerFailed,
         (r"^rank 1: the sum failed after 0\.0 s \(Connection closed by peer .*\), before the 30 s timeout; "
          r"another rank failed or exited")),
        ("[unbound_buffer.cc:129] Timed out waiting 300ms for recv operation", 0.0, 30, TransportTimeout,
         r"^rank 1: the sum did not complete within 30 s \(the timeout; waited 0\.0 s\)"),
        (None, 0.2, 0.2, TransportTimeout,
         r"^rank 1: the sum did not complete within 0\.2 s \(the timeout; waited 0\.2 s\)"),
    ],
)
def test_a_failed_peer_is_told_from_a_timeout(
    monkeypatch: pytest.MonkeyPatch, text: str | None, delay: float, timeout: float, kind: type[Exception],
    says: str,
) -> None:
    monkeypatch.setattr(collective.dist, "get_rank", lambda group=None: 1)
    with pytest.raises(TransportTimeout, match=says) as err:
        collective.wait_bounded(FailingWork(text, delay), timeout=timeout, what="the sum")
    assert type(err.value) is kind


def test_no_work_returns_at_once() -> None:
    collective.wait_bounded(None, timeout=0.0, what="nothing")
