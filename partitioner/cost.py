"""Per-node costs of a traced graph: FLOPs, parameter and activation bytes, and their time on a device.

How each number is obtained (all on fake tensors, so nothing is allocated):

* FLOPs. Every compute node is run on its own, on fresh fake inputs of the recorded shapes and
  strides, under ``FlopCounterMode``; its backward is then run the same way (``autograd.grad``
  of the outputs with respect to every input that needs grad: parameters and activations, not
  integer ids or graph inputs that do not require grad), again counted. So backward FLOPs are
  counted, not assumed: a Linear reading a graph input that needs no grad costs 1x its forward
  (weight gradient only), a later one 2x. FlopCounterMode counts matmuls, convolutions and
  attention; elementwise ops count 0 and are priced by their memory traffic instead.
* Saved activations. The same forward runs under ``saved_tensors_hooks``; each tensor autograd
  keeps is identified by its storage and charged once to the first node that saves it: a ReLU
  output saved by the ReLU and by the next matmul counts once, a view saved costs its whole base
  storage, parameters are never charged.
* Speed. Identical calls (same op, shapes, strides, dtypes, constants -- the 96 blocks of GPT-3)
  are run once and the result reused. Measured on the 175B GPT-2 (3,889 compute nodes, 1 x 2048
  tokens): 67 distinct calls, about 0.3 s on one core, so the exact counts are affordable and no
  backward rule of thumb (such as bwd = 2 x fwd) is needed.

``profile=True`` replaces the analytic times with measured ones: each distinct call is run on a
real device with random tensors of the recorded shapes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from .devices import DeviceSpec
from .trace import TracedModel

__all__ = ["NodeCost", "cost_graph", "node_time"]

log = logging.getLogger(__name__)

_COMPUTE_OPS = ("call_function", "call_method", "call_module")
_SCALAR_BYTES = 8  # a Python scalar crossing a stage boundary travels as one 64-bit element
_REAL_FALLBACK_BYTES = 256 * 2**20  # run a node for real only when its tensors are this small
_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.setitem,
}


def _sdpa_cpu_fwd(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(flop_counter.sdpa_flop_count(q, k, v))  # type: ignore[no-untyped-call]


def _sdpa_cpu_bwd(grad: Any, q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(flop_counter.sdpa_backward_flop_count(grad, q, k, v))  # type: ignore[no-untyped-call]


# FlopCounterMode knows the CUDA attention kernels but not the CPU flash kernel that
# scaled_dot_product_attention picks for CPU tensors; count it like its CUDA sibling.
_EXTRA_FORMULAS: dict[Any, Any] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_fwd,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_bwd,
}


@dataclass(frozen=True)
class NodeCost:
    """What one compute node costs, per micro-batch.

    Attributes:
        fwd_flops: forward floating-point operations (FlopCounterMode's count).
        bwd_flops: backward FLOPs, input and weight gradients together.
        param_names: qualified names of the parameters the node reads directly.
        param_count: elements in those parameters.
        param_bytes: bytes of those parameters (a parameter read by several nodes counts in each).
        buffer_bytes: bytes of the buffers and tensor constants the node reads directly.
        saved_bytes: activation bytes autograd keeps for backward that this node is the first to
            save (see the module docstring).
        output_bytes: bytes of the node's result (what crosses a stage boundary if cut here).
        io_bytes: bytes read plus bytes written in the forward; 0 for views.
        dtype: dtype of the main output, e.g. ``'torch.bfloat16'``; selects the peak FLOP/s.
        requires_grad: whether autograd runs a backward for this node (an input or parameter
            needs grad and the output is differentiable).
        measured_fwd_s: measured forward seconds (``profile=True``), else ``None``.
        measured_bwd_s: measured backward seconds (``profile=True``), else ``None``.

    Example:
        >>> c = NodeCost(fwd_flops=2e9, bwd_flops=4e9, io_bytes=1e6)
        >>> c.requires_grad, c.dtype
        (True, 'torch.float32')
    """

    fwd_flops: float = 0
    bwd_flops: float = 0
    param_names: tuple[str, ...] = ()
    param_count: int = 0
    param_bytes: int = 0
    buffer_bytes: int = 0
    saved_bytes: int = 0
    output_bytes: int = 0
    io_bytes: int = 0
    dtype: str = "torch.float32"
    requires_grad: bool = True
    measured_fwd_s: float | None = None
    measured_bwd_s: float | None = None


def node_time(cost: NodeCost, device: DeviceSpec) -> tuple[float, float]:
    """(forward seconds, backward seconds) of one node on ``device``.

    Measured times win when present. Otherwise a roofline: the larger of compute time
    (FLOPs / peak FLOP/s for the node's dtype) and memory time (bytes / bandwidth), plus the
    device's per-op overhead. Backward moves roughly twice the bytes of forward (it reads the
    saved tensors and the incoming gradient and writes the input gradients). A node that needs
    no gradient has no backward.

    Example:
        >>> dev = DeviceSpec("toy", peak_flops=1e12, peak_flops_fp32=1e11, mem_bandwidth=1e9,
        ...                  memory=1e9, op_overhead=0.0)
        >>> node_time(NodeCost(fwd_flops=1e11, bwd_flops=2e11, io_bytes=1e6), dev)
        (1.0, 2.0)
    """
    peak = device.flops_for(cost.dtype)
    if cost.measured_fwd_s is not None:
        fwd = cost.measured_fwd_s
    else:
        fwd = max(cost.fwd_flops / peak, cost.io_bytes / device.mem_bandwidth) + device.op_overhead
    if not cost.requires_grad:
        return fwd, 0.0
    if cost.measured_bwd_s is not None:
        return fwd, cost.measured_bwd_s
    bwd = max(cost.bwd_flops / peak, 2 * cost.io_bytes / device.mem_bandwidth) + device.op_overhead
    return fwd, bwd


def cost_graph(
    traced: TracedModel | fx.GraphModule,
    *,
    profile: bool = False,
    device: torch.device | str | None = None,
    warmup: int = 2,
    repeat: int = 5,
) -> dict[str, NodeCost]:
    """Cost every compute node of a traced graph.

    Args:
        traced: from ``trace`` (or a GraphModule whose nodes carry ``meta['val']``).
        profile: also time each node on ``device`` (real tensors of the recorded shapes, median
            of ``repeat`` runs after ``warmup``), filling ``measured_fwd_s``/``measured_bwd_s``.
        device: where to profile; default CUDA when available, else CPU.
        warmup: untimed runs per distinct call before timing.
        repeat: timed runs per distinct call.

    Returns:
        node name -> ``NodeCost`` for every ``call_function``/``call_method``/``call_module`` node.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from partitioner.trace import trace
        >>> t = trace(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)), (torch.randn(4, 64),))
        >>> c = cost_graph(t)
        >>> c["_0"].fwd_flops, c["_0"].bwd_flops, c["_2"].bwd_flops  # 2*4*64*32; no input grad for _0
        (16384, 16384, 4096)
        >>> c["_0"].param_names
        ('0.weight', '0.bias')
    """
    gm = traced.gm if isinstance(traced, TracedModel) else traced
    if repeat < 1 or warmup < 0:
        raise ValueError(f"need repeat >= 1 and warmup >= 0, got repeat={repeat}, warmup={warmup}")
    coster = _Coster(gm)
    costs = coster.run()
    if profile:
        dev = torch.device(device) if device is not None else _default_device()
        costs = coster.profile(costs, dev, warmup, repeat)
    return costs


# --- analytic costs on fake tensors --------------------------------------------------------------


_Prepared = tuple[fx.Node, "nn.Module | None", list[Any], Any]  # node, leaf module, arg leaves, spec


@dataclass(frozen=True)
class _Run:
    """The device-independent result of running one call on fake tensors (cached by signature).

    ``saved`` entries: ``('in', i)`` the i-th input leaf, ``('out', k)`` the k-th output leaf,
    ``('tmp', nbytes)`` a tensor made inside the op (e.g. softmax statistics).
    """

    fwd_flops: int
    bwd_flops: int
    saved: tuple[tuple[str, int], ...]
    out_requires_grad: tuple[bool, ...]
    ok: bool = True


class _Coster:
    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.cache: dict[Any, _Run] = {}
        self.requires_grad: dict[int, bool] = {}  # id(val leaf) -> needs grad
        self.param_storages: set[StorageWeakRef] = set()
        self.charged: set[Any] = set()
        self.failed: set[str] = set()
        self.calls: dict[str, tuple[Any, _Prepared]] = {}  # node name -> (cache key, call)

    def run(self) -> dict[str, NodeCost]:
        costs: dict[str, NodeCost] = {}
        for node in self.gm.graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                self._seed(node)
            elif node.op in _COMPUTE_OPS:
                costs[node.name] = self._cost(node)
        if self.failed:
            log.warning(
                "could not run %d kinds of node on fake or small real tensors (%s); their FLOPs "
                "and saved bytes count as 0", len(self.failed), ", ".join(sorted(self.failed)[:10]),
            )
        log.debug("costed %d nodes with %d distinct calls", len(costs), len(self.cache))
        return costs

    def _seed(self, node: fx.Node) -> None:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return
        if node.op == "get_attr":
            attr = _fetch(self.gm, str(node.target))
            self.requires_grad[id(val)] = isinstance(attr, nn.Parameter) and attr.requires_grad
            self.param_storages.add(_storage(val))
        else:
            self.requires_grad[id(val)] = bool(val.requires_grad)

    def _cost(self, node: fx.Node) -> NodeCost:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), _val)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        out_leaves = pytree.tree_leaves(node.meta.get("val"))
        module = self.gm.get_submodule(str(node.target)) if node.op == "call_module" else None

        key = self._key(node, leaves, spec, module)
        self.calls[node.name] = (key, (node, module, leaves, spec))
        run = self.cache.get(key)
        if run is None:
            run = self._execute(node, leaves, spec, module)
            self.cache[key] = run
        out_tensors = [t for t in out_leaves if isinstance(t, torch.Tensor)]
        in_tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        out_rg = run.out_requires_grad
        if not run.ok:  # fall back to "differentiable if any input needs grad"
            any_rg = any(self.requires_grad.get(id(t), False) for t in in_tensors)
            out_rg = tuple(any_rg and t.dtype.is_floating_point for t in out_tensors)
        for t, rg in zip(out_tensors, out_rg):
            self.requires_grad[id(t)] = rg

        names, param_count, param_bytes, buffer_bytes = self._attrs(node, module)
        return NodeCost(
            fwd_flops=run.fwd_flops,
            bwd_flops=run.bwd_flops,
            param_names=names,
            param_count=param_count,
            param_bytes=param_bytes,
            buffer_bytes=buffer_bytes,
            saved_bytes=self._charge(run, leaves, out_tensors),
            output_bytes=_out_bytes(out_leaves),
            io_bytes=_io_bytes(node, in_tensors, out_tensors, module, run.fwd_flops),
            dtype=str((out_tensors or in_tensors)[0].dtype) if (out_tensors or in_tensors) else "none",
            requires_grad=any(out_rg),
        )

    def _key(self, node: fx.Node, leaves: list[Any], spec: Any, module: nn.Module | None) -> Any:
        if module is not None:
            state = tuple(
                (n, tuple(t.shape), str(t.dtype), t.requires_grad)
                for n, t in (*module.named_parameters(), *module.named_buffers())
            )
            target: Any = ("module", type(module).__qualname__, repr(module), state)
        else:
            target = (node.op, node.target)
        first: dict[StorageWeakRef, int] = {}
        desc: list[tuple[Any, ...]] = []
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor):
                st = _storage(t)
                desc.append((
                    tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device.type,
                    self.requires_grad.get(id(t), False), st in self.param_storages, first.setdefault(st, i),
                ))
            else:
                desc.append(("v", type(t).__name__, repr(t)))
        return (target, str(spec), tuple(desc))

    def _execute(self, node: fx.Node, leaves: list[Any], spec: Any, module: nn.Module | None) -> _Run:
        # Fake first; an in-place op on a leaf that needs grad gets non-leaf copies; an op fake
        # tensors cannot run (data-dependent code in a leaf module, .item()) runs for real on
        # small random CPU tensors of the same shapes.
        attempts = ((True, True), (True, False), (False, True), (False, False))
        error: BaseException | None = None
        for fake, leaf_inputs in attempts:
            if not fake and _real_bytes(leaves, module) > _REAL_FALLBACK_BYTES:
                break
            try:
                run = self._execute_once(node, leaves, spec, module, fake=fake, leaf_inputs=leaf_inputs)
            except Exception as e:
                error = e
                continue
            if not fake:
                log.warning(
                    "%s (%s) cannot run on fake tensors (%s); costed by running it on random CPU "
                    "tensors instead", node.name, _label(node), _first_line(error),
                )
            return run
        label = _label(node)
        self.failed.add(label)
        log.debug("could not run %s (%s): %s", node.name, label, error)
        return _Run(0, 0, (), (), ok=False)

    def _execute_once(
        self, node: fx.Node, leaves: list[Any], spec: Any, module: nn.Module | None, *, fake: bool,
        leaf_inputs: bool,
    ) -> _Run:
        cpu = torch.device("cpu")

        def make(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
            x = _fresh(t, requires_grad) if fake else _random_like(t, cpu, requires_grad)
            return x if leaf_inputs or not x.requires_grad else x.clone()

        def swap(v: Any) -> Any:
            return cpu if isinstance(v, torch.device) and (not fake or v.type == "meta") else v

        with self.mode if fake else contextlib.nullcontext():
            call = _Call.prepare(node, module, leaves, spec, self._needs_grad, make, swap)
            saved: list[torch.Tensor] = []
            with (
                FlopCounterMode(display=False, custom_mapping=_EXTRA_FORMULAS) as fwd_counter,
                torch.autograd.graph.saved_tensors_hooks(_keeper(saved), _identity),
            ):
                out = call.fn(*call.args, **call.kwargs)
            outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
            with FlopCounterMode(display=False, custom_mapping=_EXTRA_FORMULAS) as bwd_counter:
                call.backward(outs)
            return _Run(
                fwd_flops=fwd_counter.get_total_flops(),
                bwd_flops=bwd_counter.get_total_flops(),
                saved=_classify(saved, call.fresh, outs, call.state),
                out_requires_grad=tuple(bool(o.requires_grad) for o in outs),
            )

    def _needs_grad(self, t: torch.Tensor) -> bool:
        return self.requires_grad.get(id(t), False)

    def profile(
        self, costs: dict[str, NodeCost], device: torch.device, warmup: int, repeat: int
    ) -> dict[str, NodeCost]:
        """``costs`` with measured times; each distinct call (cache key) is timed once."""
        timed: dict[Any, tuple[float, float | None] | None] = {}
        out = dict(costs)
        for name, (key, call) in self.calls.items():
            if key not in timed:
                try:
                    timed[key] = _measure(call, self._needs_grad, device, warmup, repeat)
                except Exception as e:  # keep the analytic estimate for this node
                    log.warning("could not profile %s (%s): %s", name, _label(call[0]), _first_line(e))
                    timed[key] = None
            measured = timed[key]
            if measured is not None:
                out[name] = replace(costs[name], measured_fwd_s=measured[0], measured_bwd_s=measured[1])
        return out

    def _charge(self, run: _Run, leaves: list[Any], outs: list[torch.Tensor]) -> int:
        total = 0
        for kind, value in run.saved:
            if kind == "tmp":
                total += value
                continue
            src = leaves[value] if kind == "in" else (outs[value] if value < len(outs) else None)
            if not isinstance(src, torch.Tensor):
                continue
            key = _storage(src)
            if key in self.param_storages or key in self.charged:
                continue
            self.charged.add(key)
            total += _storage_bytes(src)
        return total

    def _attrs(self, node: fx.Node, module: nn.Module | None) -> tuple[tuple[str, ...], int, int, int]:
        """(parameter names, their elements, their bytes, buffer and constant bytes) read by ``node``."""
        params: dict[str, torch.Tensor] = {}
        others: list[torch.Tensor] = []
        if module is not None:
            params.update((f"{node.target}.{n}", p) for n, p in module.named_parameters())
            others += module.buffers()
        for a in node.all_input_nodes:
            if a.op == "get_attr":
                attr = _fetch(self.gm, str(a.target))
                if isinstance(attr, nn.Parameter):
                    params[str(a.target)] = attr
                elif isinstance(attr, torch.Tensor):
                    others.append(attr)
        return (
            tuple(params), sum(p.numel() for p in params.values()),
            sum(_nbytes(p) for p in params.values()), sum(_nbytes(b) for b in others),
        )


# --- measured costs on a real device -------------------------------------------------------------


def _measure(
    call: _Prepared, needs_grad: Callable[[torch.Tensor], bool], device: torch.device, warmup: int, repeat: int
) -> tuple[float, float | None]:
    """Median forward and backward seconds of one node on real random tensors on ``device``."""
    node, module, leaves, spec = call

    def make(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        return _random_like(t, device, requires_grad)

    def swap(v: Any) -> Any:  # device constants recorded at trace time (often 'meta')
        return device if isinstance(v, torch.device) else v

    fwd_times: list[float] = []
    bwd_times: list[float] = []
    for i in range(warmup + repeat):
        run = _Call.prepare(node, module, leaves, spec, needs_grad, make, swap)
        _sync(device)
        t0 = time.perf_counter()
        out = run.fn(*run.args, **run.kwargs)
        _sync(device)
        t1 = time.perf_counter()
        ran_backward = run.backward(pytree.tree_leaves(out))
        _sync(device)
        if i >= warmup:
            fwd_times.append(t1 - t0)
            if ran_backward:
                bwd_times.append(time.perf_counter() - t1)
    return statistics.median(fwd_times), statistics.median(bwd_times) if bwd_times else None


# --- helpers -------------------------------------------------------------------------------------


@dataclass
class _Call:
    """One node made runnable on new tensors like its recorded inputs (fake or real)."""

    fn: Callable[..., Any]
    args: Any
    kwargs: Any
    fresh: list[Any]  # the flat argument leaves, as created
    state: dict[str, torch.Tensor]  # a call_module's parameters and buffers, as created
    grad_inputs: list[torch.Tensor]

    @staticmethod
    def prepare(
        node: fx.Node,
        module: nn.Module | None,
        leaves: list[Any],
        spec: Any,
        needs_grad: Callable[[torch.Tensor], bool],
        make: Callable[[torch.Tensor, bool], torch.Tensor],
        swap: Callable[[Any], Any],
    ) -> _Call:
        fresh = [make(t, needs_grad(t)) if isinstance(t, torch.Tensor) else swap(t) for t in leaves]
        state: dict[str, torch.Tensor] = {}
        if module is not None:
            state.update((n, make(p, p.requires_grad)) for n, p in module.named_parameters())
            state.update((n, make(b, False)) for n, b in module.named_buffers())
        grad_inputs = [t for t in (*fresh, *state.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
        args, kwargs = pytree.tree_unflatten(fresh, spec)
        return _Call(_callable(node, module, state), args, kwargs, fresh, state, grad_inputs)

    def backward(self, outs: list[Any]) -> bool:
        """Gradients of ``outs`` for every input that needs one; False when there is nothing to do."""
        diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        if not diff or not self.grad_inputs:
            return False
        torch.autograd.grad(diff, self.grad_inputs, [torch.ones_like(o) for o in diff], allow_unused=True)
        return True


def _val(n: fx.Node) -> Any:
    return n.meta.get("val")


def _storage(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())  # type: ignore[no-untyped-call]


def _storage_bytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * int(t.element_size())


def _fresh(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A new (fake, under the mode) tensor like ``t``; requires_grad only for float tensors."""
    x = torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device=_fake_device(t.device))
    if requires_grad and (x.is_floating_point() or x.is_complex()):
        x.requires_grad_(True)
    return x


def _fake_device(device: torch.device) -> torch.device:
    # Fake tensors allocate nothing on any device; on 'meta' scaled_dot_product_attention falls
    # back to the unfused math path (saving the T x T attention matrix), so a meta-device model is
    # costed as if on CPU, whose fused kernel behaves like the GPU ones.
    return torch.device("cpu") if device.type == "meta" else device


def _real_bytes(leaves: list[Any], module: nn.Module | None) -> int:
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    if module is not None:
        tensors += [*module.parameters(), *module.buffers()]
    return sum(_nbytes(t) for t in tensors)


def _first_line(e: BaseException | None) -> str:
    text = str(e).strip() if e is not None else ""
    return text.splitlines()[0] if text else type(e).__name__


def _keeper(saved: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    return pack


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _classify(
    saved: list[torch.Tensor], fresh: list[Any], outs: list[torch.Tensor], state: Mapping[str, torch.Tensor]
) -> tuple[tuple[str, int], ...]:
    ins: dict[StorageWeakRef, int] = {}
    for i, x in enumerate(fresh):
        if isinstance(x, torch.Tensor):
            ins.setdefault(_storage(x), i)
    outputs: dict[StorageWeakRef, int] = {}
    for k, o in enumerate(outs):
        outputs.setdefault(_storage(o), k)
    params = {_storage(t) for t in state.values()}
    seen: set[StorageWeakRef] = set()
    result: list[tuple[str, int]] = []
    for t in saved:
        st = _storage(t)
        if st in seen or st in params:
            continue
        seen.add(st)
        if st in ins:
            result.append(("in", ins[st]))
        elif st in outputs:
            result.append(("out", outputs[st]))
        else:
            result.append(("tmp", _storage_bytes(t)))
    return tuple(result)


def _callable(node: fx.Node, module: nn.Module | None, state: dict[str, torch.Tensor]) -> Callable[..., Any]:
    if module is not None:
        return lambda *a, **k: torch.func.functional_call(module, state, a, k)
    if node.op == "call_method":
        return lambda self, *a, **k: getattr(self, str(node.target))(*a, **k)
    return node.target  # type: ignore[return-value]


def _out_bytes(out_leaves: list[Any]) -> int:
    total = 0
    for t in out_leaves:
        if isinstance(t, torch.Tensor):
            total += _nbytes(t)
        elif isinstance(t, (int, float, bool, torch.SymInt, torch.SymFloat)):
            total += _SCALAR_BYTES
    return total


def _io_bytes(
    node: fx.Node, ins: list[torch.Tensor], outs: list[torch.Tensor], module: nn.Module | None, flops: int
) -> int:
    in_storages = {_storage(t) for t in ins}
    is_view = (
        module is None and flops == 0 and bool(outs) and not _is_inplace(node)
        and all(_storage(o) in in_storages for o in outs)
    )
    if is_view:
        return 0
    read: dict[Any, int] = {}
    for t in ins:
        read.setdefault((_storage(t), tuple(t.shape), t.stride(), t.storage_offset()), _nbytes(t))
    total = sum(read.values()) + sum(_nbytes(o) for o in outs)
    if module is not None:
        total += sum(_nbytes(p) for p in (*module.parameters(), *module.buffers()))
    return total


def _is_inplace(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return bool(target._schema.is_mutable)
    if node.op == "call_method":
        name = str(target)
        return name.endswith("_") and not name.startswith("__")
    return target in _INPLACE_OPERATORS


def _label(node: fx.Node) -> str:
    if node.op == "call_module":
        return f"module {node.target}"
    if isinstance(node.target, str):
        return f"method {node.target}"
    return str(getattr(node.target, "__name__", node.target))


def _fetch(gm: fx.GraphModule, target: str) -> Any:
    return functools.reduce(getattr, target.split("."), gm)


def _random_like(t: torch.Tensor, device: torch.device, requires_grad: bool) -> torch.Tensor:
    """Real random data with ``t``'s shape, strides and dtype on ``device``.

    Integer tensors are zeros (always valid indices), booleans are ones.
    """
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) if all(t.shape) else 0
    size = t.storage_offset() + span
    if t.dtype.is_floating_point or t.dtype.is_complex:
        base = torch.randn(size, dtype=t.dtype, device=device)
    elif t.dtype == torch.bool:
        base = torch.ones(size, dtype=t.dtype, device=device)
    else:
        base = torch.zeros(size, dtype=t.dtype, device=device)
    x = base.as_strided(tuple(t.shape), t.stride(), t.storage_offset())
    if requires_grad and (x.is_floating_point() or x.is_complex()):
        x = x.detach().requires_grad_(True)
    return x


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
