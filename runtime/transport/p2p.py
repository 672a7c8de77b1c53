"""Moving activations and gradients between stages: in one process, or over torch.distributed.

Legend: ``s`` a stage index, ``mb`` a micro-batch index. A *message* is the list of tensors one
stage sends another for one micro-batch and direction (activations forward, gradients back).

Both transports have the same contract, so the executor runs unchanged over either:

* ``send`` never blocks: the tensors are handed off (in-process) or posted (``isend``);
* ``recv`` blocks until the message is there, at most ``timeout`` seconds, then raises
  ``TransportTimeout`` naming what it waited for; a wait cut short because the peer closed the
  connection (or another stage failed), and a message posted after the peer had gone, raise its
  subclass ``PeerFailed`` at once, saying so and after how long;
* the distributed transport needs no handshake: shapes and dtypes come from the plan. On gloo
  each message has its own tag, so a rank may read the messages from a peer in another order
  than the peer sent them (interleaved and V-shaped placements do); NCCL ignores tags and
  matches messages between two ranks in posting order, so there both must post in the same
  order (GPipe, 1F1B and ZB-H1 do; ``partitioner.schedule.comm.needs_early_receives`` tells);
* a transport may ask for receives ahead of time (``posts_receives``): the executor then calls
  ``prefetch`` for the next few messages, in the order it will ``recv`` them.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from partitioner.errors import PipecutError
from runtime.errors import InconsistentScheduleError, ProcessGroupError
from runtime.transport.liveness import default_store as _store
from runtime.transport.liveness import gone, register

__all__ = [
    "Key", "TensorMeta", "Transport", "LocalTransport", "DistTransport", "TransportTimeout", "PeerFailed",
    "PeerGone", "gone_error", "announced_failure",
]

log = logging.getLogger(__name__)


class TransportTimeout(PipecutError, RuntimeError):
    """A wait for a message (or for a send to complete) ended without it.

    Raised as is when nothing came within the transport's ``timeout`` (or the process group's
    own timeout ran out first); a wait cut short by a failure raises the subclass ``PeerFailed``.
    """


class PeerFailed(TransportTimeout):
    """A wait ended before its timeout: the peer closed the connection, or another stage failed.

    This rank's error is a consequence; the failing rank's (or stage's) own error is the one to
    read. It subclasses ``TransportTimeout`` so that code catching that still catches this.
    """


class PeerGone(PeerFailed):
    """A wait ended early because a peer's process is gone (killed, crashed, exited): one line
    naming that rank (``runtime.transport.liveness``).

    Attributes:
        ranks: the global ranks found gone.
    """

    def __init__(self, message: str, *, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


def gone_error(me: int, what: str, elapsed: float, peers: Sequence[int]) -> PeerGone | None:
    """The one-line error for a wait on ``what`` that failed after ``elapsed`` s because one of
    ``peers`` is gone, or ``None`` when none of them is found gone (see ``liveness.gone``) or
    when a rank announced its own failure: that error (a ``PeerFailed`` quoting it) says more
    than "its process exited"."""
    if announced_failure(me):
        return None
    dead = gone([r for r in peers if r != me])
    if not dead or announced_failure(me):  # again: an announcement can land while its process exits
        return None
    names = ", ".join(str(d) for d in dead)
    verb = "is" if len(dead) == 1 else "are"
    return PeerGone(
        f"rank {me}: {names} {verb} gone (its process exited), so {what} failed after {elapsed:.1f} s; "
        "restart the job (from its last checkpoint), and read that rank's log or exit code for why it died",
        ranks=[d.rank for d in dead],
    )


# How gloo ("Timed out waiting 1000ms") and NCCL's watchdog ("... before timing out") say that a
# wait ran out of time, as opposed to failing early.
_TIMED_OUT = re.compile(r"tim(ed|ing) ?out", re.IGNORECASE)
# How gloo says that the other end of a connection went away.
_CLOSED = re.compile(r"closed by peer|reset by peer|connection closed", re.IGNORECASE)


@dataclass(frozen=True)
class Key:
    """Names one message: from stage ``src`` to stage ``dst``, ``kind`` 'act' or 'grad', for ``mb``."""

    src: int
    dst: int
    kind: str
    mb: int

    def __str__(self) -> str:
        what = "activations" if self.kind == "act" else "gradients"
        return f"{what} of micro-batch {self.mb} from stage {self.src} to stage {self.dst}"


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a tensor on the wire, known ahead of time from the plan."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class Transport(ABC):
    """Moves tensor messages between stages; see the module docstring for the contract."""

    timeout: float
    #: Whether receives posted ahead of time (``prefetch``) make this transport faster.
    posts_receives: bool = False

    @abstractmethod
    def send(self, key: Key, tensors: Sequence[torch.Tensor]) -> None:
        """Post a message; returns at once. The tensors must not be modified afterwards."""

    @abstractmethod
    def recv(self, key: Key, metas: Sequence[TensorMeta], device: torch.device) -> list[torch.Tensor]:
        """Wait for a message and return its tensors on ``device``."""

    def prefetch(self, key: Key, metas: Sequence[TensorMeta], device: torch.device) -> None:
        """Post the receive of ``key`` now; the later ``recv(key)`` waits for it.

        Prefetches must come in the order the ``recv`` calls will, per peer. The default does
        nothing (the message is received when asked for).
        """

    #: Whether sends are held back and posted with the next receives as one group (``post_group``).
    groups_messages: bool = False

    def post_group(self, recvs: Sequence[tuple[Key, Sequence[TensorMeta], torch.device]]) -> None:
        """Post the held-back sends and the receives of ``recvs`` together (before an action).

        Only for transports with ``groups_messages``; the default does nothing.
        """

    def wait_sends(self) -> None:
        """Block until every posted send has completed (called at the end of a step)."""

    def close(self) -> None:
        """Release resources; the transport is unusable afterwards."""


class LocalTransport(Transport):
    """All stages in this process: a thread-safe mailbox keyed by message.

    Each receiver gets tensors already on its device; a send to a stage on another device copies
    there at send time, so the receiving thread never waits on a copy it could not overlap.

    Args:
        devices: device of every stage.
        timeout: seconds a ``recv`` may wait.
    """

    def __init__(self, devices: Mapping[int, torch.device], timeout: float = 300.0) -> None:
        self.devices = dict(devices)
        self.timeout = timeout
        self._box: dict[Key, list[torch.Tensor]] = {}
        self._cv = threading.Condition()
        self._closed = False

    def send(self, key: Key, tensors: Sequence[torch.Tensor]) -> None:
        dev = self.devices[key.dst]
        moved = [t.detach().to(dev, non_blocking=True) for t in tensors]
        with self._cv:
            if key in self._box:
                raise InconsistentScheduleError(
                    f"{key} was sent twice without being received; the schedule is inconsistent"
                )
            self._box[key] = moved
            self._cv.notify_all()

    def recv(self, key: Key, metas: Sequence[TensorMeta], device: torch.device) -> list[torch.Tensor]:
        start = time.monotonic()
        deadline = start + self.timeout
        with self._cv:
            while key not in self._box:
                left = deadline - time.monotonic()
                if self._closed:
                    raise PeerFailed(
                        f"stopped waiting for {key} after {time.monotonic() - start:.1f} s: another "
                        "stage failed and the transport was closed; that stage's error is the cause"
                    )
                if left <= 0:
                    raise TransportTimeout(
                        f"no message within {self.timeout:g} s (the timeout) while waiting for {key}; "
                        "the sending stage is stuck or the schedules disagree (raise timeout= if a "
                        "stage is just slow)"
                    )
                self._cv.wait(left)
            return self._box.pop(key)

    def has(self, key: Key) -> bool:
        """Whether ``key`` has arrived and not been received yet."""
        with self._cv:
            return key in self._box

    def pending(self) -> list[Key]:
        """Messages sent but not received (empty after a consistent step)."""
        with self._cv:
            return list(self._box)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._box.clear()
            self._cv.notify_all()


class DistTransport(Transport):
    """Point-to-point over torch.distributed (gloo on CPU, NCCL on GPUs), one rank per stage group.

    Messages are posted as ``isend`` / ``irecv`` per tensor (NCCL: one ``batch_isend_irecv`` per
    message); receive buffers are allocated from the plan's shapes, so no per-step metadata
    exchange is needed. Every wait is bounded by ``timeout``.

    A message between two stages of this rank (interleaved and V-shaped placements) does not
    touch the network: it is handed over in process, as by ``LocalTransport``.

    On gloo, receives are posted ahead of time (``posts_receives``): gloo only sends a message
    once the receiver has asked for it, and a message posted before its receive arrives about
    2 ms later than one whose receive was already waiting (32 KiB and up, loopback). NCCL runs
    the point-to-point operations between two ranks one after another on one stream, so an
    early receive there would hold back every later send to that peer: it posts on demand.

    On NCCL a send may also wait until its peer receives, so two ranks that each send and then
    receive (1F1B's steady state) would wait for each other. There sends are grouped
    (``groups_messages``): an action's sends are held back and posted together with the next
    action's receives as one ``batch_isend_irecv`` (``post_group``, called by the executor
    before each action; a bare ``recv`` or ``wait_sends`` posts what is held too). That is the
    program ``partitioner.schedule.comm.grouped_program_finishes`` checks; the trainer refuses on NCCL the
    plans where it could wait in a circle (``runtime.transport.placement.check_backend``).

    Args:
        stage_to_rank: rank of every stage.
        timeout: seconds a receive (or the final wait for sends) may take.
        group: the process group (default: the world).
        grouped: group sends with the next receives (default: on NCCL only; ``True`` on gloo
            runs the same program, for tests).
    """

    def __init__(
        self, stage_to_rank: Sequence[int], timeout: float = 300.0, group: dist.ProcessGroup | None = None,
        *, grouped: bool | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise ProcessGroupError(
                "torch.distributed is not initialised: launch with torchrun (or call "
                "dist.init_process_group) before building a distributed pipeline"
            )
        self.stage_to_rank = tuple(stage_to_rank)
        self.timeout = timeout
        self.group = group
        self.rank = dist.get_rank(group)
        self._me = dist.get_rank()
        gloo = dist.get_backend(group) == "gloo"
        self.groups_messages = (not gloo) if grouped is None else grouped
        self.posts_receives = gloo and not self.groups_messages
        self._held: list[tuple[Key, list[torch.Tensor], int]] = []  # sends waiting for post_group
        # Works already waited for. A group's works are waited by its first receive and again at
        # wait_sends; gloo counts waits on a send (a second wait expects a second send), so each
        # work is waited once.
        self._waited: dict[int, dist.Work] = {}  # id -> the work, kept alive so ids stay unique
        self._peers = tuple(
            rank if group is None else dist.get_global_rank(group, rank) for rank in self.stage_to_rank
        )
        self._wait_for = timedelta(seconds=timeout)
        register()  # so that peers whose waits fail can tell whether this process is gone
        self._sends: deque[tuple[Key, list[dist.Work], list[torch.Tensor]]] = deque()
        self._posted: dict[Key, tuple[list[dist.Work], list[torch.Tensor], int]] = {}
        self._own: dict[Key, list[torch.Tensor]] = {}  # messages between stages of this rank

    def _peer(self, stage: int) -> int:
        return self._peers[stage]

    def send(self, key: Key, tensors: Sequence[torch.Tensor]) -> None:
        peer = self._peers[key.dst]
        if peer == self._me:
            if key in self._own:
                raise InconsistentScheduleError(
                    f"{key} was sent twice without being received; the schedule is inconsistent"
                )
            self._own[key] = [t.detach() for t in tensors]
            return
        bufs = [t.detach().contiguous() for t in tensors]
        if self.groups_messages:
            self._held.append((key, bufs, peer))
            return
        tag = self._tag(key)
        with self._posting(f"the send of {key} (to rank {peer})", peer):
            works = [w for t in bufs if (w := dist.isend(t, peer, group=self.group, tag=tag)) is not None]
        self._sends.append((key, works, bufs))
        self._reap()

    def post_group(self, recvs: Sequence[tuple[Key, Sequence[TensorMeta], torch.device]]) -> None:
        ops: list[dist.P2POp] = []
        sends = []
        for key, bufs, peer in self._held:
            ops += [dist.P2POp(dist.isend, t, peer, self.group, self._tag(key)) for t in bufs]
            sends.append((key, bufs))
        self._held.clear()
        posted = []
        for key, metas, device in recvs:
            peer = self._peers[key.src]
            if peer == self._me or key in self._posted:
                continue
            bufs = [torch.empty(m.shape, dtype=m.dtype, device=device) for m in metas]
            ops += [dist.P2POp(dist.irecv, t, peer, self.group, self._tag(key)) for t in bufs]
            posted.append((key, bufs, peer))
        if not ops:
            return
        # One group: waiting for any of its messages waits for the whole group (NCCL may return
        # a single work for it), which is the program comm_plan checks.
        with self._posting(f"{len(ops)} grouped sends and receives", None):
            works = [w for w in dist.batch_isend_irecv(ops) if w is not None]
        for key, bufs in sends:
            self._sends.append((key, works, bufs))
        for key, bufs, peer in posted:
            self._posted[key] = (works, bufs, peer)
        self._reap()

    def prefetch(self, key: Key, metas: Sequence[TensorMeta], device: torch.device) -> None:
        if self._peers[key.src] == self._me:
            return
        if key in self._posted:
            raise InconsistentScheduleError(f"the receive of {key} was posted twice; the schedule is inconsistent")
        self._posted[key] = self._post_recv(key, metas, device)

    def recv(self, key: Key, metas: Sequence[TensorMeta], device: torch.device) -> list[torch.Tensor]:
        if self._peers[key.src] == self._me:
            if key not in self._own:
                raise InconsistentScheduleError(
                    f"rank {self.rank} reads {key} before running the action that makes it; "
                    "the schedule's order on this rank is inconsistent"
                )
            return [t.to(device) for t in self._own.pop(key)]
        if self.groups_messages and key not in self._posted:
            self.post_group([(key, metas, device)])
        posted = self._posted.pop(key, None)
        works, bufs, peer = posted if posted is not None else self._post_recv(key, metas, device)
        for w in works:
            self._wait(w, key, peer, sending=False)
        return bufs

    def _post_recv(
        self, key: Key, metas: Sequence[TensorMeta], device: torch.device
    ) -> tuple[list[dist.Work], list[torch.Tensor], int]:
        peer = self._peers[key.src]
        bufs = [torch.empty(m.shape, dtype=m.dtype, device=device) for m in metas]
        tag = self._tag(key)
        with self._posting(f"the receive of {key} (from rank {peer})", peer):
            works = [w for t in bufs if (w := dist.irecv(t, peer, group=self.group, tag=tag)) is not None]
        return works, bufs, peer

    def _tag(self, key: Key) -> int:
        # One tag per message: gloo pairs a receive with the send of the same tag, whatever the
        # order (a message's tensors share it and keep their order). NCCL ignores tags.
        S = len(self.stage_to_rank)
        return ((key.mb * S + key.src) * S + key.dst) * 2 + (key.kind == "grad")

    def wait_sends(self) -> None:
        if self._held:
            self.post_group([])
        for key, works, _ in self._sends:
            for w in works:
                self._wait(w, key, self._peers[key.dst], sending=True)
        self._sends.clear()
        self._waited.clear()

    def _reap(self) -> None:
        # Drop references to sends that finished, so their buffers can be freed early. Sends
        # complete roughly in posting order, so looking at the oldest ones is enough.
        sends = self._sends
        while sends and all(w.is_completed() for w in sends[0][1]):
            sends.popleft()

    @contextmanager
    def _posting(self, what: str, peer: int | None) -> Iterator[None]:
        # gloo refuses to post a message to or from a peer that has already closed the
        # connection; that is the same failure as a wait cut short, so it gets the same error.
        try:
            yield
        except RuntimeError as e:
            if not _CLOSED.search(str(e)):
                raise
            named = gone_error(self._me, f"posting {what}", 0.0, self._peers if peer is None else [peer])
            if named is not None:
                raise named from None
            who, culprit = ("a peer", "that peer") if peer is None else (f"peer rank {peer}", f"rank {peer}")
            first = self._announced()
            raise PeerFailed(
                f"rank {self._me} could not post {what}: {who} had already closed the connection; "
                f"{culprit} failed or exited early, and its own error is the cause to read"
                + (f"\n  The first rank to fail reported: {first}" if first else "")
            ) from e

    def _wait(self, work: dist.Work, key: Key, peer: int, *, sending: bool) -> None:
        if id(work) in self._waited:
            return
        start = time.monotonic()
        try:
            ok = work.wait(self._wait_for)
        except RuntimeError as e:
            raise self._wait_failed(key, peer, sending, time.monotonic() - start, e) from e
        if ok is False:
            raise self._wait_failed(key, peer, sending, time.monotonic() - start, None)
        if self.groups_messages:
            self._waited[id(work)] = work

    def _wait_failed(
        self, key: Key, peer: int, sending: bool, elapsed: float, error: RuntimeError | None
    ) -> TransportTimeout:
        """``_wait_error``, quoting the first failing rank's own error when one was announced."""
        err = self._wait_error(key, peer, sending, elapsed, error)
        if isinstance(err, PeerFailed):
            what = f"the send of {key} (to rank {peer})" if sending else f"{key} (from rank {peer})"
            named = gone_error(self._me, what, elapsed, self._peers if self.groups_messages else [peer])
            if named is not None:
                return named
        first = self._announced()
        return PeerFailed(f"{err}\n  The first rank to fail reported: {first}") if first else err

    def _wait_error(
        self, key: Key, peer: int, sending: bool, elapsed: float, error: RuntimeError | None
    ) -> TransportTimeout:
        """The error for a wait on ``key`` that ended after ``elapsed`` s without its message.

        torch.distributed raises a plain ``RuntimeError`` both when a wait runs out of time and
        when the connection fails, so the two are told apart by the backend's text and by the
        time waited: a wait that ended before the timeout without saying it timed out was cut
        short by a failure.
        """
        me = f"rank {self._me}"
        what = f"the send of {key} (to rank {peer})" if sending else f"{key} (from rank {peer})"
        reason = _reason(error) if error is not None else "the wait returned False"
        if error is None or _TIMED_OUT.search(str(error)) is not None or elapsed >= self.timeout:
            if elapsed >= 0.95 * self.timeout:
                within = f"within {self.timeout:g} s (the timeout)"
                fix = "raise timeout= if a stage is just slow"
            else:  # a shorter timeout of the process group itself ran out first
                within = f"within {elapsed:.1f} s, the process group's own timeout ({reason})"
                fix = "raise the process group's timeout, init_process_group(timeout=...), too"
            if sending:
                return TransportTimeout(
                    f"{me}: {what} did not complete {within}; rank {peer} did not receive it: it is "
                    f"stuck or slow, or the ranks' schedules disagree ({fix})"
                )
            return TransportTimeout(
                f"{me} got no message {within} while waiting for {what}; rank {peer} is stuck or "
                f"slow, or the ranks' schedules disagree ({fix})"
            )
        # A grouped work covers the messages to and from several peers: the one that closed may
        # be another than the one this message is with.
        if self.groups_messages:
            who, culprit = "a peer", "that peer"
        else:
            who, culprit = f"peer rank {peer}", f"rank {peer}"
        if _CLOSED.search(str(error)):
            failure = f"{who} closed the connection after {elapsed:.1f} s"
        else:
            failure = f"the process group failed after {elapsed:.1f} s ({reason})"
            culprit = "another rank"
        return PeerFailed(
            f"{me} stopped waiting for {what}: {failure}, before the {self.timeout:g} s timeout; "
            f"{culprit} failed or exited early, and its own error is the cause to read"
        )

    def announce(self, error: BaseException) -> None:
        """Record in the job's store that this rank failed with ``error`` (the first record wins).

        Peers whose waits then fail (the connection closes when this process exits) or time
        out quote it, so every rank's error names the rank that failed first and why.
        """
        store = _store()
        if store is None:
            return
        text = f"rank {self._me} failed: {type(error).__name__}: {error}"[:_ANNOUNCED_CHARS]
        try:
            store.compare_set(_FAILURE_KEY, "", text)  # sets only if no rank has yet
        except Exception:
            log.debug("could not record rank %d's failure in the store", self._me, exc_info=True)

    def _announced(self) -> str:
        """What the first failing rank recorded (see ``announce``), or ``''``."""
        return announced_failure(self._me)

    def close(self) -> None:
        self._sends.clear()
        self._held.clear()
        self._waited.clear()
        self._posted.clear()
        self._own.clear()


# The store key a failing rank records its error under, and how much of the error it keeps.
_FAILURE_KEY = "pipecut/first-failure"
_ANNOUNCED_CHARS = 1500


def announced_failure(me: int) -> str:
    """What the first rank to fail recorded in the job's store (``DistTransport.announce``), or
    ``''`` when none did or that rank is ``me``."""
    store = _store()
    if store is None:
        return ""
    try:
        if not store.check([_FAILURE_KEY]):
            return ""
        text = store.get(_FAILURE_KEY).decode(errors="replace")
    except Exception:
        return ""
    return "" if text.startswith(f"rank {me} failed") else text


def _reason(error: BaseException) -> str:
    """The first line of a backend error, without gloo's ``[path/file.cc:123]`` prefix."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", text)[:200]
