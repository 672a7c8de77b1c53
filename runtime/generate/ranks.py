"""Where a generating pipeline's ranks run: a thread each in this process, or a process each under torch.distributed.

Legend: ``p`` pipeline ranks, ``r`` a rank's position in its pipeline, ``d`` data-parallel replicas,
``S`` the plan's stages, ``G`` groups.

The plan's ``S`` stages are dealt out to ``p`` ranks in contiguous runs of ``S / p`` (a rank's
stages run one after another on it; the hops between them stay in the rank). In threads the
ranks share a :class:`~runtime.transport.p2p.LocalTransport`; under torch.distributed world rank
``d * p + r`` is replica ``d``'s rank ``r``, each replica's ranks share a process group and a
:class:`~runtime.transport.p2p.DistTransport`, the replicas split the prompts, and every rank
returns the whole batch's tokens (one ``all_gather_object`` at the end).

Every rank runs its stages in the call's precision: autocast's state is per thread, so a rank on
a thread of its own enters the autocast itself (``precision``) rather than relying on the caller's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from runtime.generate.cut import StageSpan
from runtime.generate.errors import GenerateOptionError
from runtime.generate.parts import DecoderParts
from runtime.generate.pipelined import Batch, GroupResult, Step, run_rank
from runtime.generate.ring import Ring
from runtime.precision import MixedPrecision
from runtime.transport.p2p import DistTransport, LocalTransport, PeerFailed

__all__ = ["rank_spans", "Layout", "dist_layout", "run_threads", "run_dist"]

log = logging.getLogger(__name__)


def rank_spans(spans: Sequence[StageSpan], ranks: int) -> list[tuple[StageSpan, ...]]:
    """The plan's stages dealt to ``ranks`` pipeline ranks in contiguous runs.

    Raises:
        GenerateOptionError: ``ranks`` does not divide the stage count.

    Example:
        >>> from runtime.generate.cut import StageSpan
        >>> spans = [StageSpan(s, s == 0, range(s, s + 1), s == 3, s == 3) for s in range(4)]
        >>> [[s.index for s in run] for run in rank_spans(spans, 2)]
        [[0, 1], [2, 3]]
    """
    s = len(spans)
    if not isinstance(ranks, int) or ranks < 1 or s % ranks:
        raise GenerateOptionError(
            f"the plan's {s} stages cannot be dealt to {ranks!r} pipeline ranks in equal contiguous runs: use a "
            f"rank count that divides {s} (e.g. {s}), or plan the model for that many stages"
        )
    k = s // ranks
    return [tuple(spans[r * k:(r + 1) * k]) for r in range(ranks)]


class Layout:
    """This process's place in a ``d`` x ``p`` world: its replica, its pipeline position, its group.

    Attributes:
        replicas: ``d``; ranks: ``p``; replica: this rank's ``d``; position: this rank's ``r``.
        group: the process group of this replica's ``p`` ranks (``None``: the world, when ``d = 1``).
    """

    def __init__(self, replicas: int, ranks: int, replica: int, position: int,
                 group: dist.ProcessGroup | None) -> None:
        self.replicas, self.ranks, self.replica, self.position, self.group = replicas, ranks, replica, position, group


def dist_layout(replicas: int) -> Layout:
    """This process's :class:`Layout` in the initialised world, split into ``replicas`` pipelines.

    Every rank must call it (creating the replicas' groups is collective).

    Raises:
        GenerateOptionError: ``replicas`` does not divide the world size.
    """
    world, me = dist.get_world_size(), dist.get_rank()
    if not isinstance(replicas, int) or replicas < 1 or world % replicas:
        raise GenerateOptionError(
            f"dp={replicas!r} data-parallel replicas do not divide the {world} ranks: launch dp x pp ranks "
            f"(e.g. dp=1 for a {world}-rank pipeline)"
        )
    p = world // replicas
    group = None
    if replicas > 1:
        for d in range(replicas):  # every rank creates every group, in the same order
            made = dist.new_group(list(range(d * p, (d + 1) * p)))
            if d == me // p:
                group = made
    return Layout(replicas, p, me // p, me % p, group)


def run_threads(
    parts: DecoderParts, per_rank: Sequence[tuple[StageSpan, ...]], batch: Batch, groups: Sequence[range],
    timeout: float, precision: MixedPrecision | None = None, in_flight: int | None = None,
) -> tuple[dict[int, GroupResult], list[Step]]:
    """Run each pipeline rank on a thread of its own in this process; return the groups' results and what ran.

    ``in_flight``: how many of the ``groups`` run at once (default all; :func:`~runtime.generate.pipelined.run_rank`).

    A rank that fails closes the transport, so the others stop waiting at once; the first error is raised.
    Each thread runs its stages under ``precision``'s autocast (default: none): a caller's
    ``torch.autocast`` does not reach another thread, so the caller resolves it into ``precision``.

    Raises:
        TransportTimeout: a rank waited ``timeout`` seconds for a message.
        GenerateError, RuntimeError: the first rank's own error.
    """
    p = len(per_rank)
    transport = LocalTransport(dict.fromkeys(range(p), batch.ids.device), timeout=timeout)
    timelines: list[list[Step]] = [[] for _ in range(p)]
    results: dict[int, GroupResult] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()
    intra = torch.get_num_threads()

    def rank(r: int) -> None:
        # OpenMP's thread count is per thread: a new thread would start at the core count.
        torch.set_num_threads(intra)
        try:
            with _autocast(precision, batch.ids.device):
                got = run_rank(Ring(transport, r, p, batch.ids.device), parts, per_rank[r], batch, groups,
                               timelines[r], in_flight=in_flight)
            with lock:
                results.update(got)
        except BaseException as e:  # every failure reaches the caller, which raises the first
            with lock:
                errors.append(e)
            transport.close()

    threads = [threading.Thread(target=rank, args=(r,), name=f"pipecut-generate-rank{r}", daemon=True)
               for r in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    if any(t.is_alive() for t in threads):
        transport.close()
        raise PeerFailed(f"generation ranks {[r for r, t in enumerate(threads) if t.is_alive()]} did not finish "
                         f"within {timeout + 30:g} s after the transport's timeout; raise timeout= if a stage is slow")
    if errors:
        causes = [e for e in errors if not isinstance(e, PeerFailed)]
        raise (causes or errors)[0]
    return results, [s for tl in timelines for s in tl]


def run_dist(
    parts: DecoderParts, spans: Sequence[StageSpan], layout: Layout, batch: Batch, groups: Sequence[range],
    timeout: float, precision: MixedPrecision | None = None, in_flight: int | None = None,
) -> tuple[dict[int, GroupResult], list[Step]]:
    """Run this process's pipeline rank of its replica; return every replica's groups' results.

    Args:
        spans: this rank's stages.
        layout: this rank's place (:func:`dist_layout`).
        batch: the whole batch (the same on every rank).
        groups: this replica's groups, as rows of the whole batch.
        timeout: seconds any one message may take.
        precision: the autocast this rank's stages run under (default: none).
        in_flight: how many of the ``groups`` run at once (default all).

    Returns:
        Every group of every replica (numbered replica by replica), and this rank's steps.

    Raises:
        TransportTimeout: a message did not come in time (``PeerFailed`` when another rank failed).
    """
    transport = DistTransport(list(range(layout.ranks)), timeout=timeout, group=layout.group)
    ring = Ring(transport, layout.position, layout.ranks, batch.ids.device)
    timeline: list[Step] = []
    try:
        with _autocast(precision, batch.ids.device):
            mine = run_rank(ring, parts, spans, batch, groups, timeline, in_flight=in_flight)
        transport.wait_sends()
    except BaseException as e:
        transport.announce(e)
        raise
    finally:
        transport.close()
    # Every rank gets every replica's tokens: the first rank of each replica holds its own.
    payload: Any = None
    if layout.position == 0:
        payload = [(r.rows.start, r.rows.stop, r.tokens.cpu(), [x.cpu() for x in r.logits]) for r in mine.values()]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, payload)
    results: dict[int, GroupResult] = {}
    for part in gathered:
        for start, stop, tokens, logits in part or ():
            results[len(results)] = GroupResult(range(start, stop), tokens.to(batch.ids.device),
                                                tuple(x.to(batch.ids.device) for x in logits))
    return results, timeline


def _autocast(precision: MixedPrecision | None, device: torch.device) -> contextlib.AbstractContextManager[object]:
    return contextlib.nullcontext() if precision is None else precision.autocast(device)
