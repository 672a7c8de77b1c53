"""The process state a library call must leave as it found it, captured, compared and restored.

Tracing, costing and splitting run user code (``torch.export`` of the forward, every node again
on fake tensors, random data for the profiler). Any of it may switch grad mode off (a
``torch.no_grad()`` region whose body raised), enter autocast, draw from the RNG or flip a
module's ``training`` flag. pipecut's entry points run inside :func:`preserved`, which puts back
what changed and says so in the debug log; the tests use :class:`GlobalState` to check that
nothing is left changed.

Restored: grad mode, autocast (enabled and dtype, CPU and CUDA, and its cache flag), the default
dtype and device, the CPU RNG state and, when CUDA is initialised, every CUDA device's RNG state,
Python's ``random`` state and, when numpy is imported, numpy's global RNG state; for a given model,
each module's ``training`` flag, each parameter's ``requires_grad``, and every buffer: its value
(a forward run to learn shapes or costs updates running statistics, ``num_batches_tracked``, a
counter the model keeps) and the tensor object itself when a forward reassigned it.
Compared but not restorable: inference mode (only its own context manager can leave it), and a
parameter's value: parameters are not copied (that would double a model's memory), only their
version counters are kept, so a parameter written in place is reported, never silently kept.
"""

from __future__ import annotations

import contextlib
import logging
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

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
    python_rng: object = None
    numpy_rng: object = None  # None when numpy is not imported
    training: tuple[tuple[str, bool], ...] = ()
    requires_grad: tuple[tuple[str, bool], ...] = ()
    buffers: tuple[_Kept, ...] = ()
    params: tuple[tuple[str, torch.Tensor, int | None], ...] = ()  # name, tensor, version
    model: nn.Module | None = None

    @staticmethod
    def capture(model: nn.Module | None = None, *, tensors: bool = True) -> GlobalState:
        """The state now; with ``model``, its modules' ``training``, parameters' ``requires_grad``
        and (``tensors``) version counters, and a copy of every buffer."""
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
            python_rng=random.getstate(),
            numpy_rng=_numpy_rng(),
            training=tuple((n, m.training) for n, m in model.named_modules()) if model is not None else (),
            requires_grad=(
                tuple((n, p.requires_grad) for n, p in model.named_parameters(remove_duplicate=False))
                if model is not None else ()
            ),
            buffers=_keep_buffers(model) if model is not None and tensors else (),
            params=(
                tuple((n, p, _version(p)) for n, p in model.named_parameters(remove_duplicate=False))
                if model is not None and tensors else ()
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
        if before.python_rng != self.python_rng:
            out.append("Python random state changed")
        if not _same_numpy_rng(before.numpy_rng, self.numpy_rng):
            out.append("numpy RNG state changed")
        for kind, old, new in (("training", before.training, self.training),
                               ("requires_grad", before.requires_grad, self.requires_grad)):
            changed = [n or "<root>" for (n, a), (_, b) in zip(old, new) if a != b]
            if changed:
                out.append(f"{kind} flipped on {len(changed)}: {changed[:5]}")
        changed = [k.name for k in before.buffers if k.changed()]
        if changed:
            out.append(f"buffers changed: {changed[:5]}")
        written = [n for n, p, v in before.params if _version(p) != v]
        if written:
            out.append(f"parameters written in place: {written[:5]}")
        return out

    def restore(self) -> list[str]:
        """Put back everything restorable that differs from this snapshot; returns what was put back."""
        now = GlobalState.capture(self.model, tensors=False)  # the buffers compare with their copies
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
        if now.python_rng != self.python_rng:
            random.setstate(self.python_rng)  # type: ignore[arg-type]
            restored.append("Python random state")
        if self.numpy_rng is not None and not _same_numpy_rng(self.numpy_rng, now.numpy_rng):
            sys.modules["numpy"].random.set_state(self.numpy_rng)
            restored.append("numpy RNG state")
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
            buffers = [k.name for k in self.buffers if k.restore()]
            if buffers:
                restored.append(f"buffers {', '.join(buffers[:5])}")
            written = [n for n, p, v in self.params if _version(p) != v]
            if written:  # not restorable (no copy kept); a bug in whatever ran the model for real
                log.warning("parameters written in place while pipecut ran the model: %s", written[:5])
        return restored


@dataclass(frozen=True, eq=False)
class _Kept:
    """One buffer as found: where it lives, the tensor object and a copy of its value."""

    name: str
    owner: nn.Module
    key: str
    tensor: torch.Tensor
    value: torch.Tensor | None  # None for a meta or fake tensor: it holds no value

    def changed(self) -> bool:
        if self.owner._buffers.get(self.key) is not self.tensor:
            return True
        # Values are compared even at an unchanged version: a write under a fake-tensor mode or
        # through ``.data`` need not count.
        return self.value is not None and not _bitwise_equal(self.tensor, self.value)

    def restore(self) -> bool:
        """Put the tensor back in its module and its value back in it; whether anything changed."""
        if not self.changed():
            return False
        self.owner._buffers[self.key] = self.tensor
        if self.value is not None and not _bitwise_equal(self.tensor, self.value):
            with torch.no_grad():
                self.tensor.copy_(self.value)
        return True


def _keep_buffers(model: nn.Module) -> tuple[_Kept, ...]:
    kept: list[_Kept] = []
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for key, t in module._buffers.items():
            if t is None:
                continue
            value = None if t.is_meta or is_fake(t) else t.detach().clone()
            kept.append(_Kept(f"{mod_name}.{key}" if mod_name else key, module, key, t, value))
    return tuple(kept)


def _version(t: torch.Tensor) -> int | None:
    """The tensor's in-place write counter; None for tensors that keep none (inference tensors)."""
    try:
        return int(t._version)
    except RuntimeError:
        return None


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (a NaN equals the same NaN), not merely ``==``."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        a, b = (t.detach().reshape(-1).contiguous().view(torch.uint8) for t in (a, b))
    return torch.equal(a.detach(), b.detach())


def _numpy_rng() -> object:
    np = sys.modules.get("numpy")
    return np.random.get_state() if np is not None else None


def _same_numpy_rng(a: Any, b: Any) -> bool:
    """numpy's ``get_state()`` tuples hold an array: compared item by item."""
    if a is None or b is None:
        return a is b
    np = sys.modules["numpy"]
    return all(bool(np.array_equal(x, y)) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b))


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
