"""The caller's ``torch.autocast`` around a trainer call: carried into the stages, or refused.

autocast's state is thread-local, and the in-process transport runs each rank's stages on a
thread of its own: a user's ``with torch.autocast("cpu", dtype=torch.bfloat16): trainer.step(x, y)``
would reach none of them, and the pipeline would train in fp32 while the plain model under the
same ``with`` computes in bf16. So every call that runs stages (``step``, ``forward_backward``,
``predict``) reads the caller's autocast state first, on the device types of the stages, and maps
it onto the trainer's own precision machinery (``runtime.precision``) rather than re-entering it
per thread: a ``MixedPrecision`` of that dtype with ``cast_activations=False``, whose wire dtypes
are the dtypes the plain model's values have under that autocast. The stages then compute what
the plain model computes under the caller's autocast (the loss too), whichever transport runs
them, the messages between ranks agree on their dtypes, and a recomputing stage replays it.

A trainer built with a low precision already (``precision='bf16'``) under the caller's autocast
of the same dtype runs as built. One of another dtype is refused (:class:`AutocastConflictError`)
before anything runs: mixing two policies silently would give neither's numerics.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from runtime.precision import PRECISIONS, MixedPrecision, PrecisionError

__all__ = ["AutocastConflictError", "CallPrecision", "CallerAutocast", "caller_policy"]

log = logging.getLogger(__name__)

_NAMES = {dtype: name for name, dtype in PRECISIONS.items() if dtype is not None}


class AutocastConflictError(PrecisionError):
    """The caller's ``torch.autocast`` around a trainer call cannot be honoured: its dtype differs
    from the trainer's ``precision=``, it is on for some of the stages' device types only, or its
    dtype is not one pipecut runs in."""


def caller_policy(policy: MixedPrecision, device_types: Iterable[str], *, what: str = "this call") -> MixedPrecision:
    """The policy a call runs with: ``policy``, or the caller's autocast as one.

    Args:
        policy: the trainer's precision.
        device_types: the device types the stages run on (``'cpu'``, ``'cuda'``).
        what: the call, for messages (``'step()'``).

    Returns:
        ``policy`` when autocast is off on every device type of the stages, or on in
        ``policy``'s own dtype (its cache flag taken from the caller); else, for a trainer in
        fp32, ``MixedPrecision(<the caller's dtype>, cast_activations=False)``.

    Raises:
        AutocastConflictError: autocast is on in another low dtype than ``policy``'s, on some
            of the stages' device types only, or in a dtype pipecut does not run in.

    Example:
        >>> caller_policy(MixedPrecision("fp32"), ["cpu"]).name
        'fp32'
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     mp = caller_policy(MixedPrecision("fp32"), ["cpu"])
        >>> mp.name, mp.cast_activations
        ('bf16', False)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     caller_policy(MixedPrecision("fp16"), ["cpu"], what="step()")
        Traceback (most recent call last):
          ...
        runtime.caller_autocast.AutocastConflictError: step() runs under torch.autocast('cpu', dtype=torch.bfloat16), but this trainer was built with precision='fp16': the stages cannot compute in both. Build the trainer with precision='bf16' (MixedPrecision('bf16', cast_activations=False) computes what the plain model does under that autocast), or call step() outside the autocast
    """  # noqa: E501 - the error message above is one line, as the doctest compares it
    kinds = sorted(set(device_types))
    on = {k: torch.get_autocast_dtype(k) for k in kinds if torch.is_autocast_enabled(k)}
    if not on:
        return policy
    shown = ", ".join(f"torch.autocast({k!r}, dtype={on[k]})" for k in on)
    off = [k for k in kinds if k not in on]
    if off or len(set(on.values())) > 1:
        raise AutocastConflictError(
            f"{what} runs under {shown}, but its stages also run on {', '.join(off) or 'devices'} "
            f"{'without autocast' if off else 'in another dtype'}; the pipeline runs in one precision: "
            "enter autocast for every device type of the stages alike, or pass precision= to the trainer"
        )
    dtype = next(iter(on.values()))
    name = _NAMES.get(dtype)
    if name is None:
        raise AutocastConflictError(
            f"{what} runs under {shown}, a dtype pipecut's precision does not take "
            f"(precision= is one of {', '.join(PRECISIONS)}); call it outside the autocast"
        )
    cache = torch.is_autocast_cache_enabled()
    if policy.dtype is None:
        log.debug("%s: the caller's %s carried into the stages", what, shown)
        return dataclasses.replace(policy, name=name, cast_activations=False, cache_enabled=cache)
    if policy.dtype == dtype:
        return policy if policy.cache_enabled == cache else dataclasses.replace(policy, cache_enabled=cache)
    raise AutocastConflictError(
        f"{what} runs under {shown}, but this trainer was built with precision={policy.name!r}: the stages "
        f"cannot compute in both. Build the trainer with precision={name!r} (MixedPrecision({name!r}, "
        f"cast_activations=False) computes what the plain model does under that autocast), or call {what} "
        "outside the autocast"
    )


@dataclass(frozen=True)
class CallPrecision:
    """What one trainer call runs with: its policy and the dtypes its boundary values travel in."""

    policy: MixedPrecision
    wire: Mapping[str, torch.dtype]


class CallerAutocast:
    """A trainer's precision, resolved against the caller's autocast at each call.

    Args:
        policy: the trainer's precision.
        device_types: the device types of this process's stages.
        wire_for: the wire dtypes of a policy (``runtime.precision.wire_dtypes`` bound to the
            plan); computed once per policy met.

    Example:
        >>> ca = CallerAutocast(MixedPrecision("fp32"), ["cpu"], lambda mp: {"x": mp.dtype or torch.float32})
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     call = ca.resolve("predict()")
        >>> call.policy.name, dict(call.wire), ca.resolve("predict()").policy.name
        ('bf16', {'x': torch.bfloat16}, 'fp32')
    """

    def __init__(
        self, policy: MixedPrecision, device_types: Iterable[str],
        wire_for: Callable[[MixedPrecision], Mapping[str, torch.dtype]],
    ) -> None:
        self.policy = policy
        self.device_types = tuple(sorted(set(device_types)))
        self._wire_for = wire_for
        self._wire: dict[MixedPrecision, Mapping[str, torch.dtype]] = {policy: wire_for(policy)}

    def resolve(self, what: str) -> CallPrecision:
        """The policy and wire dtypes for a call made now (see :func:`caller_policy`)."""
        mp = caller_policy(self.policy, self.device_types, what=what)
        if mp not in self._wire:
            self._wire[mp] = self._wire_for(mp)
        return CallPrecision(mp, self._wire[mp])
