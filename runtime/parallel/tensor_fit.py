"""Whether a Hugging Face config can be split over ``tp`` ranks, read from the config alone (no model built).

Legend: ``tp`` ranks of the tensor-parallel group.

:func:`tp_problems` says, in plain facts, why ``tp`` cannot split a model: the family has no
tensor-parallel plan (transformers' ``base_model_tp_plan``, or pipecut's own for GPT-2), or a
size the split divides does not divide by ``tp``: the attention heads, the key/value heads (fewer
than ``tp`` is fine when ``tp`` is a multiple of them: each rank then keeps them whole and takes
its queries' heads, Megatron-LM's way), the MLP's hidden units. The command line turns the facts
into flag words before it builds anything (``pipecut train --tp``).
"""

from __future__ import annotations

from typing import Any

from runtime.parallel.tensor import DERIVED_PLANS, WHOLE_STYLES

__all__ = ["tp_problems"]

# The config names of each size the column/row pairs split, in the order they are checked.
_HEADS = ("num_attention_heads", "n_head", "num_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num")
_HIDDEN_UNITS = ("intermediate_size", "n_inner", "ffn_hidden_size")


def _first(config: Any, names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return name, value
    return None


def tp_problems(config: Any, tp: int) -> list[str]:
    """Why ``tp`` ranks cannot split the model of ``config``, as facts; empty when they can.

    Example:
        >>> from types import SimpleNamespace
        >>> cfg = SimpleNamespace(model_type="llama", base_model_tp_plan={"layers.*.mlp.up_proj": "colwise"},
        ...                       num_attention_heads=12, num_key_value_heads=4, intermediate_size=64)
        >>> tp_problems(cfg, 4)
        []
        >>> tp_problems(cfg, 8)  # 4 kv heads for 8 ranks: kept whole, each rank takes its queries' heads
        ['num_attention_heads = 12 does not divide by 8']
        >>> tp_problems(cfg, 3)
        ['num_key_value_heads = 4 neither divides by 3 nor divides it', 'intermediate_size = 64 does not divide by 3']
        >>> tp_problems(SimpleNamespace(model_type="opt"), 2)
        ['opt has no tensor-parallel plan (no base_model_tp_plan in its config, and pipecut derives none)']
    """
    if tp <= 1:
        return []
    model_type = getattr(config, "model_type", "") or type(config).__name__
    plan = getattr(config, "base_model_tp_plan", None) or DERIVED_PLANS.get(model_type)
    if not plan:
        return [(f"{model_type} has no tensor-parallel plan (no base_model_tp_plan in its config, and pipecut "
                 "derives none)")]
    experts = [p for p, s in plan.items() if s == "moe_tp_experts"]
    split = [p for p, s in plan.items() if s not in WHOLE_STYLES and not any(p.startswith(e + ".") for e in experts)]
    if not split:
        return [(f"{model_type}'s tensor-parallel plan splits only weights pipecut keeps whole ({sorted(plan)}: "
                 "MoE experts, embeddings, replicated weights), so tp would split nothing")]
    problems = []
    heads = _first(config, _HEADS)
    if heads is not None and heads[1] % tp:
        problems.append(f"{heads[0]} = {heads[1]} does not divide by {tp}")
    kv = _first(config, _KV_HEADS)
    if kv is not None and kv[1] % tp and tp % kv[1]:
        problems.append(f"{kv[0]} = {kv[1]} neither divides by {tp} nor divides it")
    units = _first(config, _HIDDEN_UNITS)
    if units is not None and units[1] % tp:
        problems.append(f"{units[0]} = {units[1]} does not divide by {tp}")
    return problems
