"""The ranks of one job agree on the step before they send: one small all-gather per new setting.

Legend: ``m`` micro-batches, ``S`` stages.

Under torch.distributed no rank tells another the shapes it sends: every rank computes them from
the plan, its micro-batch count, its precision and the batch it was given. When two ranks
disagree (rank 0 built its trainer with ``microbatches=4`` and rank 1 with 2, or rank 0 steps
with 8 rows and rank 1 with 12) the messages do not fit: gloo aborts the process ("Received data
size doesn't match expected size"), NCCL hangs. :class:`StepAgreement` checks first: each rank
hashes what its step depends on, the ranks all-gather the 8-byte hashes (bounded by the trainer's
``timeout``), and when they differ every rank gathers the readable values and raises
:class:`~runtime.errors.RankDisagreementError` naming each rank's values and the fix.

The check runs once per new setting (a new batch shape, or ``predict`` after ``step``): an
agreed hash is remembered, so a training loop of one batch shape pays for one all-gather in all.
Only a rank that meets a setting for the first time checks, so a disagreement that first shows
at a shape the other ranks have already agreed on is not caught here: it ends in the transport's
bounded ``TransportTimeout`` instead.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from runtime.errors import RankDisagreementError
from runtime.transport.collective import group_ranks, wait_bounded
from runtime.transport.process_group import comm_device

if TYPE_CHECKING:
    from partitioner.plan.plan import Plan
    from partitioner.schedule.ir import Schedule

__all__ = ["StepAgreement", "step_facts", "disagreement"]


class _Precision(Protocol):
    # What the check reads of ``runtime.precision.MixedPrecision`` (a room above this one).
    @property
    def name(self) -> str: ...

    @property
    def cast_activations(self) -> bool: ...

# What to do about each fact that differs, by the fact's first word.
_FIXES = {
    "micro-batches": "build every rank's trainer with the same microbatches= (Execution(microbatches=...))",
    "schedule": "build every rank's trainer with the same schedule=, and call step(), forward_backward() or "
                "predict() on every rank together",
    "plan": "give every rank the same plan: partition once and Plan.save / Plan.load it, or partition the "
            "same model with the same options everywhere",
    "precision": "build every rank's trainer with the same precision=, and call it under the same "
                 "torch.autocast (or none) on every rank",
    "input": "give every rank a batch of the same sizes: each rank of a pipeline takes the whole batch, and "
             "with data parallelism each replica its equal share (trainer.local_batch(x, y))",
}


class StepAgreement:
    """Checks, once per new setting, that every rank of the job runs the same step.

    Args:
        plan: the trainer's plan (its graph fingerprint and stage boundaries are compared).
        precision: the trainer's precision (it sets the dtypes on the wire).
        timeout: seconds the all-gather may wait for the other ranks.
        group: the ranks that must agree (default: the whole job, every replica included).

    Example (on every rank, before a step sends anything)::

        agreement = StepAgreement(plan, precision, timeout=300)
        agreement.check(schedule, micro_inputs)  # raises RankDisagreementError on every rank
    """

    def __init__(
        self, plan: Plan, precision: _Precision, timeout: float, group: dist.ProcessGroup | None = None,
    ) -> None:
        self.timeout, self.group = timeout, group
        stages = json.dumps([list(st.nodes) for st in plan.stages])
        self._setup = {
            "plan": f"{len(plan.stages)} stages, graph {plan.fingerprint[:12]}, boundaries "
                    f"{hashlib.sha256(stages.encode()).hexdigest()[:12]}",
            "precision": _precision_text(precision),
        }
        self._agreed: set[int] = set()

    def check(
        self, schedule: Schedule, microbatches: Sequence[Mapping[str, Any]], precision: _Precision | None = None,
    ) -> None:
        """Every rank runs ``schedule`` over micro-batches of these sizes (collective, the first
        time this rank meets them), in ``precision`` (default: the trainer's; a caller's autocast
        changes it for a call, ``runtime.precision.CallerAutocast``).

        Raises:
            RankDisagreementError: a rank runs another schedule, micro-batch count, plan,
                precision or batch size (on every rank, with each rank's values).
            PeerFailed: a rank failed or exited before it joined the check.
            TransportTimeout: a rank did not join it within ``timeout``.
        """
        if not dist.is_initialized() or dist.get_world_size(self.group) < 2:
            return
        facts = {**step_facts(schedule, microbatches), **self._setup}
        if precision is not None:
            facts["precision"] = _precision_text(precision)
        digest = _digest(facts)
        if digest in self._agreed:
            return
        ranks = group_ranks(self.group)
        mine = torch.tensor([digest], dtype=torch.int64, device=comm_device())
        gathered = [torch.empty_like(mine) for _ in ranks]
        work = dist.all_gather(gathered, mine, group=self.group, async_op=True)
        mine_text = ", ".join(f"{k} {v}" for k, v in facts.items() if k not in self._setup)
        # A rank that agreed on its setting before does not check again: say what this one ran.
        wait_bounded(work, timeout=self.timeout, what=f"the check that ranks {ranks} run the same step as this "
                     f"one ({mine_text}; a rank that ran its own sizes before does not check them again)")
        if all(int(g.item()) == digest for g in gathered):
            self._agreed.add(digest)
            return
        # They differ: every rank saw the same hashes, so every rank gathers the values (once).
        everyone: list[Any] = [None] * len(ranks)
        dist.all_gather_object(everyone, facts, group=self.group)
        raise RankDisagreementError(disagreement(dict(zip(ranks, everyone)), dist.get_rank()))


def step_facts(schedule: Schedule, microbatches: Sequence[Mapping[str, Any]]) -> dict[str, str | int]:
    """What the messages of a step depend on, readable: the schedule, ``m``, and each tensor
    input's batch shape and dtype (``{'input 'x'': '(8, 16) float32', ...}``)."""
    facts: dict[str, str | int] = {
        "schedule": f"{schedule.name or 'unnamed'} on {schedule.num_ranks} ranks",
        "micro-batches": len(microbatches),
    }
    for name, x in (microbatches[0].items() if microbatches else ()):
        if isinstance(x, torch.Tensor):
            shape = (x.shape[0] * len(microbatches), *x.shape[1:]) if x.dim() else ()
            facts[f"input {name!r}"] = f"{tuple(shape)} {str(x.dtype).removeprefix('torch.')}"
    return facts


def disagreement(by_rank: Mapping[int, Mapping[str, Any]], me: int) -> str:
    """The message for ranks whose facts differ: each differing fact with every rank's value, and
    the fix for each.

    Example:
        >>> print(disagreement({0: {"micro-batches": 4}, 1: {"micro-batches": 2}}, 0))
        ... # doctest: +NORMALIZE_WHITESPACE
        rank 0: the ranks of this job disagree on the step they run, so the messages between
        them would not fit (gloo aborts, NCCL hangs); nothing of this step was sent:
          micro-batches: 4 on rank 0; 2 on rank 1
          Fix: build every rank's trainer with the same microbatches= (Execution(microbatches=...))
    """
    keys = list(dict.fromkeys(k for facts in by_rank.values() for k in facts))
    lines = [(
        f"rank {me}: the ranks of this job disagree on the step they run, so the messages between them "
        "would not fit (gloo aborts, NCCL hangs); nothing of this step was sent:"
    )]
    fixes: list[str] = []
    for key in keys:
        groups: dict[str, list[int]] = {}
        for rank, facts in by_rank.items():
            groups.setdefault(str(facts.get(key, "(none)")), []).append(rank)
        if len(groups) < 2:
            continue
        lines.append(f"  {key}: " + "; ".join(f"{value} on {_ranks(rs)}" for value, rs in groups.items()))
        fix = _FIXES.get(key.split()[0], "")
        if fix and fix not in fixes:
            fixes.append(fix)
    lines += [f"  Fix: {fix}" for fix in fixes]
    return "\n".join(lines)


def _precision_text(precision: _Precision) -> str:
    return precision.name + ("" if precision.cast_activations else " (activations uncast)")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _digest(facts: Mapping[str, Any]) -> int:
    """A signed 64-bit hash of ``facts`` (the same on every rank for the same values)."""
    blob = json.dumps(facts, sort_keys=True).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little", signed=True)
