"""The tp sizes a model and a cluster take, and the cluster a layout's (dp, pp) ranks see when each is a tp group.

Legend: ``N`` devices, ``tp`` ranks in a tensor-parallel group, ``dp`` replicas, ``pp`` ranks per pipeline.

A tp group must sit inside one node (its all-reduces run twice per block forward and twice
backward, over the node's link), so ``tp`` divides the node size; it must divide the attention
heads and the key/value heads (each rank computes whole heads: the runtime splits q, k and v by
heads and refuses kv heads fewer than tp) and every size a sharded linear layer splits (the
intermediate size, the hidden size; found from the graph, ``TensorSplit.sizes``). The head counts
come from the model's Hugging Face config (``num_attention_heads``, ``num_key_value_heads``): a
model without one searches tp only when told which sizes to try (``LayoutSpace(tp_sizes=...)``,
the caller vouching for its heads), and a cluster whose devices name no node size (``node_size
= 0``: the ``cpu`` preset, a measured host) searches tp only when told too.

The runtime lays the job out as the mesh ``("dp", "pp", "tp")``, tp innermost: world rank
``(d * pp + r) * tp + t``. So the ``dp x pp`` ranks of a layout are tp groups of ``tp``
consecutive devices, and a node of ``node_size`` devices holds ``node_size / tp`` of them:
:func:`tp_groups` is the cluster those ranks see, which prices the pipeline's links and the
replicas' exchange unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from torch import nn

from partitioner.cost.devices import Cluster
from partitioner.errors import PartitionOptionError
from partitioner.tensor.split import TensorSplit

__all__ = ["Heads", "model_heads", "tp_sizes", "tp_groups"]

Heads = tuple[int, int]  # (attention heads, key/value heads)


def model_heads(model: nn.Module) -> Heads | None:
    """``(attention heads, key/value heads)`` from the first Hugging Face config on ``model`` or its
    submodules (one with an int ``num_attention_heads``; kv heads default to the heads), or ``None``.

    Example:
        >>> from types import SimpleNamespace
        >>> m = nn.Linear(2, 2)
        >>> model_heads(m) is None
        True
        >>> m.config = SimpleNamespace(num_attention_heads=32, num_key_value_heads=8)
        >>> model_heads(m)
        (32, 8)
    """
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        heads = getattr(cfg, "num_attention_heads", None)
        if isinstance(heads, int) and heads > 0:
            kv = getattr(cfg, "num_key_value_heads", None)
            return heads, kv if isinstance(kv, int) and kv > 0 else heads
    return None


def tp_sizes(
    asked: Sequence[int] | None, *, heads: Heads | None, found: TensorSplit, node_size: int, devices: int,
) -> tuple[int, ...]:
    """The tp sizes to search: ``asked`` checked, or (``None``) every one the model and cluster take.

    ``None`` searches every divisor of ``node_size`` that divides the heads, the kv heads, the
    devices and every size the graph's sharded layers split (``found``); ``(1,)`` when the heads are
    unknown, the graph cannot be split or the devices name no node size.

    Raises:
        PartitionOptionError: an asked size crosses a node, does not divide the devices, the heads
            or a split size, or the graph cannot be split (the message says which and why).

    Example:
        >>> found = TensorSplit(sizes={"c_attn": 288, "c_proj": 96, "c_fc": 384, "mlp.c_proj": 384})
        >>> tp_sizes(None, heads=(12, 12), found=found, node_size=8, devices=64)
        (1, 2, 4)
        >>> tp_sizes(None, heads=None, found=found, node_size=8, devices=64)
        (1,)
        >>> tp_sizes([1, 2], heads=None, found=found, node_size=8, devices=64)
        (1, 2)
    """
    if asked is None:
        if heads is None or found.problem is not None or not found.sizes or node_size <= 0:
            return (1,)
        return tuple(t for t in range(1, node_size + 1) if node_size % t == 0 and devices % t == 0
                     and heads[0] % t == 0 and heads[1] % t == 0 and found.divides(t))
    out = []
    for t in dict.fromkeys(asked):
        if type(t) is not int or t < 1:
            raise PartitionOptionError(f"tp_sizes must be positive ints, got {list(asked)!r}")
        if t == 1:
            out.append(t)
            continue
        why = _refuse(t, heads, found, node_size, devices)
        if why:
            raise PartitionOptionError(f"tensor parallelism of {t} {why}")
        out.append(t)
    return tuple(sorted(out))


def _refuse(tp: int, heads: Heads | None, found: TensorSplit, node_size: int, devices: int) -> str | None:
    """Why ``tp`` cannot split this model on this cluster (with the fix), or ``None``."""
    if found.problem is not None:
        return f"cannot split this model: {found.problem}; search tp_sizes=(1,)"
    if not found.sizes:
        return "has nothing to split: no linear layer reading a 2-D weight inside a block; search tp_sizes=(1,)"
    if node_size > 0 and node_size % tp:
        return (f"does not divide the node size ({node_size} devices): a tp group must sit inside one node; "
                f"pick a divisor of {node_size}")
    if devices % tp:
        return f"does not divide the {devices} devices: pick a divisor"
    if heads is not None and (heads[0] % tp or heads[1] % tp):
        return (f"does not divide the model's heads ({heads[0]} attention, {heads[1]} key/value): each rank "
                "computes whole heads; pick a common divisor")
    bad = sorted({n for n in found.sizes.values() if n % tp})
    if bad:
        return f"does not divide the sizes the sharded layers split ({bad}): pick a divisor of them"
    return None


def tp_groups(cluster: Cluster, tp: int) -> Cluster:
    """The cluster the ``dp x pp`` ranks of a layout see when each is a group of ``tp`` devices:
    ``N / tp`` devices, nodes of ``node_size / tp``.

    Example:
        >>> c = tp_groups(Cluster.uniform(64, "A100-80GB"), 8)
        >>> len(c), c.devices[0].node_size
        (8, 1)
    """
    if tp == 1:
        return cluster
    coarse = cluster.with_devices(len(cluster) // tp)
    dev = cluster.devices[0]
    size = dev.node_size // tp if dev.node_size > 0 else 0
    return replace(coarse, devices=tuple(replace(d, node_size=size) for d in coarse.devices))
