"""Why a job does not fit: its training state against every device's usable memory, and what would fit.

Legend: ``N`` devices, ``dp`` replicas, ``pp = N / dp`` ranks per pipeline, ``P`` parameters,
``s`` training-state bytes per parameter, ``U`` a device's usable memory (its capacity less the
reserve, ``DeviceSpec.usable_memory``).

Whatever the cut and the schedule, a rank holds at least its share of the training state: ``P s /
pp`` with its weights and optimizer state whole, less with the replicas sharding them
(``partitioner.plan.sharding``). The least of that over the layouts a search may take is a floor no
activation, micro-batch size or schedule lowers, and ``P s`` against ``N U`` is the bound no layout
at all escapes. When a job is refused, :func:`explain` says that bound with its numbers, and what
each change would bring the floor to: FSDP, fewer state bytes (bf16 states, a smaller optimizer),
more devices. Pure: plain numbers in, text out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from partitioner.cost.devices import Cluster
from partitioner.errors import InfeasibleMemoryError
from partitioner.plan.sharding import state_per_param
from partitioner.plan.units import fmt_bytes, fmt_count

__all__ = ["StateBound", "STATE_BYTES_OPTIONS", "explain", "refused"]

# Smaller training states a user can choose (``--state-bytes``), with what each stands for; the
# default 16 is fp32 weights and gradients and AdamW's two fp32 moments.
STATE_BYTES_OPTIONS: tuple[tuple[float, str], ...] = (
    (12.0, "bf16 weights and gradients with fp32 Adam moments, or fp32 SGD with momentum"),
    (10.0, "an 8-bit Adam over fp32 weights and gradients"),
    (8.0, "bf16 weights, gradients and Adam moments, or fp32 SGD without momentum"),
)


@dataclass(frozen=True)
class StateBound:
    """A job's training state and the devices it must fit, as plain numbers.

    Attributes:
        params: parameters of the model, each tensor once (tied ones too), ``P``.
        state_bytes_per_param: bytes of weights, gradients and optimizer state per parameter, ``s``.
        devices: devices of the job, ``N``.
        device: their name, for the text.
        memory: a device's capacity, bytes.
        reserve: what of it the plan leaves free, bytes (``DeviceSpec.memory_reserve``).
        dp_sizes: the replica counts the job may take (``(1,)``: one pipeline over every device).
        zero: the shardings over the replicas it may take (``partitioner.plan.layout.ZERO_OPTIONS``).
        max_pp: the most pipeline ranks the model cuts into (its units), if fewer than ``N``.
        gathered: with ``fsdp``, the gathered weights every rank holds on top (bytes).

    Example:
        >>> b = StateBound(params=70e9, state_bytes_per_param=16, devices=8, device="H100-80GB",
        ...                memory=80 * 2**30, reserve=4 * 2**30)
        >>> round(b.needed / 2**30), b.usable / 2**30, b.floor()[0] > b.usable
        (1043, 76.0, True)
    """

    params: float
    state_bytes_per_param: float
    devices: int
    device: str
    memory: float
    reserve: float
    dp_sizes: tuple[int, ...] = (1,)
    zero: tuple[str, ...] = ("none",)
    max_pp: int | None = None
    gathered: float = 0.0

    @staticmethod
    def of(
        cluster: Cluster, params: float, state_bytes_per_param: float, *, dp_sizes: tuple[int, ...] = (1,),
        zero: tuple[str, ...] = ("none",), max_pp: int | None = None, gathered: float = 0.0,
    ) -> StateBound:
        """The bound of ``params`` parameters on ``cluster``'s devices (its smallest device's memory and
        reserve), the layouts taking ``dp_sizes``, ``zero``, ``max_pp`` and ``gathered`` (the fields').

        Example:
            >>> StateBound.of(Cluster.uniform(4, "H100-80GB"), 1e9, 16.0).usable / 2**30
            74.0
        """
        least = min(cluster.devices, key=lambda d: d.usable_memory)
        names = list(dict.fromkeys(d.name for d in cluster.devices))
        return StateBound(params=params, state_bytes_per_param=state_bytes_per_param, devices=len(cluster),
                          device=names[0] if len(names) == 1 else "devices", memory=least.memory,
                          reserve=least.memory_reserve, dp_sizes=dp_sizes, zero=zero, max_pp=max_pp,
                          gathered=gathered)

    @property
    def usable(self) -> float:
        """``U``: a device's memory less its reserve."""
        return self.memory - self.reserve

    @property
    def needed(self) -> float:
        """``P s``: the whole training state, bytes."""
        return self.params * self.state_bytes_per_param

    def floor(self, *, zero: tuple[str, ...] | None = None) -> tuple[float, str]:
        """The least training state any allowed layout puts on its fullest rank, and that layout.

        Returns:
            ``(bytes per device, 'dp2 x pp4 zero1')``; ``(inf, '')`` when no layout is allowed.
        """
        best, label = math.inf, ""
        for dp in self.dp_sizes:
            pp = self.devices // dp
            if dp * pp != self.devices or (self.max_pp is not None and pp > self.max_pp):
                continue
            for z in zero or self.zero:
                if z != "none" and dp == 1:
                    continue
                state = self.params * state_per_param(self.state_bytes_per_param, z, dp) / pp
                state += self.gathered if z == "fsdp" else 0.0
                if state < best:
                    best, label = state, f"dp{dp} x pp{pp}{'' if z == 'none' else ' ' + z}"
        return best, label

    def devices_needed(self) -> int:
        """The fewest devices of this kind whose usable memory holds the whole state: ``ceil(P s / U)``."""
        return max(1, math.ceil(self.needed / self.usable)) if self.usable > 0 else 0


def explain(bound: StateBound) -> str:
    """The bound a job breaks, with its numbers, and what each change would bring it to.

    Example:
        >>> b = StateBound(params=70e9, state_bytes_per_param=16, devices=8, device="H100-80GB",
        ...                memory=80 * 2**30, reserve=4 * 2**30, dp_sizes=(1, 2, 4, 8), zero=("none", "zero1"))
        >>> text = explain(b)
        >>> "needs 1.0 TiB (70.0B parameters x 16 bytes)" in text, "at least 14 x H100-80GB" in text
        (True, True)
    """
    b, usable = bound, fmt_bytes(bound.usable)
    each = f"{usable} each: {fmt_bytes(b.memory)} less a {fmt_bytes(b.reserve)} reserve" if b.reserve else \
        f"{usable} each, no reserve"
    total = b.devices * b.usable
    text = (
        f"The training state alone needs {fmt_bytes(b.needed)} ({fmt_count(b.params)} parameters x "
        f"{b.state_bytes_per_param:g} bytes) and the {b.devices} x {b.device} hold {fmt_bytes(total)} usable "
        f"({each})"
    )
    floor, where = b.floor()
    if b.needed > total:
        text += ": no layout holds it, before any activation."
    elif floor <= b.usable:
        text += (f"; the layouts allowed put at least {fmt_bytes(floor)} of it on a device ({where}), which fits: "
                 "the activations of the micro-batches in flight on top of it do not.")
    elif math.isfinite(floor):
        text += (f"; the layouts allowed put at least {fmt_bytes(floor)} of it on a device ({where}), "
                 "before activations.")
    else:
        text += "."
    options: list[str] = []
    if "fsdp" not in b.zero and any(dp > 1 for dp in b.dp_sizes):
        fsdp, at = b.floor(zero=("fsdp",))
        options.append(f"with --zero fsdp (weights and optimizer state over the replicas; gradients stay whole): "
                       f"{_verdict(fsdp, at, b.usable)}")
    for s, what in STATE_BYTES_OPTIONS:
        if s < b.state_bytes_per_param:
            less, at = replace(b, state_bytes_per_param=s).floor()
            options.append(f"with --state-bytes {s:g} ({what}): {_verdict(less, at, b.usable)}")
    k = b.devices_needed()
    if k > b.devices:
        options.append(f"with more devices: at least {k} x {b.device} hold the state alone, spread over all of them "
                       f"({fmt_bytes(b.needed / k)} per device; activations need more)")
    if options:
        text += "\nWhat would change it (the state per device at the least, before activations):" + "".join(
            f"\n  - {o}" for o in options)
    return text


def _verdict(state: float, where: str, usable: float) -> str:
    if not math.isfinite(state):
        return "no layout allows it"
    fits = "fits the state" if state <= usable else "still too much"
    return f"{fmt_bytes(state)} per device of {fmt_bytes(usable)} ({where}: {fits})"


def refused(e: InfeasibleMemoryError, bound: StateBound, head: str | None = None) -> InfeasibleMemoryError:
    """``e`` (or ``head`` in place of its text) followed by :func:`explain`'s bound and options;
    its ``needed`` and ``available`` kept."""
    return InfeasibleMemoryError(e.needed, e.available, message=f"{head or e}\n{explain(bound)}")
