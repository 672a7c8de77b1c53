"""The layout search: how to spend ``N`` devices on a fixed global batch, priced and ranked.

Legend: ``N`` devices, ``dp`` replicas of the pipeline, ``pp`` ranks per pipeline, ``tp`` devices per
pipeline rank (a tensor-parallel group inside a node; ``dp * pp * tp = N``),
``v`` stages per rank (2 for interleaved and ZB-V), ``S = v * pp`` stages, ``b`` rows per
micro-batch, ``m = B / (dp * b)`` micro-batches per replica per step, ``B`` the global batch.

A *layout* is ``(dp, pp, tp, schedule, b, zero)``. Each is priced by a caller-given function (the
exact cut for its stage count and memory, one simulated step, the data-parallel exchange the
drain does not hide, the optimizer step: ``partitioner.search``); this module only enumerates
the space, orders it, prunes it and ranks the results, on plain data.

Pruning keeps the answer exact under the cost model. Every layout first gets two cheap numbers
from the caller: whether its training state alone can fit (the state of all parameters over
``pp`` ranks, its sharded part over ``dp``: no cut holds less), and a lower bound on its step
time (every rank's share of the work, and the dependency chain of one micro-batch, plus the
optimizer step). Layouts are priced in order of their bound; once a bound exceeds the
``top``-th best priced step time (by more than the tie margin), no layout left can enter the
ranking, and they are listed as not priced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from partitioner.errors import InfeasibleMemoryError, PartitionError, TooManyStagesError
from partitioner.plan.units import fmt_bytes, fmt_time
from partitioner.schedule.registry import TRAINING_SCHEDULES, stages_per_rank

__all__ = ["Option", "Layout", "ZERO_OPTIONS", "DEFAULT_ZERO", "TIE", "layout_space", "search", "pick", "divisors"]

log = logging.getLogger(__name__)

# How the replicas shard the training state: not at all, the optimizer state (ZeRO-1), or weights,
# gradients and optimizer state with FSDP2 (``fully_shard`` over the "dp" group, ZeRO-3).
ZERO_OPTIONS = ("none", "zero1", "fsdp")
# What the search tries unless told: FSDP's time price is optimistic on CPU processes and not yet
# checked on GPUs (docs/reference/layout-search.md, "FSDP, and what it assumes"), so it is asked for, zero=ZERO_OPTIONS.
DEFAULT_ZERO = ("none", "zero1")
TIE = 0.01  # layouts within 1% of the best step time are ties


@dataclass(frozen=True, order=True)
class Option:
    """One point of the space, before it is priced.

    Example:
        >>> Option(dp=2, pp=2, schedule="1f1b", microbatch_size=4, zero="none", global_batch=32).microbatches
        4
    """

    dp: int
    pp: int
    schedule: str
    microbatch_size: int
    zero: str
    global_batch: int
    tp: int = 1

    @property
    def stages(self) -> int:
        """``S = v * pp``: the schedule's stages per rank times the ranks per pipeline."""
        return self.pp * stages_per_rank(self.schedule)

    @property
    def microbatches(self) -> int:
        """``m``: micro-batches each replica runs per step."""
        return self.global_batch // (self.dp * self.microbatch_size)

    @property
    def devices(self) -> int:
        """``dp * pp * tp``."""
        return self.dp * self.pp * self.tp

    def label(self) -> str:
        """``'dp2 x pp4 1f1b b4 m8 zero1'`` (``'dp2 x pp4 x tp8 ...'`` with tensor parallelism)."""
        z = f" {self.zero}" if self.zero != "none" else ""
        t = f" x tp{self.tp}" if self.tp > 1 else ""
        return f"dp{self.dp} x pp{self.pp}{t} {self.schedule} b{self.microbatch_size} m{self.microbatches}{z}"


@dataclass(frozen=True)
class Layout:
    """A priced layout: how a job spends its devices, and what the cost model says it does.

    Attributes:
        dp: replicas of the pipeline.
        pp: ranks per pipeline.
        stages: stages cut (``pp`` times the schedule's stages per rank).
        schedule: the pipeline schedule.
        microbatch_size: rows per micro-batch, ``b``.
        microbatches: micro-batches per replica per step, ``m``.
        global_batch: rows per optimizer step over all replicas, ``B = dp * m * b``.
        zero: sharding over the replicas: ``'none'``, ``'zero1'`` (the optimizer state) or
            ``'fsdp'`` (FSDP2: weights, gradients and optimizer state; see ``partitioner.search``).
        step_time: predicted seconds per optimizer step: ``pipeline_time + exchange_time +
            optimizer_time`` (0 when not priced).
        pipeline_time: the simulated pipeline: every micro-batch's forward and backward.
        exchange_time: the part of the gradient exchange (and, sharded, the parameters'
            broadcast after the step) that the pipeline's drain does not hide.
        optimizer_time: the optimizer step (with clipping) on the fullest rank.
        bubble: idle fraction of the pipeline's device time.
        memory: the fullest rank's peak bytes: its training state and activations in flight.
        capacity: the smallest device's memory.
        exchange_bytes: bytes the busiest rank sends per step for the data-parallel exchange.
        recompute: stages that recompute their activations.
        tokens_per_row: tokens in one row (sequence length) when the input is token ids, else 0.
        fits: whether it fits every device (priced and within memory).
        priced: whether it was priced (``False``: pruned by its bound, or its state cannot fit).
        note: why it does not fit, or how it compares to the chosen one.
        gather_time: with ``fsdp``, the seconds a rank spends per step all-gathering weights before
            its forwards and backwards, on average over a pipeline's ranks: part of
            ``pipeline_time``'s busy share (0 otherwise).
        tp: devices per pipeline rank, a tensor-parallel group inside one node (1: none).
        allreduce_time: with ``tp > 1``, the seconds a rank spends per step in the tensor-parallel
            all-reduces (forward, backward and recomputed forward), on average over a pipeline's
            ranks: part of ``pipeline_time``'s busy share (0 otherwise).

    Example:
        >>> lay = Layout(2, 2, 2, "1f1b", 4, 4, 32, "none", 2.0, 1.5, 0.3, 0.2, 0.1, 5e9, 8e9,
        ...              1e8, 0, tokens_per_row=128, fits=True, priced=True)
        >>> lay.samples_per_s, lay.tokens_per_s, lay.devices
        (16.0, 2048.0, 4)
    """

    dp: int
    pp: int
    stages: int
    schedule: str
    microbatch_size: int
    microbatches: int
    global_batch: int
    zero: str
    step_time: float
    pipeline_time: float
    exchange_time: float
    optimizer_time: float
    bubble: float
    memory: float
    capacity: float
    exchange_bytes: float
    recompute: int
    tokens_per_row: int = 0
    fits: bool = False
    priced: bool = False
    note: str = ""
    gather_time: float = 0.0
    tp: int = 1
    allreduce_time: float = 0.0

    @property
    def devices(self) -> int:
        """``dp * pp * tp``."""
        return self.dp * self.pp * self.tp

    @property
    def samples_per_s(self) -> float:
        """Rows trained per second (0 when not priced)."""
        return self.global_batch / self.step_time if self.step_time > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Tokens trained per second (0 when the rows are not token sequences or not priced)."""
        return self.samples_per_s * self.tokens_per_row

    @property
    def option(self) -> Option:
        return Option(self.dp, self.pp, self.schedule, self.microbatch_size, self.zero, self.global_batch, self.tp)

    def label(self) -> str:
        return self.option.label()

    @staticmethod
    def unpriced(option: Option, capacity: float, note: str, *, memory: float = 0.0, step_time: float = 0.0) -> Layout:
        """A row for a layout that was not priced (``step_time``: its lower bound, if known)."""
        return Layout(
            option.dp, option.pp, option.stages, option.schedule, option.microbatch_size, option.microbatches,
            option.global_batch, option.zero, step_time, 0.0, 0.0, 0.0, 0.0, memory, capacity, 0.0, 0,
            fits=False, priced=False, note=note, tp=option.tp,
        )


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending.

    Example:
        >>> divisors(12)
        [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_space(
    devices: int,
    global_batch: int,
    *,
    schedules: Sequence[str] = TRAINING_SCHEDULES,
    microbatch_sizes: Sequence[int] | None = None,
    zero: Sequence[str] = DEFAULT_ZERO,
    max_stages: int | None = None,
    dp_sizes: Sequence[int] | None = None,
    tp_sizes: Sequence[int] = (1,),
    pp_sizes: Sequence[int] | None = None,
) -> list[Option]:
    """Every layout of ``devices`` devices for a global batch of ``global_batch`` rows.

    For each ``tp`` of ``tp_sizes`` that divides the devices (checked against the model and the nodes
    by ``partitioner.tensor.sizes.tp_sizes``), the ``devices / tp`` pipeline ranks are spent as
    ``dp x pp``: ``dp`` divides both them and the batch (``dp_sizes``, ``pp_sizes``: only those); ``b``
    divides the replica's rows (``microbatch_sizes``: only those; default: every divisor); ``zero1``
    and ``fsdp`` only with ``dp > 1``; a single-rank pipeline (``pp = 1``) takes only the schedules
    with one stage per rank, and stage counts above ``max_stages`` (the model's units) are left out;
    ``fsdp`` only with ``tp = 1`` (the runtime does not compose FSDP2 with tp yet).

    Example:
        >>> [o.label() for o in layout_space(2, 4, schedules=("1f1b",), zero=("none",))]
        ['dp1 x pp2 1f1b b1 m4', 'dp1 x pp2 1f1b b2 m2', 'dp1 x pp2 1f1b b4 m1', 'dp2 x pp1 1f1b b1 m2', \
'dp2 x pp1 1f1b b2 m1']
    """
    out: list[Option] = []
    for tp in sorted(set(tp_sizes)):
        if devices % tp:
            continue
        ranks = devices // tp
        for dp in divisors(ranks):
            pp, rows = ranks // dp, global_batch // dp
            if global_batch % dp or (dp_sizes is not None and dp not in dp_sizes) or (
                    pp_sizes is not None and pp not in pp_sizes):
                continue
            sizes = [b for b in divisors(rows) if microbatch_sizes is None or b in microbatch_sizes]
            for sched in schedules:
                v = stages_per_rank(sched)
                if (pp == 1 and v > 1) or (max_stages is not None and pp * v > max_stages):
                    continue
                for b in sizes:
                    for z in zero:
                        if (z != "none" and dp == 1) or (z == "fsdp" and tp > 1):
                            continue
                        out.append(Option(dp, pp, sched, b, z, global_batch, tp))
    return out


# bound(option) -> (lower bound on its step time, why it cannot fit or None, its state bytes per rank)
Bound = Callable[[Option], tuple[float, str | None, float]]
# price(option) -> the priced layout (fits or not); may raise a PartitionError it cannot be cut
Price = Callable[[Option], Layout]


def search(
    options: Iterable[Option], price: Price, bound: Bound, *, capacity: float, top: int = 5, prune: bool = True
) -> list[Layout]:
    """Price the options (in order of their bound, skipping what cannot enter the ``top``) and rank them.

    Returns:
        Every option as a row: the priced ones that fit, fastest first; then the priced ones
        that do not fit; then those not priced (their state cannot fit, or their bound says
        they cannot rank). With ``prune=False`` every option whose state can fit is priced (the
        brute force the tests compare with).
    """
    bounded = []
    rows: list[Layout] = []
    for o in options:
        lb, impossible, state = bound(o)
        if impossible is not None:
            rows.append(Layout.unpriced(o, capacity, impossible, memory=state))
        else:
            bounded.append((lb, o))
    bounded.sort(key=lambda x: (x[0], x[1]))
    fitting: list[float] = []  # step times of the priced layouts that fit, ascending
    priced = 0
    for lb, o in bounded:
        if prune and len(fitting) >= top and lb > fitting[top - 1] * (1 + TIE):
            rows.append(Layout.unpriced(o, capacity, "not priced: its lower bound is slower than the ranked ones",
                                        step_time=lb))
            continue
        try:
            lay = price(o)
        except (InfeasibleMemoryError, TooManyStagesError) as e:
            rows.append(Layout.unpriced(o, capacity, _why(e)))
            continue
        except PartitionError as e:  # a schedule that cannot run this size, say
            rows.append(Layout.unpriced(o, capacity, str(e).split(". ")[0]))
            continue
        priced += 1
        rows.append(lay)
        if lay.fits:
            fitting.append(lay.step_time)
            fitting.sort()
    log.info("layout search: %d layouts, %d priced, %d fit", len(rows), priced, len(fitting))
    return rank(rows)


def rank(rows: Sequence[Layout]) -> list[Layout]:
    """Fitting rows by step time (ties as :func:`pick` breaks them), then the rest."""
    fit = sorted((r for r in rows if r.fits), key=_order)
    priced = sorted((r for r in rows if r.priced and not r.fits), key=lambda r: (r.memory, r.option))
    rest = sorted((r for r in rows if not r.priced), key=lambda r: (r.step_time == 0, r.step_time, r.option))
    return fit + priced + rest


def _order(r: Layout) -> tuple[float, int, int, int, int, int]:
    return (r.step_time, r.pp, r.tp, -r.microbatch_size, TRAINING_SCHEDULES.index(r.schedule) if r.schedule in
            TRAINING_SCHEDULES else 99, ZERO_OPTIONS.index(r.zero) if r.zero in ZERO_OPTIONS else 99)


def pick(rows: Sequence[Layout]) -> tuple[Layout, str]:
    """The chosen layout and a sentence saying why.

    Layouts within ``TIE`` of the fastest are ties, broken towards fewer pipeline ranks (fewer
    hand-offs, a smaller bubble if the estimate is off), then less tensor parallelism (fewer
    all-reduces), then larger micro-batches, then the
    simpler schedule, then the least sharding (none, ZeRO-1, FSDP).

    Raises:
        InfeasibleMemoryError: no layout fits.

    Example:
        >>> a = Layout(1, 4, 4, "1f1b", 1, 8, 8, "none", 1.0, 1, 0, 0, .2, 1, 2, 0, 0, fits=True, priced=True)
        >>> b = Layout(2, 2, 2, "1f1b", 1, 4, 8, "none", 1.005, 1, 0, 0, .1, 1, 2, 0, 0, fits=True, priced=True)
        >>> pick([a, b])[0].dp    # within 1%: fewer pipeline ranks win
        2
    """
    fit = [r for r in rows if r.fits]
    if not fit:
        needed = [r.memory for r in rows if r.memory > 0]
        cap = max((r.capacity for r in rows), default=0.0)
        raise InfeasibleMemoryError(
            [min(needed)] if needed else [float("inf")], [cap],
            f"No layout fits the devices (tried {len(rows)}: every dp x pp x tp, micro-batch size, schedule "
            "and sharding).",
        )
    fastest = min(r.step_time for r in fit)
    ties = [r for r in fit if r.step_time <= fastest * (1 + TIE)]
    best = min(ties, key=lambda r: _order(r)[1:])
    why = (
        f"{best.label()}: {fmt_time(best.step_time)} per step (pipeline {fmt_time(best.pipeline_time)}, "
        f"exchange {fmt_time(best.exchange_time)}, optimizer {fmt_time(best.optimizer_time)}), "
        f"bubble {best.bubble:.1%}, peak memory {fmt_bytes(best.memory)} of {fmt_bytes(best.capacity)}"
    )
    if len(ties) > 1:
        why += f"; {len(ties) - 1} other layout(s) within 1% (ties: fewer pipeline ranks, larger micro-batches win)"
    return best, why


def explain(rows: Sequence[Layout], best: Layout) -> list[Layout]:
    """The rows with each priced one's note saying how it compares to ``best`` (what it loses on)."""
    out = []
    for r in rows:
        if r is best or r == best:
            out.append(replace(r, note="chosen"))
        elif r.fits:
            out.append(replace(r, note=_loses_on(r, best)))
        elif r.priced and not r.note:
            out.append(replace(r, note=f"does not fit: peak {fmt_bytes(r.memory)} > {fmt_bytes(r.capacity)}"))
        else:
            out.append(r)
    return out


def _loses_on(r: Layout, best: Layout) -> str:
    slower = r.step_time / best.step_time - 1 if best.step_time > 0 else 0.0
    terms = {
        "bubble": r.pipeline_time * r.bubble - best.pipeline_time * best.bubble,
        "compute": (r.pipeline_time * (1 - r.bubble) - r.gather_time - r.allreduce_time
                    - best.pipeline_time * (1 - best.bubble) + best.gather_time + best.allreduce_time),
        "FSDP gathers": r.gather_time - best.gather_time,
        "tp all-reduces": r.allreduce_time - best.allreduce_time,
        "exchange": r.exchange_time - best.exchange_time,
        "optimizer": r.optimizer_time - best.optimizer_time,
    }
    term, extra = max(terms.items(), key=lambda kv: kv[1])
    if slower <= TIE:
        return f"tie ({slower:+.1%})"
    return f"{slower:+.1%}: {term} +{fmt_time(extra)}" if extra > 0 else f"{slower:+.1%}"


def _why(e: Exception) -> str:
    if isinstance(e, TooManyStagesError):
        return "more stages than units"
    return "no cut fits memory, even recomputing"
