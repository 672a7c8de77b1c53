"""The process state a library call must leave as it found it, captured, compared and restored.

Tracing, costing and splitting run user code (``torch.export`` of the forward, every node again
on fake tensors, random data for the profiler). Any of it may switch grad mode off (a
``torch.no_grad()`` region whose body raised), enter autocast, draw from the RNG or flip a
module's ``training`` flag. pipecut's entry points run inside :func:`preserved`, which puts back
what changed and says so in the debug log; the tests use :class:`GlobalState` to check that
nothing is left changed.

Restored: grad mode, autocast (enabled and dtype, CPU and CUDA, and its cache flag), the default
dtype and device, the CPU RNG state and, when CUDA is initialised, every CUDA device's RNG state;
for a given model, each module's ``training`` flag and each parameter's ``requires_grad``.
Compared but not restorable: inference mode (only its own context manager can leave it).
Parameter values are never written by pipecut; the tests compare them separately.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["GlobalState", "preserved"]

log = logging.getLogger(__name__)

_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, eq=False)
class GlobalState:
    """A snapshot of the process-wide torch state (and optionally a model's flags).

    Example:
        >>> import torch
        >>> before = GlobalState.capture()
        >>> _ = torch.set_grad_enabled(False)
        >>> GlobalState.capture().differences(before)
        ['grad mode: True -> False']
        >>> before.restore()
        ['grad mode']
        >>> torch.is_grad_enabled()
        True
    """

    grad_enabled: bool
    inference_mode: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool
    default_dtype: torch.dtype
    default_device: torch.device
    cpu_rng: torch.Tensor
    cuda_rng: tuple[torch.Tensor, ...] | None
    training: tuple[tuple[str, bool], ...] = ()
    requires_grad: tuple[tuple[str, bool], ...] = ()
    model: nn.Module | None = None

    @staticmethod
    def capture(model: nn.Module | None = None) -> GlobalState:
        """The state now; with ``model``, its modules' ``training`` and parameters' ``requires_grad``."""
        cuda_rng = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else None
        return GlobalState(
            grad_enabled=torch.is_grad_enabled(),
            inference_mode=torch.is_inference_mode_enabled(),
            autocast=tuple(
                (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
            ),
            autocast_cache=torch.is_autocast_cache_enabled(),
            default_dtype=torch.get_default_dtype(),
            default_device=torch.get_default_device(),
            cpu_rng=torch.get_rng_state(),
            cuda_rng=cuda_rng,
            training=tuple((n, m.training) for n, m in model.named_modules()) if model is not None else (),
            requires_grad=(
                tuple((n, p.requires_grad) for n, p in model.named_parameters(remove_duplicate=False))
                if model is not None else ()
            ),
            model=model,
        )

    def differences(self, before: GlobalState) -> list[str]:
        """What changed from ``before`` to this snapshot, one line per item (empty when nothing)."""
        out: list[str] = []

        def diff(what: str, old: object, new: object) -> None:
            if old != new:
                out.append(f"{what}: {old} -> {new}")

        diff("grad mode", before.grad_enabled, self.grad_enabled)
        diff("inference mode", before.inference_mode, self.inference_mode)
        for (dev, on0, dt0), (_, on1, dt1) in zip(before.autocast, self.autocast):
            diff(f"autocast {dev}", (on0, dt0), (on1, dt1))
        diff("autocast cache", before.autocast_cache, self.autocast_cache)
        diff("default dtype", before.default_dtype, self.default_dtype)
        diff("default device", before.default_device, self.default_device)
        if not torch.equal(before.cpu_rng, self.cpu_rng):
            out.append("CPU RNG state changed")
        if before.cuda_rng is not None and self.cuda_rng is not None and any(
            not torch.equal(a, b) for a, b in zip(before.cuda_rng, self.cuda_rng)
        ):
            out.append("CUDA RNG state changed")
        for kind, old, new in (("training", before.training, self.training),
                               ("requires_grad", before.requires_grad, self.requires_grad)):
            changed = [n or "<root>" for (n, a), (_, b) in zip(old, new) if a != b]
            if changed:
                out.append(f"{kind} flipped on {len(changed)}: {changed[:5]}")
        return out

    def restore(self) -> list[str]:
        """Put back everything restorable that differs from this snapshot; returns what was put back."""
        now = GlobalState.capture(self.model)
        restored: list[str] = []
        if now.grad_enabled != self.grad_enabled:
            torch.set_grad_enabled(self.grad_enabled)
            restored.append("grad mode")
        if now.autocast != self.autocast:
            for dev, enabled, dtype in self.autocast:
                torch.set_autocast_enabled(dev, enabled)
                torch.set_autocast_dtype(dev, dtype)
            restored.append("autocast")
        if now.autocast_cache != self.autocast_cache:
            torch.set_autocast_cache_enabled(self.autocast_cache)
            restored.append("autocast cache")
        if now.default_dtype != self.default_dtype:
            torch.set_default_dtype(self.default_dtype)
            restored.append("default dtype")
        if now.default_device != self.default_device:
            # 'cpu' is the absence of a default-device context, not a context set to the CPU.
            torch.set_default_device(None if self.default_device.type == "cpu" else self.default_device)
            restored.append("default device")
        if not torch.equal(now.cpu_rng, self.cpu_rng):
            torch.set_rng_state(self.cpu_rng)
            restored.append("CPU RNG state")
        if self.cuda_rng is not None and now.cuda_rng is not None and any(
            not torch.equal(a, b) for a, b in zip(self.cuda_rng, now.cuda_rng)
        ):
            torch.cuda.set_rng_state_all(list(self.cuda_rng))
            restored.append("CUDA RNG state")
        if self.model is not None:
            if now.training != self.training:
                modules = dict(self.model.named_modules())
                for name, flag in self.training:
                    if name in modules:
                        modules[name].training = flag
                restored.append("training flags")
            if now.requires_grad != self.requires_grad:
                params = dict(self.model.named_parameters(remove_duplicate=False))
                for name, flag in self.requires_grad:
                    if name in params:
                        params[name].requires_grad_(flag)
                restored.append("requires_grad flags")
        return restored


@contextlib.contextmanager
def preserved(model: nn.Module | None = None, *, what: str = "pipecut") -> Iterator[GlobalState]:
    """Run the block, then put back whatever process state (and ``model`` flags) it changed.

    Restores on any exit, exceptions included. What had to be restored is logged at debug level
    under ``what`` (nothing should be: each item is a bug in the code it names).

    Example:
        >>> import torch
        >>> with preserved():
        ...     _ = torch.randn(3)          # draws from the RNG
        ...     torch.set_default_dtype(torch.float64)
        >>> torch.get_default_dtype()
        torch.float32
    """
    before = GlobalState.capture(model)
    try:
        yield before
    finally:
        restored = before.restore()
        if restored:
            log.debug("%s changed and pipecut restored: %s", what, ", ".join(restored))
