"""The key/value cache a decoder keeps: its layers' shapes read from a Hugging Face config, and its bytes.

Legend: ``B`` sequences, ``L`` positions a sequence reaches, ``h`` query heads, ``k`` key/value
heads, ``d`` head dimension, ``w`` a sliding layer's window.

A ``transformers`` ``DynamicCache`` (5.24) holds, per layer, keys and values of shape ``(B, k, n, d)``:
``n = L`` for a full-attention layer (``DynamicLayer``), ``n = min(L, w - 1)`` for a sliding one
(``DynamicSlidingWindowLayer`` keeps the last ``w - 1`` positions: the next step's own key makes
``w``). So a layer holds ``2 x B x k x n x d`` elements. The layer kinds are read from the config as
the cache reads them (``get_layer_types_and_kwargs``): ``config.layer_types`` when set, else sliding
when ``config.sliding_window`` is set (``attention_chunk_size`` too), else full; ``'moe'`` and
``'mlp'`` layers hold nothing. Pure: a config object in, plain numbers out; transformers is not
imported (tests/partitioner/inference compares these bytes with filled caches).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from partitioner.errors import PartitionOptionError

__all__ = ["KVLayer", "kv_layers", "kv_cache_bytes", "pricing_problems", "FULL", "SLIDING", "NONE"]

FULL = "full_attention"
SLIDING = "sliding_attention"
NONE = "none"  # a layer without attention ('moe', 'mlp'): its cache entry stays empty
_SLIDING_KINDS = ("sliding_attention", "chunked_attention")
_EMPTY_KINDS = ("moe", "mlp", "dummy")


@dataclass(frozen=True)
class KVLayer:
    """One decoder layer's attention, as its cache sees it.

    Attributes:
        kind: ``'full_attention'``, ``'sliding_attention'`` or ``'none'`` (no cache).
        heads: query heads ``h`` (the decode step's attention FLOPs).
        kv_heads: key/value heads ``k`` (what the cache holds).
        head_dim: ``d``.
        window: a sliding layer's window ``w``; ``None`` for a full layer.

    Example:
        >>> KVLayer(FULL, 32, 8, 128).positions(4096), KVLayer(SLIDING, 32, 8, 128, 4096).positions(9000)
        (4096, 4095)
        >>> KVLayer(FULL, 32, 8, 128).bytes_per_position(2)   # keys and values, 8 heads of 128, bf16
        4096.0
    """

    kind: str
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None = None

    def positions(self, length: int) -> int:
        """Positions the layer's cache holds once a sequence reaches ``length``."""
        if self.kind == NONE:
            return 0
        if self.window is not None:
            return min(length, self.window - 1)
        return length

    def bytes_per_position(self, dtype_bytes: float) -> float:
        """Bytes of keys and values for one position of one sequence."""
        return 0.0 if self.kind == NONE else 2.0 * self.kv_heads * self.head_dim * dtype_bytes

    def attended(self, length: int) -> int:
        """Positions a new token attends to at ``length`` (its own included): the decode step's reads."""
        if self.kind == NONE:
            return 0
        return length if self.window is None else min(length, self.window)


def kv_cache_bytes(layers: Sequence[KVLayer], *, batch: int, length: int, dtype_bytes: float) -> float:
    """Bytes of the caches of ``layers`` holding ``batch`` sequences of ``length`` positions.

    Example:
        >>> layers = [KVLayer(SLIDING, 4, 2, 16, window=3), KVLayer(FULL, 4, 2, 16)]  # as Gemma 2
        >>> kv_cache_bytes(layers, batch=2, length=8, dtype_bytes=4)  # 2 x (k, v) x 2 x 16 x 4 B x (2 + 8)
        5120.0
    """
    return float(sum(batch * layer.positions(length) * layer.bytes_per_position(dtype_bytes) for layer in layers))


def kv_layers(config: Any) -> tuple[KVLayer, ...]:
    """Each decoder layer's :class:`KVLayer`, read from a Hugging Face config.

    Reads ``num_hidden_layers`` (GPT-2: ``n_layer``), ``num_attention_heads`` (``n_head``),
    ``num_key_value_heads`` (default: the attention heads), ``head_dim`` (default: ``hidden_size``
    over the heads; GPT-2: ``n_embd``), the layer kinds and ``sliding_window``.

    Raises:
        PartitionOptionError: the config does not say its layers or heads, or names a layer kind
            whose cache is not keys and values (linear attention, convolution states...).

    Example:
        >>> from types import SimpleNamespace
        >>> cfg = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        ...                       hidden_size=32, sliding_window=None)
        >>> kv_layers(cfg)[0]
        KVLayer(kind='full_attention', heads=4, kv_heads=2, head_dim=8, window=None)
    """
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    n = config_int(config, ("num_hidden_layers", "n_layer", "num_layers"))
    heads = config_int(config, ("num_attention_heads", "n_head", "num_heads"))
    if n is None or heads is None:
        raise PartitionOptionError(
            f"{type(config).__name__} does not say its decoder layers and attention heads (num_hidden_layers / "
            "n_layer, num_attention_heads / n_head): inference costing reads the key/value cache's shape from them"
        )
    kv_heads = config_int(config, ("num_key_value_heads", "num_kv_heads", "n_head_kv")) or heads
    hidden = config_int(config, ("hidden_size", "n_embd", "d_model"))
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden else None)
    if head_dim is None:
        raise PartitionOptionError(
            f"{type(config).__name__} says neither head_dim nor hidden_size / n_embd: inference costing needs the "
            "attention head dimension"
        )
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if window is not None else "chunked_attention" if chunk is not None
                 else FULL] * n
    layers = []
    for i, kind in enumerate(list(types)[:n]):
        if kind in _EMPTY_KINDS:
            layers.append(KVLayer(NONE, heads, kv_heads, head_dim))
        elif kind in _SLIDING_KINDS:
            size = window if kind == "sliding_attention" else chunk
            if size is None:
                raise PartitionOptionError(f"layer {i} is {kind!r} but the config gives no window size")
            layers.append(KVLayer(SLIDING, heads, kv_heads, head_dim, int(size)))
        elif kind == FULL:
            layers.append(KVLayer(FULL, heads, kv_heads, head_dim))
        else:
            raise PartitionOptionError(
                f"layer {i} of {type(config).__name__} is {kind!r}: inference costing prices key/value caches of "
                f"full and sliding attention only (layer kinds {FULL!r}, {', '.join(map(repr, _SLIDING_KINDS))}, "
                f"{', '.join(map(repr, _EMPTY_KINDS))})"
            )
    return tuple(layers)


def pricing_problems(config: Any) -> list[str]:
    """Why inference costing cannot price ``config``'s caches, as facts (empty when it can): what
    :func:`kv_layers` would raise, for a caller that checks a config before building anything.

    Example:
        >>> from types import SimpleNamespace
        >>> pricing_problems(SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
        ...                                  layer_types=["linear_attention", "full_attention"]))[0][:49]
        "layer 0 of SimpleNamespace is 'linear_attention':"
    """
    try:
        kv_layers(config)
    except PartitionOptionError as err:
        return [str(err)]
    return []


def config_int(config: Any, names: tuple[str, ...]) -> int | None:
    """The first of ``names`` that ``config`` sets to an int (a family's own spelling of a size)."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
