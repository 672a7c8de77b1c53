"""Tensor parallelism over a job's stages: each stage's plan found, its graph split, its whole weights replicated.

Legend: ``tp`` ranks of a stage's tensor-parallel group, ``t`` this process's rank in it, ``s`` a
stage, ``p`` pipeline ranks, ``dp`` replicas.

``runtime.parallel.tensor`` splits one stage graph over one group. A trainer with
``TensorParallel(size=tp)`` runs ``dp * p * tp`` processes (``runtime.parallel.data_parallel``
lays them out ``("dp", "pp", "tp")``, tp innermost); on each, :func:`split_stages` maps the plan
(the user's patterns, else the model's Hugging Face ``base_model_tp_plan``) onto every stage it
holds and splits that stage over the process's tp group, after the stage is materialised and
before data parallelism and the optimizer see its parameters. :func:`refuse_unsupported` says,
before any of that, which other options tensor parallelism does not compose with yet, and what to
run instead.

Example:
    >>> refuse_unsupported(1, engine="fsdp")  # tp 1: anything goes
    >>> refuse_unsupported(2, engine="replicate")
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import fx, nn

from runtime.parallel.tensor import (
    DERIVED_PLANS,
    TensorParallelError,
    TensorParallelLayout,
    config_patterns,
    parallelize_stage,
    plan_for,
    whole_entries,
)
from runtime.parallel.vocab import parallelize_vocab, vocab_names

__all__ = ["TensorParallelOptionError", "split_stages", "refuse_unsupported", "tp_problems", "plan_problem",
           "size_problems", "vocab_only_plan"]

log = logging.getLogger(__name__)


class TensorParallelOptionError(TensorParallelError):
    """An option the trainer was given does not compose with tensor parallelism yet; the message
    names both and what to run instead."""


def refuse_unsupported(tp: int, *, engine: str) -> None:
    """Refuse, on every rank alike and before any weight is touched, what ``tp > 1`` does not run yet.

    Args:
        tp: tensor-parallel ranks per stage.
        engine: ``DataParallel.engine``.

    Raises:
        TensorParallelOptionError: naming the option, the tp size and the way out.
    """
    if tp <= 1:
        return
    if engine == "fsdp":
        raise TensorParallelOptionError(
            f"TensorParallel(size={tp}) with DataParallel(engine='fsdp'): FSDP2 over tp-sharded stages (2-D "
            "sharding) is not wired yet; use engine='replicate' (optionally shard_optimizer=True for ZeRO-1) "
            "with tensor parallelism, or tp=1 with FSDP")


def split_stages(
    stages: Mapping[int, nn.Module], patterns: Mapping[str, str] | None, model: nn.Module, tp_mesh: Any,
    tied: Collection[str] = (), *, vocab_last: int | None = None,
) -> dict[int, TensorParallelLayout]:
    """Split each of this process's ``stages`` over its tp group, in place (``parallelize_stage``).

    A weight tied between stages (GPT-2's embedding and LM head) stays whole, a ``Replicate``
    ``DTensor`` like the other whole weights: rank ``t`` of each stage holding it keeps a copy, and
    ``runtime.parallel.tied`` sums the copies' gradients between the ranks ``t`` of those stages.
    Two stages of this process reading one weight read one parameter, as before the split. With
    ``vocab_last`` the embedding and the LM head are split by vocabulary rows instead
    (``runtime.parallel.vocab``): a tied one then holds rank ``t``'s rows on both stages.

    Args:
        stages: stage index -> this process's materialised stage module (a ``GraphModule``).
        patterns: module pattern -> style (``'colwise'``, ``'rowwise'``, ``'packed_colwise'``);
            ``None``: the model's ``config.base_model_tp_plan``, or pipecut's own for its model type
            (``runtime.parallel.tensor.config_patterns``: GPT-2).
        model: the model the plan is bound to (for its config).
        tp_mesh: this process's tp group as a 1-D ``DeviceMesh`` (``PipelineMesh.tp_mesh``).
        tied: the names of weights tied between stages (``StagedModel.shared_params``).
        vocab_last: with ``TensorParallel(vocab=True)``, the model's last stage (the only one whose LM
            head may be split); ``None``: the embedding and the LM head stay whole.

    Returns:
        Stage index -> what was sharded there (a stage with no planned weight is left whole).

    Raises:
        TensorParallelError: no plan (a model without a Hugging Face tp plan, none derived and none
            given), a style not implemented, a tied weight in the plan, or a stage that cannot be
            split (see ``parallelize_stage``); ``VocabParallelError`` (a subclass) where the vocabulary
            cannot be split (see ``parallelize_vocab``).
    """
    config = getattr(model, "config", None)
    if patterns is None:
        owner = type(config).__name__ if config is not None else f"{type(model).__name__} (no Hugging Face config)"
        patterns = config_patterns(config, owner)
    tp = tp_mesh.size()
    problems = size_problems(config, tp) if config is not None else []  # the plan is resolved above
    if problems:
        raise TensorParallelError(f"TensorParallel(size={tp}) does not fit {type(config).__name__}: "
                                  f"{'; '.join(problems)}: pick a size that divides them")
    out: dict[int, TensorParallelLayout] = {}
    swapped: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # one Replicate parameter a whole weight
    rows: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # one Shard(0) parameter a vocabulary weight
    vocab = vocab_names(model) if vocab_last is not None else frozenset()
    for s, module in sorted(stages.items()):
        if not isinstance(module, fx.GraphModule):
            raise TensorParallelError(f"stage {s} is a {type(module).__name__}, not a traced graph: tensor "
                                      "parallelism rewrites the stage's graph; partition the model with pipecut")
        plan = plan_for(patterns, [n for n, _ in module.named_parameters()])
        shared = sorted(set(plan) & set(tied))
        if shared:
            raise TensorParallelError(
                f"stage {s}: {shared[0]!r} is tied between stages and in the tp plan ({plan[shared[0]]}): a tied "
                "weight stays whole on every tp rank; drop its pattern from TensorParallel(plan=...)")
        out[s] = parallelize_stage(module, plan, tp_mesh)
        if vocab:
            parallelize_vocab(module, vocab, tp_mesh, last=s == vocab_last, shared=rows)
        _replicate_whole(s, module, tp_mesh, swapped)
        log.info("stage %d: %d weights split over tp=%d", s, len(out[s].sharded), out[s].tp)
    if not vocab and not any(lay.sharded for lay in out.values()):
        log.warning("tensor parallelism: no weight of stages %s matches the tp plan; they run whole on every "
                    "tp rank (check the plan's patterns against the parameter names)", sorted(stages))
    return out


def _replicate_whole(
    s: int, gm: fx.GraphModule, mesh: Any, swapped: dict[int, tuple[nn.Parameter, nn.Parameter]],
) -> int:
    """Make the weights ``parallelize_stage`` left whole ``Replicate`` DTensors on the tp mesh, read
    through ``to_local``; returns how many. ``swapped`` (a whole parameter's id -> it and its
    ``DTensor`` parameter, the first kept so that its id is not reused) is shared by the stages of
    one process, so a weight two of them read stays one parameter.

    An optimizer's multi-tensor (``foreach``) update refuses a list mixing ``DTensor`` shards and
    plain tensors, and one step runs over both: with every parameter a ``DTensor`` (torchtitan's
    layout too) the step groups them as one. The local tensor is the whole weight itself (the
    same storage), and its gradient stays whole and equal on every tp rank, as before.
    """
    from torch.distributed.tensor import DTensor, Replicate

    mine = {id(prm) for prm in gm.parameters() if not isinstance(prm, DTensor)}
    for prm in gm.parameters():
        if id(prm) in mine and id(prm) not in swapped:
            whole = DTensor.from_local(prm.detach(), mesh, [Replicate()], run_check=False)
            swapped[id(prm)] = (prm, nn.Parameter(whole, requires_grad=prm.requires_grad))
    for prefix, sub in gm.named_modules():
        for node in sub.graph.nodes if isinstance(sub, fx.GraphModule) else ():
            called = sub.get_submodule(str(node.target)) if node.op == "call_module" else None
            if called is not None and not isinstance(called, fx.GraphModule) and any(
                    id(p) in mine for p in called.parameters()):
                raise TensorParallelError(
                    f"stage {s}: node {node.name} calls {prefix + '.' if prefix else ''}{node.target} "
                    f"({type(called).__name__}) as a module holding weights, which tensor parallelism cannot read "
                    "locally: trace the model with torch.export (pipecut's default for Hugging Face models)")
    for _, mod in gm.named_modules(remove_duplicate=False):
        for leaf, prm in list(mod._parameters.items()):
            if prm is not None and id(prm) in mine:
                mod._parameters[leaf] = swapped[id(prm)][1]
    new = {id(swapped[i][1]) for i in mine}
    for _, sub in gm.named_modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        graph = sub.graph
        for node in list(graph.nodes):
            if node.op != "get_attr" or not isinstance(_attr(sub, str(node.target)), nn.Parameter):
                continue
            if id(_attr(sub, str(node.target))) not in new:
                continue
            with graph.inserting_after(node):
                local = graph.call_method("to_local", (node,))
            local.meta = dict(node.meta)
            node.replace_all_uses_with(local, delete_user_cb=lambda u, local=local: u is not local)
        graph.lint()
        sub.recompile()
    return len(mine)


def _attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.Tensor) else None


# -- whether a config can be split over tp, read from the config alone ---------------------------
# tp_problems says, in plain facts, why tp cannot split a model: the family has no tensor-parallel
# plan (transformers' base_model_tp_plan, or pipecut's own for GPT-2), its plan splits only what
# pipecut keeps whole, or a size the split divides does not divide by tp: the attention heads, the
# key/value heads (fewer than tp is fine when tp is a multiple of them: each rank then keeps them
# whole and takes its queries' heads, Megatron-LM's way), the MLP's hidden units. The command
# line turns the facts into flag words before it builds anything (pipecut train --tp).

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


def vocab_only_plan(config: Any) -> bool:
    """Whether the config's own tp plan splits nothing but the token embedding, by vocabulary rows
    (transformers' ``embedding_rowwise`` on a base-model child, torch's ``RowwiseParallel`` on an
    ``nn.Embedding``; DiffLlama's, GPT-OSS's, LFM2's plans). pipecut runs such a plan as
    ``TensorParallel(vocab=True)`` (``runtime.parallel.vocab``): the embedding and the LM head split
    over the vocabulary, the layers whole.

    Example:
        >>> from types import SimpleNamespace
        >>> vocab_only_plan(SimpleNamespace(base_model_tp_plan={"embed_tokens": "embedding_rowwise"}))
        True
        >>> vocab_only_plan(SimpleNamespace(base_model_tp_plan={"embed_tokens": "embedding_rowwise",
        ...                                                     "layers.*.mlp.up_proj": "colwise"}))
        False
    """
    plan = getattr(config, "base_model_tp_plan", None) or {}
    splits = set(plan) - whole_entries(plan)
    return not splits and any(s == "embedding_rowwise" and "." not in p for p, s in plan.items())


def plan_problem(config: Any) -> str | None:
    """Why the config's tp plan cannot split the model, as a fact: it has none (and pipecut derives
    none for its ``model_type``), or every entry is one pipecut keeps whole; ``None`` when it can.

    Example:
        >>> from types import SimpleNamespace
        >>> plan_problem(SimpleNamespace(model_type="bloom"))
        'bloom has no tensor-parallel plan (no base_model_tp_plan in its config, and pipecut derives none)'
        >>> plan_problem(SimpleNamespace(model_type="gpt2")) is None  # pipecut's own plan
        True
    """
    model_type = getattr(config, "model_type", "") or type(config).__name__
    plan = getattr(config, "base_model_tp_plan", None) or DERIVED_PLANS.get(model_type)
    if not plan:
        return (f"{model_type} has no tensor-parallel plan (no base_model_tp_plan in its config, and pipecut "
                "derives none)")
    if not set(plan) - whole_entries(plan) and not vocab_only_plan(config):
        return (f"{model_type}'s tensor-parallel plan splits only weights pipecut keeps whole ({sorted(plan)}: "
                "MoE experts, embeddings, replicated weights), so tp would split nothing")
    return None


def size_problems(config: Any, tp: int) -> list[str]:
    """Which sizes of ``config`` that column/row pairs split do not divide by ``tp``, as facts: the
    heads, the kv heads (fewer than ``tp`` is fine when ``tp`` is a multiple of them), the MLP's
    hidden units; empty when all do.

    Example:
        >>> from types import SimpleNamespace
        >>> cfg = SimpleNamespace(num_attention_heads=12, num_key_value_heads=4, intermediate_size=64)
        >>> size_problems(cfg, 4), size_problems(cfg, 8)  # 4 kv heads for 8 ranks: each takes its queries'
        ([], ['num_attention_heads = 12 does not divide by 8'])
        >>> size_problems(cfg, 3)
        ['num_key_value_heads = 4 neither divides by 3 nor divides it', 'intermediate_size = 64 does not divide by 3']
    """
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
    vocab = getattr(config, "vocab_size", None)
    if vocab_only_plan(config) and isinstance(vocab, int) and vocab % tp:
        problems.append(f"vocab_size = {vocab} does not divide by {tp} (the plan splits the embedding's rows)")
    return problems


def tp_problems(config: Any, tp: int) -> list[str]:
    """Why ``tp`` ranks cannot split the model of ``config`` with its own tp plan, as facts
    (:func:`plan_problem`, then :func:`size_problems`); empty when they can, and for ``tp`` 1.

    Example:
        >>> from types import SimpleNamespace
        >>> cfg = SimpleNamespace(model_type="llama", base_model_tp_plan={"layers.*.mlp.up_proj": "colwise"},
        ...                       num_attention_heads=12, num_key_value_heads=4, intermediate_size=64)
        >>> tp_problems(cfg, 4), tp_problems(cfg, 8)
        ([], ['num_attention_heads = 12 does not divide by 8'])
        >>> tp_problems(SimpleNamespace(model_type="bloom"), 2)
        ['bloom has no tensor-parallel plan (no base_model_tp_plan in its config, and pipecut derives none)']
    """
    if tp <= 1:
        return []
    problem = plan_problem(config)
    return [problem] if problem is not None else size_problems(config, tp)
