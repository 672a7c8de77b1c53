"""Mixed precision for the pipeline: the autocast policy, the dtype on the wire, and fp16 loss scaling.

The choice is autocast, not low-precision parameters: parameters, gradients and optimizer state
stay fp32 (they *are* the master weights, so there is no second copy to keep in sync, and
checkpoints, clipping and data-parallel averaging are unchanged), and each stage's forward and
the loss run under ``torch.autocast(device_type, dtype)``, exactly as a torch user writes it
around the unpartitioned model. That makes the unpartitioned model under the same ``autocast``
the reference every pipelined run is compared with.

What crosses a stage boundary (``MixedPrecision.cast_activations``): by default every floating
value (activations forward, their gradients back) is cast to the low dtype before sending and
received into low-dtype buffers, halving the traffic and the receive buffers. That is a change
of numerics where the plain model keeps the value in fp32 (a residual stream: autocast leaves
``fp32 + bf16`` in fp32). With ``cast_activations=False`` values travel in the plan's dtype
(fp32): a low-precision value is widened, which is exact, so the pipeline computes what the
plain autocast model computes.

fp16 needs loss scaling (its smallest normal is ~6e-5, small gradients underflow). We write our
own :class:`LossScaler` rather than use ``torch.amp.GradScaler`` because the inf/NaN check must
see every stage: each rank holds only its own stages' gradients, and GradScaler decides per
process with no hook for a process group. Ours reduces the found-inf flag over the pipeline's
ranks (as ``runtime.parallel.clipping`` reduces the norm) and otherwise follows GradScaler: initial scale
2**16, x2 after 2000 steps without inf/NaN, x0.5 and the step skipped when one is found.

The caller's own ``torch.autocast`` around a trainer call (:class:`CallerAutocast`): autocast's
state is thread-local, and the in-process transport runs each rank's stages on a thread of its
own, so ``with torch.autocast("cpu", dtype=torch.bfloat16): trainer.step(x, y)`` would reach no
stage. Every call that runs stages reads the caller's state on the stages' device types and maps
it onto this machinery rather than re-entering it per thread: a ``MixedPrecision`` of that dtype
with ``cast_activations=False``, whose wire dtypes are those of the plain model's values under
that autocast. A trainer already in a low precision runs as built under an autocast of the same
dtype, and one of another dtype is refused (:class:`AutocastConflictError`) before anything runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from partitioner.errors import PipecutError
from partitioner.plan.split import StageIO
from partitioner.tracing.trace import InputMeta, retargeted
from runtime.state.materialize import released_device
from runtime.transport.collective import run_bounded

__all__ = [
    "MixedPrecision", "LossScaler", "PrecisionError", "PRECISIONS", "resolve_precision", "wire_dtypes",
    "whole_fake_params", "fake_slots", "AutocastConflictError", "CallPrecision", "CallerAutocast", "caller_policy",
]

log = logging.getLogger(__name__)

#: Names a policy is given by, and the dtype autocast computes in (``None``: plain fp32).
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class PrecisionError(PipecutError, ValueError):
    """An unknown precision name, or a policy that cannot run where it was asked to."""


@dataclass(frozen=True)
class MixedPrecision:
    """How a pipeline computes and communicates in low precision.

    Args:
        name: ``'fp32'`` (no autocast), ``'bf16'`` or ``'fp16'`` (autocast to that dtype;
            fp16 also scales the loss, see :class:`LossScaler`).
        cast_activations: send floating values between stages in the low dtype (default);
            ``False`` sends them in the plan's dtype, which matches the plain autocast model.
        init_scale: fp16's first loss scale (GradScaler's default).
        growth_interval: steps without inf/NaN after which the scale doubles.
        gather_low_precision: with ``DataParallel(engine='fsdp')``, FSDP all-gathers the weights
            in the low dtype (its ``MixedPrecisionPolicy(param_dtype=...)``, gradients reduced
            in fp32): half the all-gather bytes and half the gathered weights. The shards, the
            optimizer and the reduction stay fp32, but layers autocast keeps in fp32 (norms,
            embeddings) then read weights rounded to the low dtype: no longer the plain
            autocast model's step, bit for bit.
        cache_enabled: autocast's cache of low-precision weight copies within a forward
            (``torch.autocast(cache_enabled=...)``; it changes no value). A caller's autocast
            carried into the stages brings its own (``runtime.precision.CallerAutocast``).

    Raises:
        PrecisionError: ``name`` is not one of ``PRECISIONS``, or ``gather_low_precision`` with
            ``'fp32'``.

    Example:
        >>> mp = MixedPrecision("bf16")
        >>> mp.dtype, mp.wire_dtype(torch.float32), mp.wire_dtype(torch.int64)
        (torch.bfloat16, torch.bfloat16, torch.int64)
        >>> MixedPrecision("bf16", cast_activations=False).wire_dtype(torch.float32)
        torch.float32
    """

    name: str = "fp32"
    cast_activations: bool = True
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    gather_low_precision: bool = False
    cache_enabled: bool = True

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise PrecisionError(
                f"unknown precision {self.name!r}; choose one of {', '.join(PRECISIONS)} "
                "(parameters stay fp32; the low precision is autocast's compute dtype)"
            )
        if self.gather_low_precision and self.dtype is None:
            raise PrecisionError(
                "MixedPrecision('fp32', gather_low_precision=True): there is no low dtype to gather in; "
                "pass MixedPrecision('bf16', gather_low_precision=True)"
            )

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype autocast computes in, ``None`` for plain fp32."""
        return PRECISIONS[self.name]

    @property
    def scales_loss(self) -> bool:
        """Whether the loss is scaled (fp16 only: bf16 has fp32's exponent range)."""
        return self.name == "fp16"

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a boundary value of plan dtype ``dtype`` travels in when activations are cast."""
        low = self.dtype
        if low is None or not self.cast_activations or not dtype.is_floating_point:
            return dtype
        return low

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """A context running a stage's forward (and the loss) under this policy on ``device``.

        It restores the autocast state it found on exit, as ``torch.autocast`` does.
        """
        low = self.dtype
        if low is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=low, cache_enabled=self.cache_enabled)


def resolve_precision(precision: str | MixedPrecision | None, plan_precision: str = "fp32") -> MixedPrecision:
    """The policy for a trainer: ``precision`` as given, else the one the plan was costed for.

    Raises:
        PrecisionError: an unknown name.

    Example:
        >>> resolve_precision(None, "bf16").name
        'bf16'
    """
    if isinstance(precision, MixedPrecision):
        return precision
    return MixedPrecision(precision if precision is not None else plan_precision)


def wire_dtypes(
    policy: MixedPrecision, ios: Sequence[StageIO], gm: fx.GraphModule, inputs: Sequence[InputMeta],
    device_type: str,
) -> dict[str, torch.dtype]:
    """The dtype each floating value crossing a stage boundary travels in under ``policy``.

    Casting: the low dtype. Not casting: the dtype the value has under autocast in the
    unpartitioned model (a linear's output is bf16, a residual sum fp32), found by running
    ``gm`` on fake tensors under ``torch.autocast(device_type)`` -- no memory, no FLOPs. Both
    ends of every message derive the same dtypes, so receive buffers are allocated in them.

    Example:
        >>> from partitioner import partition
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> plan = partition(model, (torch.randn(2, 4),), 2, split_points=["1"])
        >>> mp = MixedPrecision("bf16", cast_activations=False)
        >>> wire_dtypes(mp, plan.io, plan.traced.gm, plan.traced.example_inputs, "cpu")
        {'_0': torch.bfloat16}
    """
    crossing = {v.name: v for io in ios for v in io.outputs if v.kind == "tensor" and v.consumers}
    floating = {n for n, v in crossing.items() if _plan_dtype(v.dtype).is_floating_point}
    if policy.dtype is None or not floating:
        return {}
    if policy.cast_activations:
        return dict.fromkeys(sorted(floating), policy.dtype)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    device = torch.device(device_type)
    rec = _DtypeRecorder(gm, mode, device)
    # The graph's device constants (export's ``arange(..., device='cpu')``) follow the device too.
    with retargeted(gm, device), whole_fake_params(gm, mode), mode:
        args = [torch.empty(m.shape, dtype=_plan_dtype(m.dtype), device=device) for m in inputs]
        # No cast cache: under a caller's autocast (CallerAutocast) this one is nested and
        # would leave the fake bf16 copies of the real weights that call_module nodes cast in the
        # cache, for the caller's next forward to read.
        with torch.autocast(device_type=device_type, dtype=policy.dtype, cache_enabled=False):
            rec.run(*args)
    return {n: rec.dtypes[n] for n in sorted(floating) if n in rec.dtypes}


@contextlib.contextmanager
def whole_fake_params(model: torch.nn.Module, mode: FakeTensorMode) -> Iterator[None]:
    """Within: every parameter of ``model`` that FSDP sharded is a fake tensor of its whole shape
    on its device, so that a fake run of the graph (shapes, autocast dtypes) sees the model's
    shapes; put back on exit. Sharded: a ``DTensor`` (FSDP's shard, on the modules the traced
    graph shares with the stages) or the meta tensor left where the whole one was
    (``runtime.state.materialize.release_whole_copies``).

    Example:
        >>> lin = torch.nn.Linear(2, 3)
        >>> with whole_fake_params(lin, FakeTensorMode()):  # nothing sharded: nothing changes
        ...     pass
        >>> type(lin.weight).__name__
        'Parameter'
    """
    def sharded(prm: torch.Tensor) -> torch.device | None:
        to_local = getattr(prm, "to_local", None)
        return to_local().device if callable(to_local) else released_device(prm)

    with fake_slots(model, mode, sharded):
        yield


@contextlib.contextmanager
def fake_slots(
    model: torch.nn.Module, mode: FakeTensorMode, device_of: Callable[[torch.Tensor], torch.device | None],
    *, buffers: bool = False,
) -> Iterator[None]:
    """Within: every parameter (and with ``buffers``, buffer) ``t`` of ``model`` for which
    ``device_of(t)`` gives a device is a fake tensor of ``t``'s shape and dtype on that device;
    put back on exit. The fake runs that find shapes and dtypes use it for what is not there
    whole (:func:`whole_fake_params`; ``runtime.execute.shapes``' stages left on meta).

    Example:
        >>> lin = torch.nn.Linear(2, 3, device="meta")
        >>> with fake_slots(lin, FakeTensorMode(), lambda t: torch.device("cpu")):
        ...     lin.weight.device.type, type(lin.weight).__name__
        ('cpu', 'FakeTensor')
        >>> lin.weight.device.type
        'meta'
    """
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for module in model.modules():
            tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers) if buffers else (
                module._parameters,)
            for slots in tables:
                for name, t in list(slots.items()):
                    device = device_of(t) if isinstance(t, torch.Tensor) else None
                    if device is not None:
                        with mode:
                            fake = torch.empty(t.shape, dtype=t.dtype, device=device)
                        swapped.append((slots, name, t))
                        slots[name] = fake  # the dict directly: Module.__setattr__ wants a Parameter
        yield
    finally:
        for slots, name, t in reversed(swapped):
            slots[name] = t


class _DtypeRecorder(fx.Interpreter):
    """Runs a graph on fake tensors (its parameters made fake on ``device``), keeping each value's dtype."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, device: torch.device) -> None:
        super().__init__(gm)
        self.mode = mode
        self.device = device
        self.dtypes: dict[str, torch.dtype] = {}

    def fetch_attr(self, target: str) -> Any:
        t = super().fetch_attr(target)
        if isinstance(t, torch.Tensor):  # a parameter, buffer or constant: fake, where autocast applies
            return self.mode.from_tensor(t).to(self.device)
        return t

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.dtypes[n.name] = out.dtype
        return out


def _plan_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise PrecisionError(f"unknown dtype {name!r} in the plan")
    return dt


class LossScaler:
    """Dynamic loss scaling for fp16 over a pipeline's ranks (``torch.amp.GradScaler``'s rule).

    The trainer multiplies the loss by :attr:`scale` before backward, then calls
    :meth:`unscale_` on the gradients (divides them, and finds inf/NaN on any rank), steps the
    optimizer only when none was found, and calls :meth:`update`.

    Args:
        init_scale: the first scale.
        growth_factor: the scale's factor after ``growth_interval`` good steps in a row.
        backoff_factor: the scale's factor after a step with inf/NaN gradients.
        growth_interval: good steps between growths.

    Example:
        >>> s = LossScaler(init_scale=8.0, growth_interval=2)
        >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([8.0, float("inf")])
        >>> s.unscale_([w]), s.update(True), s.scale
        (True, None, 4.0)
    """

    def __init__(
        self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise PrecisionError(
                f"loss scaling needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                f"growth_interval >= 1; got {init_scale}, {growth_factor}, {backoff_factor}, {growth_interval}"
            )
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0  # steps without inf/NaN since the scale last changed

    def unscale_(
        self, params: Iterable[torch.nn.Parameter], *, distributed: bool = False,
        comm_device: Callable[[], torch.device] | None = None, group: dist.ProcessGroup | None = None,
        timeout: float = 1800.0, tp_group: dist.ProcessGroup | None = None,
    ) -> bool:
        """Divide every gradient by the scale; return whether any rank's has an inf or NaN.

        Args:
            params: this process's parameters.
            distributed: reduce the flag over ``group`` (the pipeline's ranks: after data-parallel
                averaging every replica holds the same gradients; under FSDP, where each holds a
                shard, the whole job).
            comm_device: where that reduction runs (the rank's GPU on NCCL).
            group: the process group of the pipeline's ranks.
            timeout: seconds the reduction may wait (the trainer's ``timeout``; default torch's
                30 minutes).
            tp_group: the rank's tensor-parallel group, when its stages are split (``None``: none):
                each tp rank holds a shard of a split weight's gradient, so the flag is reduced over
                it too, and every rank of the job skips or takes the step alike.

        Raises:
            TransportTimeout: the reduction did not complete within ``timeout`` (``PeerFailed`` /
                ``PeerGone`` when a peer failed or its process is gone).
        """
        inv = 1.0 / self.scale  # a power of two: dividing is exact
        flags: dict[torch.device, list[torch.Tensor]] = {}
        for prm in params:
            if prm.grad is not None:
                g = prm.grad.to_local() if hasattr(prm.grad, "to_local") else prm.grad  # FSDP: this rank's shard
                g.mul_(inv)
                flags.setdefault(g.device, []).append((~torch.isfinite(g)).any())
        found = torch.zeros((), dtype=torch.float32)
        for per_device in flags.values():  # one device sync per device, not per gradient
            found = torch.maximum(found, torch.stack(per_device).any().float().cpu())
        if distributed:
            buf = found.to(comm_device() if comm_device is not None else torch.device("cpu"))
            run_bounded(dist.all_reduce, buf, op=dist.ReduceOp.MAX, group=group, timeout=timeout,
                        what="the all-reduce of fp16 loss scaling's inf/NaN flag")
            if tp_group is not None:
                run_bounded(dist.all_reduce, buf, op=dist.ReduceOp.MAX, group=tp_group, timeout=timeout,
                            what="the all-reduce of fp16 loss scaling's inf/NaN flag over the tp group")
            found = buf.cpu()
        return bool(found.item())

    def update(self, found_inf: bool) -> None:
        """Back off after a step with inf/NaN gradients; grow after ``growth_interval`` good ones."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            log.info("fp16 loss scaling: inf/NaN gradients, step skipped; scale now %g", self.scale)
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, float]:
        """The scale and the good-step count (to resume exactly)."""
        return {"scale": self.scale, "good_steps": float(self.good_steps)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])


# -- the caller's autocast ---------------------------------------------------------------

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
        runtime.precision.AutocastConflictError: step() runs under torch.autocast('cpu', dtype=torch.bfloat16), but this trainer was built with precision='fp16': the stages cannot compute in both. Build the trainer with precision='bf16' (MixedPrecision('bf16', cast_activations=False) computes what the plain model does under that autocast), or call step() outside the autocast
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
