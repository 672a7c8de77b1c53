"""What one compute node costs (``NodeCost``) and how long that takes on a device (``node_time``).

``NodeCost`` is plain data, filled by ``cost_graph`` (see ``partitioner.cost.costs`` for how each
number is obtained); ``node_time`` turns it into seconds with a roofline.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from partitioner.cost.devices import DeviceSpec

__all__ = ["NodeCost", "node_time", "weight_share", "wgrad_time", "scale_cost"]


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
            save (see ``partitioner.cost.costs``).
        output_bytes: bytes of the node's result (what crosses a stage boundary if cut here).
        io_bytes: bytes read plus bytes written in the forward; 0 for views.
        dtype: dtype of the main output, e.g. ``'torch.bfloat16'``; selects the peak FLOP/s.
        requires_grad: whether autograd runs a backward for this node (an input or parameter
            needs grad and the output is differentiable).
        measured_fwd_s: measured forward seconds (``profile=True``), else ``None``.
        measured_bwd_s: measured backward seconds (``profile=True``), else ``None``.
        comm_fwd_s: seconds of collectives the forward waits for (a tensor-parallel row layer's
            all-reduce: ``partitioner.tensor.split``), added to its time; 0 outside tp.
        comm_bwd_s: the same for the backward (a column layer's all-reduce of its input's gradient).

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
    comm_fwd_s: float = 0.0
    comm_bwd_s: float = 0.0


def scale_cost(cost: NodeCost, factor: float) -> NodeCost:
    """The node's cost for micro-batches ``factor`` times as large (more or fewer rows).

    What grows with the rows grows by ``factor``: FLOPs, saved activations, the result, and the
    bytes read and written other than its parameters and buffers, which stay (every op of a
    transformer or an MLP is row-wise in the batch dimension). Measured times scale by
    ``factor`` too, which overrates small micro-batches on a device that runs them less
    efficiently: re-profile at the size the plan trains for an exact figure. The collectives'
    seconds scale too, their latency with them (the layout search shards costs after scaling, so
    it prices them afresh at each size).

    Example:
        >>> c = scale_cost(NodeCost(fwd_flops=8.0, bwd_flops=16.0, param_bytes=100, io_bytes=140, saved_bytes=4), 2)
        >>> c.fwd_flops, c.bwd_flops, c.io_bytes, c.saved_bytes, c.param_bytes
        (16.0, 32.0, 180, 8, 100)
    """
    fixed = min(cost.io_bytes, cost.param_bytes + cost.buffer_bytes)
    return replace(
        cost,
        fwd_flops=cost.fwd_flops * factor,
        bwd_flops=cost.bwd_flops * factor,
        saved_bytes=round(cost.saved_bytes * factor),
        output_bytes=round(cost.output_bytes * factor),
        io_bytes=round(fixed + (cost.io_bytes - fixed) * factor),
        measured_fwd_s=None if cost.measured_fwd_s is None else cost.measured_fwd_s * factor,
        measured_bwd_s=None if cost.measured_bwd_s is None else cost.measured_bwd_s * factor,
        comm_fwd_s=cost.comm_fwd_s * factor,
        comm_bwd_s=cost.comm_bwd_s * factor,
    )


def node_time(cost: NodeCost, device: DeviceSpec) -> tuple[float, float]:
    """(forward seconds, backward seconds) of one node on ``device``.

    Measured times win when present. Otherwise a roofline: the larger of compute time
    (FLOPs / peak FLOP/s for the node's dtype) and memory time (bytes / bandwidth), plus the
    device's per-op overhead. Backward moves roughly twice the bytes of forward (it reads the
    saved tensors and the incoming gradient and writes the input gradients). A node that needs
    no gradient has no backward. The collectives a node waits for (``comm_fwd_s``, ``comm_bwd_s``)
    are added, nothing overlapping them.

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
    fwd += cost.comm_fwd_s
    if not cost.requires_grad:
        return fwd, 0.0
    if cost.measured_bwd_s is not None:
        return fwd, cost.measured_bwd_s + cost.comm_bwd_s
    bwd = max(cost.bwd_flops / peak, 2 * cost.io_bytes / device.mem_bandwidth) + device.op_overhead
    return fwd, bwd + cost.comm_bwd_s


def weight_share(cost: NodeCost) -> float:
    """Fraction of the node's backward that computes weight gradients (zero-bubble's ``W``).

    A weight gradient (``dW = x^T dy`` for a matmul, the analogue for a convolution) costs as
    many FLOPs as the forward; the rest of the backward computes input gradients (``I``). So a
    middle linear layer splits half and half, a first layer whose input needs no gradient is
    all ``W``, and a node without parameters is all ``I``. Memory-bound nodes with parameters
    (norms) are taken to split evenly.

    Example:
        >>> weight_share(NodeCost(fwd_flops=2.0, bwd_flops=4.0, param_names=("w",)))
        0.5
        >>> weight_share(NodeCost(fwd_flops=2.0, bwd_flops=4.0))
        0.0
    """
    if not cost.param_names or not cost.requires_grad:
        return 0.0
    if cost.bwd_flops <= 0:
        return 0.5
    return min(1.0, cost.fwd_flops / cost.bwd_flops)


def wgrad_time(cost: NodeCost, bwd: float) -> float:
    """Seconds of a node's backward ``bwd`` (from :func:`node_time`) that compute weight gradients:
    :func:`weight_share` of its compute; the collectives it waits for are the input gradients' (``I``).

    Example:
        >>> wgrad_time(NodeCost(fwd_flops=2.0, bwd_flops=4.0, param_names=("w",), comm_bwd_s=1.0), 3.0)
        1.0
    """
    return max(0.0, bwd - cost.comm_bwd_s) * weight_share(cost)
