"""The processes of a ``pipecut generate`` job: their ``dp x pp`` layout, their checks together, their errors.

Legend: ``p`` pipeline ranks (``--pp``), ``d`` data-parallel replicas (``--dp``), ``W`` the world size.

In one process the job is one rank. Under torchrun (``WORLD_SIZE`` > 1) every process joins the
job's process group with ``--timeout`` as the group's own timeout, so no collective waits longer,
and ``W`` must be ``d x p``. Every rank then runs the same steps; where one rank could fail while
the others go on (reading the files, loading its own stages), the ranks check together that every
one got through (:func:`agree`), so a failure on one rank ends every rank at that point, each with
one line naming the rank that failed. A failure while generating reaches the other ranks through
the pipeline's messages (``PeerFailed``, quoting the failing rank's error), or ends their wait
after ``--timeout``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch.distributed as dist

from partitioner.errors import CliArgumentError, PipecutError
from runtime.transport.process_group import ensure_process_group, world_split

__all__ = ["GenerateJobError", "Job", "job_layout", "agree", "together", "one_line_errors"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class GenerateJobError(PipecutError, RuntimeError):
    """A rank of a ``pipecut generate`` job under torchrun failed, or learned that another did (one line, naming it)."""


@dataclass(frozen=True)
class Job:
    """This process's place in the job.

    Attributes:
        world: ``W``; rank: this process's global rank; pp: ``p``; dp: ``d``.
    """

    world: int
    rank: int
    pp: int
    dp: int

    @property
    def leader(self) -> bool:
        """Whether this process writes the completions, the progress and the summary (global rank 0)."""
        return self.rank == 0


def job_layout(pp: int | None, dp: int | None, *, timeout: float) -> Job:
    """This process's :class:`Job`: joins the process group under torchrun and checks ``dp x pp`` against it.

    Args:
        pp: ``--pp`` (default: ``W / dp`` under torchrun, 1 in one process).
        dp: ``--dp`` (default: ``W / pp`` under torchrun, 1 in one process).
        timeout: seconds any collective may wait (the process group's timeout).

    Raises:
        CliArgumentError: ``dp > 1`` in one process (with the torchrun command to run), or
            ``dp x pp`` is not the world size.

    Example:
        >>> job_layout(2, None, timeout=60)  # one process
        Job(world=1, rank=0, pp=2, dp=1)
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        ensure_process_group(timeout=timeout)
    grouped = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if grouped else 1
    rank = dist.get_rank() if grouped else 0
    if world == 1:
        if dp not in (None, 1):
            ranks = dp * (pp or 1)
            raise CliArgumentError(
                f"--dp {dp} runs {dp} replicas of the pipeline, a process per pipeline rank, and this is one process: "
                f"launch torchrun --standalone --nproc-per-node {ranks} -m pipecut generate ... --pp {pp or 1} "
                f"--dp {dp}, or drop --dp"
            )
        return Job(1, 0, pp or 1, 1)
    pp, dp = world_split(world, pp, dp)
    if not pp or not dp or pp * dp != world:
        raise CliArgumentError(
            f"the job has {world} processes, which is not --dp x --pp (dp {dp or '?'}, pp {pp or '?'}): give --pp "
            f"and --dp whose product is {world}, or launch torchrun --nproc-per-node with their product"
        )
    return Job(world, rank, pp, dp)


def agree(job: Job, what: str, error: BaseException | None) -> None:
    """Every rank learns whether every rank got through ``what`` (collective: every rank calls it).

    The rank that failed raises its own ``error``; the others raise a :class:`GenerateJobError`
    naming the first rank that failed and its error. In one process, ``error`` is raised as it is.

    Raises:
        GenerateJobError: another rank failed ``what``, or did not come to the check (it exited,
            or the process group's timeout ran out).
    """
    if job.world == 1:
        if error is not None:
            raise error
        return
    mine = None if error is None else f"{type(error).__name__}: {flat(str(error))}"
    gathered: list[str | None] = [None] * job.world
    try:
        dist.all_gather_object(gathered, mine)
    except RuntimeError as e:  # a rank gone (connection closed), or the group's timeout
        if error is not None:
            raise error from None
        raise GenerateJobError(
            f"rank {job.rank}: the check that every rank got through {what} failed ({flat(str(e))[:200]}): another "
            "rank failed or exited before it; its own error is the cause to read"
        ) from e
    if error is not None:
        raise error
    failed = [(r, text) for r, text in enumerate(gathered) if text is not None]
    if failed:
        first, text = failed[0]
        also = f" (ranks {[r for r, _ in failed]} failed)" if len(failed) > 1 else ""
        raise GenerateJobError(f"rank {job.rank}: rank {first} failed {what}{also}: {text}")


def together(job: Job, what: str, step: Callable[[], T]) -> T:
    """Run ``step`` on every rank and :func:`agree` on it: its value when every rank got through.

    Raises:
        GenerateJobError: another rank failed ``step`` (this rank's own error is raised as it is).

    Example:
        >>> together(Job(1, 0, 1, 1), "adding", lambda: 1 + 1)
        2
    """
    try:
        value = step()
    except Exception as e:
        agree(job, what, e)
        raise  # agree raised already; for the type checker
    agree(job, what, None)
    return value


@contextlib.contextmanager
def one_line_errors(job: Job) -> Iterator[None]:
    """Under torchrun, any error of this rank as one :class:`GenerateJobError` line that names the rank.

    Several ranks write to one terminal, and a traceback from each would bury the cause: every
    error (the pipeline's ``PeerFailed``, a backend's ``RuntimeError``) becomes one line. In one
    process errors pass as they are.
    """
    if job.world == 1:
        yield
        return
    try:
        yield
    except GenerateJobError:
        raise
    except Exception as e:
        log.debug("rank %d failed", job.rank, exc_info=True)
        raise GenerateJobError(f"rank {job.rank}: {type(e).__name__}: {flat(str(e))}") from e


def flat(text: str) -> str:
    """``text`` on one line: its lines joined with ``'; '``.

    Example:
        >>> flat("rank 0 stopped waiting\\n  The first rank to fail reported: rank 1 failed")
        'rank 0 stopped waiting; The first rank to fail reported: rank 1 failed'
    """
    return "; ".join(line.strip() for line in text.strip().splitlines() if line.strip())
