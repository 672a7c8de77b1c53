"""Whether a decoder-only config can be generated on ``p`` stages, read from the config alone (no model built).

Legend: ``p`` stages.

The generator keeps each layer's keys and values in a transformers ``DynamicCache`` and makes the
masks of full and sliding attention. :func:`generation_problems` says, as facts, what in a config
rules that out before anything is built: layers of another kind (a state-space, linear-attention
or convolution layer keeps a state, not keys and values), no attention at all (Mamba, RWKV), or
more stages than layers. The command line turns the facts into flag words (``pipecut generate``).
Anything the config does not show is caught when the generator is built (its self-check).
"""

from __future__ import annotations

from typing import Any

__all__ = ["generation_problems", "layer_count", "ATTENTION_KINDS"]

ATTENTION_KINDS = frozenset({"full_attention", "sliding_attention"})
_HEADS = ("num_attention_heads", "n_head", "num_heads")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")


def _first(config: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def layer_count(config: Any) -> int | None:
    """The decoder layers ``config`` declares (``num_hidden_layers`` or a family's own name), if any."""
    return _first(config, _LAYERS)


def generation_problems(config: Any, p: int) -> list[str]:
    """Why ``p`` stages cannot generate with the model of ``config``, as facts; empty when they can.

    Example:
        >>> from types import SimpleNamespace
        >>> cfg = SimpleNamespace(model_type="qwen3_next", num_attention_heads=4, num_hidden_layers=4,
        ...                       layer_types=["linear_attention"] * 3 + ["full_attention"])
        >>> generation_problems(cfg, 2)
        ["qwen3_next's layers include 'linear_attention' layers, whose cache is a state, not keys and values"]
        >>> generation_problems(SimpleNamespace(model_type="llama", num_attention_heads=4, num_hidden_layers=4), 8)
        ['8 stages for 4 layers: each stage but the last holds at least one layer']
    """
    name = getattr(config, "model_type", "") or type(config).__name__
    problems = []
    kinds = sorted({k for k in (getattr(config, "layer_types", None) or ()) if k not in ATTENTION_KINDS})
    if kinds:
        problems.append(f"{name}'s layers include {', '.join(repr(k) for k in kinds)} layers, whose cache is a "
                        "state, not keys and values")
    elif not _first(config, _HEADS):
        problems.append(f"{name} has no attention heads in its config (a state-space or recurrent model): its "
                        "cache is a state, not keys and values")
    layers = layer_count(config)
    if layers is not None and p > layers:
        problems.append(f"{p} stages for {layers} layers: each stage but the last holds at least one layer")
    return problems
