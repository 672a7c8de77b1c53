"""A Hugging Face decoder-only causal LM seen as the parts a stage runs, and the model's own code to run them.

Legend: ``B`` sequences, ``T`` new positions this call, ``K`` positions seen so far (``K >= T``),
``H`` hidden size, ``V`` vocabulary; ``i`` a layer index (the model's, global).

A stage never calls the model's top-level ``forward`` (it loops over every layer); it calls the
model's *modules* one by one, as that forward does, with the model's own helpers in between:

* the embedding side: the token embedding (``get_input_embeddings()``) and every other child of
  the base model that is not a layer, the final norm or the rotary embedding (GPT-2's ``wpe`` and
  ``drop``, BLOOM's embedding norm...);
* the rotary embedding module (``rotary_emb``), run on each stage from the position ids (it has no
  weights, so sending its output would cost bytes and save nothing), once per kind of layer when
  its ``forward`` takes a ``layer_type`` (Gemma 3's local and global rotaries);
* ``transformers.masking_utils.create_causal_mask`` / ``create_sliding_window_causal_mask``, one
  per kind of layer the stage holds, sized from the stage's own cache (see :func:`layer_masks`);
* each decoder layer, called with the keyword names its ``forward`` declares (the cache's keyword
  is ``cache`` in transformers 5.24 and ``past_key_values`` before: read from the signature);
* the final norm and the head, on the last position only (as ``generate`` asks with
  ``logits_to_keep=1``).

What the model's forward does *between* those parts (an embedding multiplier, a position
embedding's sum, a logit scale or soft-cap) is read off the plan's traced graph and replayed
(:mod:`runtime.generate.glue`), not listed per family here.

``transformers`` is imported inside the functions that need it only: pipecut does not require it.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from partitioner.inference.kv import config_int
from partitioner.tracing.hf import blocks, is_hf_model
from runtime.generate.errors import GenerateModelError

__all__ = ["DecoderParts", "decoder_parts", "new_cache", "layer_masks", "drop_rows", "rotary_embeddings",
           "run_layer", "generation_problems", "layer_count", "GENERATED_KINDS", "RECURRENT_KINDS", "FULL", "SLIDING"]

log = logging.getLogger(__name__)

FULL = "full_attention"
SLIDING = "sliding_attention"
_CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value", "layer_past")
_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm")
_ROTARIES = ("rotary_emb",)
_CARRY_PREFIX = "prev_"  # a layer's parameter taking what the layer before it handed on (prev_topk_indices)


@dataclass(frozen=True, eq=False)
class DecoderParts:
    """Where each part of a decoder-only causal LM is, by qualified module name in ``model``.

    Attributes:
        model: the whole ``...ForCausalLM`` (its tensors may be on ``meta`` for other stages).
        embed: the token embedding.
        others: the base model's other children on the embedding side (a learned position
            embedding, the embedding dropout or norm), in the model's order.
        rotary: the rotary embedding module, or ``None``.
        layers: the decoder layers (transformer blocks), in order: layer ``i`` is ``layers[i]``.
        kinds: per layer, the mask it attends with: ``'full_attention'`` or ``'sliding_attention'``.
        norm: the final norm, or ``None`` for a family without one (GPT-1, TrOCR): what its forward
            does between the last layer and the head is then glue.
        head: the LM head.
        cache_keyword: the name of the decoder layers' ``forward`` parameter taking the cache.
        layer_keywords: every parameter name of the decoder layers' ``forward``.
        rotary_kinds: whether the rotary's ``forward`` takes a ``layer_type`` (one rotary per kind).
        carries: the decoder layers' ``forward`` parameters taking what the layer before handed on
            beside its hidden states (``prev_...``: Zaya's router states, HY-V4's top-k indices);
            a layer then returns ``(hidden_states, *carried)`` and the first layer gets ``None``.
        tail: the base model's children that run between the last layer and the final norm
            (HY-V4's ``hc_head``), found by the glue; they are on the norm's stage.
        post: the base model's children that run between the final norm and the head (OPT's
            ``project_out``), found by the glue; they are on the head's stage.
        glue: the model's arithmetic between these parts (:func:`runtime.generate.glue.derive_glue`),
            set by the generator from its plan; ``None`` until then.
    """

    model: nn.Module
    embed: str
    others: tuple[str, ...]
    rotary: str | None
    layers: tuple[str, ...]
    kinds: tuple[str, ...]
    norm: str | None
    head: str
    cache_keyword: str
    layer_keywords: frozenset[str]
    rotary_kinds: bool = False
    carries: tuple[str, ...] = ()
    tail: tuple[str, ...] = ()
    post: tuple[str, ...] = ()
    glue: Any = None  # a runtime.generate.glue.Glue (parts cannot import glue: glue reads the parts)

    @property
    def config(self) -> Any:
        """The model's config."""
        return self.model.config

    @property
    def family(self) -> str:
        """The model's class and ``model_type``, as errors name the family."""
        return f"{type(self.model).__name__} (model_type {self.config.model_type!r})"

    def module(self, name: str) -> nn.Module:
        """The submodule ``name`` of the model."""
        return self.model.get_submodule(name)

    @property
    def pre(self) -> tuple[str, ...]:
        """The modules of the embedding side: the token embedding, then the others."""
        return (self.embed, *self.others)


def decoder_parts(model: nn.Module) -> DecoderParts:
    """Find the parts of a Hugging Face decoder-only causal LM.

    Raises:
        GenerateModelError: not a Hugging Face model, an encoder-decoder, or a model without
            decoder layers, a final norm or an LM head where these families keep them.

    Example:
        >>> import transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
        ...                                num_attention_heads=2, intermediate_size=32)
        >>> parts = decoder_parts(transformers.LlamaForCausalLM(cfg))
        >>> parts.embed, parts.layers, parts.norm, parts.head, parts.cache_keyword
        ('model.embed_tokens', ('model.layers.0', 'model.layers.1'), 'model.norm', 'lm_head', 'cache')
    """
    name = type(model).__name__
    if not is_hf_model(model):
        raise GenerateModelError(
            f"{name} is not a Hugging Face transformers model; the generator runs decoder-only causal "
            "LMs of transformers (LlamaForCausalLM, GPT2LMHeadModel...): build the model with transformers"
        )
    hf: Any = model  # a PreTrainedModel: its config and helpers are not nn.Module attributes to mypy
    config = hf.config
    if getattr(config, "is_encoder_decoder", False):
        raise GenerateModelError(
            f"{name} is an encoder-decoder model; the generator runs decoder-only causal LMs only for now"
        )
    names = {id(m): n for n, m in model.named_modules()}
    embed_module, head_module = hf.get_input_embeddings(), hf.get_output_embeddings()
    if embed_module is None or head_module is None or id(head_module) not in names:
        raise GenerateModelError(
            f"{name} has no LM head (get_output_embeddings() is {type(head_module).__name__}): the "
            "generator needs a ...ForCausalLM model, not its base model"
        )
    layers = tuple(blocks(model))
    # The module holding the layers' list is the base (OPT's model.decoder, not model).
    holder = layers[0].rpartition(".")[0].rpartition(".")[0] if layers else ""
    base: nn.Module = model.get_submodule(holder) if layers else hf.base_model
    base_name = holder if layers else names[id(base)]
    children = dict(base.named_children())
    norm = next((n for n in _NORMS if n in children), None) or _norm_after(children, layers, base_name)
    if not layers:
        raise GenerateModelError(
            f"{name}: found no decoder layers (model._no_split_modules = "
            f"{getattr(model, '_no_split_modules', None)}) among {sorted(children)}; the generator runs a "
            "model's decoder layers one by one"
        )
    signature = inspect.signature(type(model.get_submodule(layers[0])).forward).parameters
    cache_keyword = next((k for k in _CACHE_KEYWORDS if k in signature), None)
    if cache_keyword is None:
        raise GenerateModelError(
            f"{name}: its decoder layers' forward takes no cache (parameters {list(signature)}; looked for "
            f"{list(_CACHE_KEYWORDS)})"
        )

    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if callable(supports) and not supports():  # transformers' own word: MiniMax, RWKV, xLSTM...
        raise GenerateModelError(
            f"{name}: transformers keeps this family's cache in a class of its own, not a DynamicCache "
            "(its _supports_default_dynamic_cache() is False); the generator keeps a DynamicCache per stage"
        )

    def qualified(child: str) -> str:
        return f"{base_name}.{child}".lstrip(".")

    embed = names[id(embed_module)]
    container = layers[0].rpartition(".")[0]
    rotary = next((qualified(n) for n in _ROTARIES if n in children), None)
    taken = {embed, container, qualified(norm) if norm else None, rotary}
    # The embedding side: the other children, but none holding the layers (BERT's encoder) or the
    # token embedding (ModernBERT's embeddings block: its other ops, a norm, are glue).
    others = tuple(qualified(n) for n in children if qualified(n) not in taken
                   and not container.startswith(qualified(n) + ".") and not embed.startswith(qualified(n) + "."))
    rotary_kinds = rotary is not None and "layer_type" in inspect.signature(
        type(model.get_submodule(rotary)).forward).parameters
    return DecoderParts(
        model=model, embed=embed, others=others, rotary=rotary, layers=layers, kinds=_kinds(config, len(layers)),
        norm=qualified(norm) if norm else None, head=names[id(head_module)], cache_keyword=cache_keyword,
        layer_keywords=frozenset(signature), rotary_kinds=rotary_kinds,
        carries=tuple(k for k in signature if k.startswith(_CARRY_PREFIX)),
    )


def _norm_after(children: Mapping[str, nn.Module], layers: tuple[str, ...], base_name: str) -> str | None:
    # A family whose final norm has its own name (BioGPT's layer_norm, CTRL's layernorm): the last
    # child registered after the layers that is a norm.
    if not layers:
        return None
    top = layers[0].removeprefix(base_name + ".").split(".")[0] if base_name else layers[0].split(".")[0]
    order = list(children)
    if top not in order:
        return None
    after = [n for n in order[order.index(top) + 1:] if "norm" in type(children[n]).__name__.lower()]
    return after[-1] if after else None


def _kinds(config: Any, n: int) -> tuple[str, ...]:
    # As the models' forwards choose: config.layer_types where the config has them (Gemma 2, Qwen2),
    # else one kind for all layers, sliding when config.sliding_window is set (Mistral, Phi-3, Mixtral).
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(types[:n])
    return (SLIDING if getattr(config, "sliding_window", None) else FULL,) * n


def new_cache(parts: DecoderParts) -> Any:
    """An empty ``DynamicCache`` for the model, one (lazily filled) layer entry per model layer, as
    the model's own forward makes it: a stage fills only its own layers' entries."""
    from transformers import DynamicCache

    return DynamicCache(config=parts.config)


def rotary_embeddings(parts: DecoderParts, hidden: torch.Tensor, position_ids: torch.Tensor,
                      kinds: Collection[str]) -> Any:
    """The rotary's ``(cos, sin)`` for ``position_ids``, or ``None`` without a rotary; per layer kind
    (a dict by kind) when the rotary's ``forward`` takes a ``layer_type``, as the model's forward calls it."""
    if parts.rotary is None:
        return None
    rotary = parts.module(parts.rotary)
    if parts.rotary_kinds:
        # A rotary that lists the kinds it serves (LFM3's skips its convolution layers) runs for those.
        served = getattr(rotary, "layer_types", None)
        return {kind: rotary(hidden, position_ids, layer_type=kind) for kind in sorted(set(kinds))
                if served is None or kind in served}
    return rotary(hidden, position_ids)


# Per kind of layer, the transformers helper making its attention mask and the helper's options,
# as the families' forwards call them (transformers' own vocabulary of layer kinds, the one
# DynamicCache dispatches on): the indexer of an indexed layer needs causality spelled out even
# where a plain causal mask could be skipped. A layer that keeps a state (linear attention, a
# state-space mixer, a convolution) gets the 2-D padding mask of its new positions
# (``create_recurrent_attention_mask``); a hybrid layer both.
_ATTENTION_HELPERS = {
    FULL: ("create_causal_mask", {}),
    SLIDING: ("create_sliding_window_causal_mask", {}),
    "chunked_attention": ("create_chunked_causal_mask", {}),
    "indexed_attention": ("create_causal_mask", {"allow_is_causal_skip": False}),
    "hybrid": ("create_causal_mask", {}),
    "hybrid_sliding": ("create_sliding_window_causal_mask", {}),
}
RECURRENT_KINDS = frozenset({"linear_attention", "conv", "hybrid", "hybrid_sliding"})
_RECURRENT_HELPER = "create_recurrent_attention_mask"
GENERATED_KINDS = frozenset(_ATTENTION_HELPERS) | RECURRENT_KINDS | {"moe", "mlp", "dummy"}


def layer_masks(
    parts: DecoderParts, own: Collection[int], hidden: torch.Tensor, attention_mask: torch.Tensor,
    position_ids: torch.Tensor, cache: Any,
) -> dict[str, dict[str, Any]]:
    """The masks of each kind of layer in ``own``, by kind, as the keyword arguments the layer takes
    them under, made by transformers' own helpers.

    ``attention_mask`` is the 2-D mask (B, K) of every position seen so far, new ones included.

    An attention layer's mask goes in as ``attention_mask``. A layer keeping a state (linear
    attention, a state-space mixer, a convolution) gets the padding mask of its new positions there;
    a hybrid layer, which holds both, gets its attention mask as ``attention_mask`` and the state's
    under its other keyword ending in ``mask`` (Falcon-H1's ``mamba_attention_mask``). Layers
    without attention (``'moe'``, ``'mlp'``) get no mask.

    The helpers size the mask from the cache: how many positions a layer of that kind holds (a
    sliding layer keeps only its window). Left to choose, they read the *model's* first layer of
    that kind, which may live on another stage and so be empty here. Every layer of one kind has
    seen the same positions, so the helper is given a one-layer view of this cache holding this
    stage's first own layer of that kind: exact, and nothing is stored or sent to track the others.

    Raises:
        GenerateModelError: a layer kind transformers' caches do not know.
    """
    from transformers import masking_utils
    from transformers.cache_utils import Cache

    masks: dict[str, dict[str, Any]] = {}
    for i in sorted(own):
        kind = parts.kinds[i]
        if kind in masks:
            continue
        if kind not in GENERATED_KINDS:
            raise GenerateModelError(
                f"layer {i} ({parts.layers[i]}) is of kind {kind!r}; the generator makes the masks of "
                f"{sorted(GENERATED_KINDS)} layers only"
            )
        view = Cache(layers=[cache.layers[i]])
        available = {"config": parts.config, "inputs_embeds": hidden, "attention_mask": attention_mask,
                     "cache": view, "position_ids": position_ids}
        made: dict[str, Any] = {}
        if kind in _ATTENTION_HELPERS:
            helper, options = _ATTENTION_HELPERS[kind]
            made["attention_mask"] = _call(getattr(masking_utils, helper), **available, **options)
        if kind in RECURRENT_KINDS:
            state_mask = _call(getattr(masking_utils, _RECURRENT_HELPER), **available)
            other = sorted(k for k in parts.layer_keywords if k.endswith("mask") and k != "attention_mask")
            if kind in _ATTENTION_HELPERS and not other:
                raise GenerateModelError(
                    f"layer {i} ({parts.layers[i]}) is a hybrid ({kind!r}) whose forward takes one mask only "
                    f"(parameters {sorted(parts.layer_keywords)}): the generator does not know which of its "
                    "attention and its state it masks"
                )
            made[other[0] if kind in _ATTENTION_HELPERS else "attention_mask"] = state_mask
        masks[kind] = made
    alibi = _alibi(parts, hidden, attention_mask)
    if alibi is not None:
        for made in masks.values():
            made["alibi"] = alibi
    return masks


def _alibi(parts: DecoderParts, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | None:
    # An ALiBi bias its forward makes from the 2-D mask of every position seen so far, with the base
    # model's own builder (BLOOM's build_alibi_tensor): it depends on the padding, not on a layer.
    build = getattr(getattr(parts.model, "base_model", None), "build_alibi_tensor", None)
    if "alibi" not in parts.layer_keywords or build is None:
        return None
    heads = config_int(parts.config, _CONFIG_HEADS)
    if heads is None:
        raise GenerateModelError(f"{parts.family}: its layers take an ALiBi bias, and its config names no head count "
                                 f"(looked for {list(_CONFIG_HEADS)})")
    return build(attention_mask, heads, dtype=hidden.dtype)  # type: ignore[no-any-return]


def drop_rows(cache: Any, keep: torch.Tensor) -> None:
    """Keep only the sequences ``keep`` (their indices, ascending) in every layer of ``cache``.

    ``Cache.batch_select_indices`` drops rows of keys and values only; a layer that keeps a state
    (linear attention, a convolution, and the state half of a hybrid layer) drops its rows through
    its ``reorder_cache``, which selects the same rows of its states.
    """
    from transformers import cache_utils

    stateful: Any = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)  # transformers 5.x
    for layer in cache.layers:
        if stateful is not None and isinstance(layer, stateful):
            stateful.reorder_cache(layer, keep)
        if hasattr(layer, "batch_select_indices"):  # keys and values (a hybrid's attention half too)
            layer.batch_select_indices(keep)


def run_layer(
    parts: DecoderParts, i: int, hidden: torch.Tensor, masks: Mapping[str, Any], position_ids: torch.Tensor,
    position_embeddings: Any, cache: Any, carried: Sequence[Any] = (),
) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """Layer ``i`` on ``hidden`` (B, T, H): it reads and appends its keys and values in ``cache``.

    Returns its hidden states and what it hands the next layer beside them (``parts.carries``:
    ``carried`` is what the layer before handed on, empty for the first layer, which gets ``None``).

    Raises:
        GenerateModelError: a layer taking ``prev_...`` values returned fewer values than it takes.
    """
    kind = parts.kinds[i]
    if parts.rotary_kinds:
        position_embeddings = position_embeddings.get(kind)
    available: dict[str, Any] = {
        **masks[kind], "position_ids": position_ids, parts.cache_keyword: cache, "use_cache": True,
        "position_embeddings": position_embeddings,
    }
    if getattr(parts.config, "alibi", None) is False:
        available["alibi"] = None  # Falcon's layers take the ALiBi bias its forward makes only with config.alibi
    kwargs = {k: v for k, v in available.items() if k in parts.layer_keywords}
    if parts.carries:
        kwargs.update(zip(parts.carries, carried or (None,) * len(parts.carries)))
    layer = parts.module(parts.layers[i])
    if "position_embeddings" in kwargs and _given_none(parts, i, layer, hidden, kwargs):
        kwargs["position_embeddings"] = None
    out = layer(hidden, **kwargs)
    if not parts.carries:
        # transformers 5 layers return the hidden states; earlier ones a tuple starting with them.
        return (out[0] if isinstance(out, tuple) else out), ()
    n = len(parts.carries)
    if not isinstance(out, tuple) or len(out) < 1 + n:
        raise GenerateModelError(
            f"{parts.family}: layer {i} ({parts.layers[i]}) takes {list(parts.carries)} from the layer before it but "
            f"returned {type(out).__name__}{'' if not isinstance(out, tuple) else f' of {len(out)}'}; the generator "
            f"hands a layer's values after its hidden states to those parameters of the next"
        )
    return out[0], tuple(out[1:1 + n])


def _given_none(parts: DecoderParts, i: int, layer: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether layer ``i`` runs with ``position_embeddings=None``: a layer that reads nothing of the
    rotary in the trace either was given none by the model's forward (LaraMini's NoPE layers, which
    would apply a rotary they are given) or ignores the one it was given (Cohere 2's global layers,
    which unpack it all the same). The layer tells which, once, at its first call (a prefill, so
    on an empty cache): given ``None`` on a cache of its own, it runs, or it raises and needs the
    rotary. The self-check then holds the choice to the model's own forward."""
    glue = parts.glue
    name = parts.layers[i]
    if glue is None or name not in glue.unrotated:
        return False
    if name not in glue.none_ok:
        trial = {**kwargs, "position_embeddings": None, parts.cache_keyword: new_cache(parts)}
        try:
            layer(hidden, **trial)
            glue.none_ok[name] = True
        except Exception as err:  # the layer unpacks what it is given: it was given the rotary
            log.debug("%s: %s needs the rotary it ignores (given None: %s: %s)", parts.family, name,
                      type(err).__name__, err)
            glue.none_ok[name] = False
    return bool(glue.none_ok[name])


def _call(fn: Any, **available: Any) -> Any:
    """``fn`` with the arguments its signature names: the cache under whichever name it takes."""
    params = inspect.signature(fn).parameters
    kwargs = {k: v for k, v in available.items() if k in params}
    if "cache" in available and "cache" not in params:
        key = next((k for k in _CACHE_KEYWORDS if k in params), None)
        if key is None:
            raise GenerateModelError(
                f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)} takes no cache (parameters "
                f"{list(params)}); this transformers version ({_version()}) is not supported by the generator"
            )
        kwargs[key] = available["cache"]
    return fn(**kwargs)


def _version() -> str:
    transformers = sys.modules.get("transformers")
    return str(getattr(transformers, "__version__", "unknown"))


# -- what a config rules out, before any model is built -------------------------------------------
# The generator keeps each layer's keys and values, or its state, in a transformers DynamicCache and
# makes the masks of the layer kinds in GENERATED_KINDS. generation_problems says, as facts, what in a
# config rules that out: layers of another kind, no attention and no layer kinds at all (a recurrent
# model whose cache transformers' DynamicCache does not hold), or more stages than layers. The
# command line turns the facts into flag words (pipecut generate); anything the config does not
# show is caught when the generator is built (its self-check).

_CONFIG_HEADS = ("num_attention_heads", "n_head", "num_heads")
_CONFIG_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")


def layer_count(config: Any) -> int | None:
    """The decoder layers ``config`` declares (``num_hidden_layers`` or a family's own name), if any."""
    return config_int(config, _CONFIG_LAYERS)


def generation_problems(config: Any, p: int) -> list[str]:
    """Why ``p`` stages cannot generate with the model of ``config``, as facts; empty when they can.

    Example:
        >>> from types import SimpleNamespace
        >>> cfg = SimpleNamespace(model_type="deepseek_v4", num_attention_heads=4, num_hidden_layers=2,
        ...                       layer_types=["compressed_sparse_attention", "full_attention"])
        >>> generation_problems(cfg, 2)
        ["deepseek_v4's layers include 'compressed_sparse_attention' layers, whose cache the generator does not keep"]
        >>> generation_problems(SimpleNamespace(model_type="llama", num_attention_heads=4, num_hidden_layers=4), 8)
        ['8 stages for 4 layers: each stage but the last holds at least one layer']
    """
    name = getattr(config, "model_type", "") or type(config).__name__
    problems = []
    types = getattr(config, "layer_types", None) or ()
    kinds = sorted({k for k in types if k not in GENERATED_KINDS})
    if kinds:
        problems.append(f"{name}'s layers include {', '.join(repr(k) for k in kinds)} layers, whose cache the "
                        "generator does not keep")
    elif not types and not config_int(config, _CONFIG_HEADS):
        problems.append(f"{name} has neither attention heads nor layer kinds in its config (a recurrent model): "
                        "its cache is a state the generator does not keep")
    layers = layer_count(config)
    if layers is not None and p > layers:
        problems.append(f"{p} stages for {layers} layers: each stage but the last holds at least one layer")
    return problems
