"""Analytic node costs on fake tensors: counted FLOPs, saved activations, parameter and I/O bytes.

Each compute node runs on its own under ``FlopCounterMode`` and ``saved_tensors_hooks``, forward
then backward, and identical calls run once (see ``partitioner.cost.costs`` for the method and why).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from partitioner.cost.nodecost import NodeCost
from partitioner.tracing.failures import first_line
from partitioner.tracing.fxutil import COMPUTE_OPS
from partitioner.tracing.globalstate import preserved
from partitioner.tracing.nodecall import Call, Prepared, label, random_like

__all__ = ["Coster"]

log = logging.getLogger(__name__)

_SCALAR_BYTES = 8  # a Python scalar crossing a stage boundary travels as one 64-bit element
_REAL_FALLBACK_BYTES = 256 * 2**20  # run a node for real only when its tensors are this small
_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.setitem,
}


def _sdpa_cpu_fwd(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(flop_counter.sdpa_flop_count(q, k, v))


def _sdpa_cpu_bwd(grad: Any, q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(flop_counter.sdpa_backward_flop_count(grad, q, k, v))


# FlopCounterMode knows the CUDA attention kernels but not the CPU flash kernel that
# scaled_dot_product_attention picks for CPU tensors; count it like its CUDA sibling.
_EXTRA_FORMULAS: dict[Any, Any] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_fwd,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_bwd,
}


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


class Coster:
    """Costs every compute node of ``gm`` on fake tensors, one distinct call at a time.

    ``run`` walks the graph in order, tracking which values need grad and which storages have
    been charged as saved activations. ``calls`` then holds every node's cache key and prepared
    call, which the profiler reuses to time each distinct call once.
    """

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.cache: dict[Any, _Run] = {}
        self.requires_grad: dict[int, bool] = {}  # id(val leaf) -> needs grad
        self.param_storages: set[StorageWeakRef] = set()
        self.charged: set[Any] = set()
        self.failed: set[str] = set()
        self.calls: dict[str, tuple[Any, Prepared]] = {}  # node name -> (cache key, call)

    def run(self) -> dict[str, NodeCost]:
        """Node name -> ``NodeCost`` for every compute node, in graph order (no measured times)."""
        costs: dict[str, NodeCost] = {}
        for node in self.gm.graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                self._seed(node)
            elif node.op in COMPUTE_OPS:
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
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), self._value)
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

    def _value(self, n: fx.Node) -> Any:
        """The recorded value of ``n``; for a region body read by ``get_attr``, the body itself."""
        if n.op == "get_attr":
            attr = _fetch(self.gm, str(n.target))
            if isinstance(attr, nn.Module):
                return attr
        return n.meta.get("val")

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
            elif isinstance(t, nn.Module):  # a region's body: the same body, the same call
                desc.append(("module", id(t)))
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
                # A failed attempt must not change the modes later nodes are costed under.
                with preserved(what=f"costing {node.name}"):
                    run = self._execute_once(node, leaves, spec, module, fake=fake, leaf_inputs=leaf_inputs)
            except Exception as e:
                error = e
                continue
            if not fake:
                log.warning(
                    "%s (%s) cannot run on fake tensors (%s); costed by running it on random CPU "
                    "tensors instead", node.name, label(node), first_line(error),
                )
            return run
        kind = label(node)
        self.failed.add(kind)
        log.debug("could not run %s (%s): %s", node.name, kind, error)
        return _Run(0, 0, (), (), ok=False)

    def _execute_once(
        self, node: fx.Node, leaves: list[Any], spec: Any, module: nn.Module | None, *, fake: bool,
        leaf_inputs: bool,
    ) -> _Run:
        cpu = torch.device("cpu")

        def make(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
            x = _fresh(t, requires_grad) if fake else random_like(t, cpu, requires_grad)
            return x if leaf_inputs or not x.requires_grad else x.clone()

        def swap(v: Any) -> Any:
            return cpu if isinstance(v, torch.device) and (not fake or v.type == "meta") else v

        with self.mode if fake else contextlib.nullcontext():
            call = Call.prepare(node, module, leaves, spec, self.needs_grad, make, swap)
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

    def fake_call(self, call: Prepared) -> Call:
        """``call`` (from :attr:`calls`) prepared again on fresh fake tensors of its recorded
        shapes, to replay one node under another dispatch mode; run it inside ``self.mode``."""
        node, module, leaves, spec = call

        def swap(v: Any) -> Any:
            return torch.device("cpu") if isinstance(v, torch.device) and v.type == "meta" else v

        return Call.prepare(node, module, leaves, spec, self.needs_grad, _fresh, swap)

    def needs_grad(self, t: torch.Tensor) -> bool:
        """Whether the value ``t`` (a recorded fake tensor) needs grad in the traced graph."""
        return self.requires_grad.get(id(t), False)

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


# --- helpers -------------------------------------------------------------------------------------


def _storage(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


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


def _fetch(gm: fx.GraphModule, target: str) -> Any:
    return functools.reduce(getattr, target.split("."), gm)
