"""A Hugging Face decoder-only causal LM seen as the parts a stage runs, and the model's own code to run them.

Legend: ``B`` sequences, ``T`` new positions this call, ``K`` positions seen so far (``K >= T``),
``H`` hidden size, ``V`` vocabulary; ``i`` a layer index (the model's, global).

A stage never calls the model's top-level ``forward`` (it loops over every layer); it calls the
model's *modules* one by one, as that forward does, with the model's own helpers in between:

* the token embedding (``get_input_embeddings()``; Gemma's scaled embedding scales itself), a
  learned position embedding where the model has one (GPT-2's ``wpe``) and the embedding dropout;
* the rotary embedding module (``rotary_emb``), run on each stage from the position ids (it has no
  weights, so sending its output would cost bytes and save nothing);
* ``transformers.masking_utils.create_causal_mask`` / ``create_sliding_window_causal_mask``, one
  per kind of layer the stage holds, sized from the stage's own cache (see :func:`layer_masks`);
* each decoder layer, called with the keyword names its ``forward`` declares (the cache's keyword
  is ``cache`` in transformers 5.24 and ``past_key_values`` before: read from the signature);
* the final norm, the head on the last position only (as ``generate`` asks with
  ``logits_to_keep=1``) and the config's ``final_logit_softcapping`` (Gemma 2).

``transformers`` is imported inside the functions that need it only: pipecut does not require it.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from partitioner.tracing.hf import blocks, is_hf_model
from runtime.generate.errors import GenerateModelError

__all__ = ["DecoderParts", "decoder_parts", "new_cache", "embed", "layer_masks", "run_layer", "final_logits",
           "CHECKED_FAMILIES", "FULL", "SLIDING"]

log = logging.getLogger(__name__)

FULL = "full_attention"
SLIDING = "sliding_attention"
# The families whose greedy tokens the tests compare with ``model.generate`` (config.model_type).
CHECKED_FAMILIES = frozenset({"llama", "qwen2", "mistral", "gemma2", "gpt2", "phi3", "mixtral", "qwen2_moe"})
_CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value", "layer_past")
_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm")
_POSITIONS = ("wpe", "embed_positions")
_DROPOUTS = ("drop", "embed_dropout", "emb_drop")


@dataclass(frozen=True, eq=False)
class DecoderParts:
    """Where each part of a decoder-only causal LM is, by qualified module name in ``model``.

    Attributes:
        model: the whole ``...ForCausalLM`` (its tensors may be on ``meta`` for other stages).
        embed: the token embedding.
        positions: a learned absolute position embedding called with the position ids, or ``None``.
        dropout: the dropout after the embeddings, or ``None``.
        rotary: the rotary embedding module, or ``None``.
        layers: the decoder layers (transformer blocks), in order: layer ``i`` is ``layers[i]``.
        kinds: per layer, the mask it attends with: ``'full_attention'`` or ``'sliding_attention'``.
        norm: the final norm.
        head: the LM head.
        softcap: ``config.final_logit_softcapping`` (``None`` when the model does not cap).
        cache_keyword: the name of the decoder layers' ``forward`` parameter taking the cache.
        layer_keywords: every parameter name of the decoder layers' ``forward``.
    """

    model: nn.Module
    embed: str
    positions: str | None
    dropout: str | None
    rotary: str | None
    layers: tuple[str, ...]
    kinds: tuple[str, ...]
    norm: str
    head: str
    softcap: float | None
    cache_keyword: str
    layer_keywords: frozenset[str]

    @property
    def config(self) -> Any:
        """The model's config."""
        return self.model.config

    def module(self, name: str) -> nn.Module:
        """The submodule ``name`` of the model."""
        return self.model.get_submodule(name)

    @property
    def pre(self) -> tuple[str, ...]:
        """The modules the embedding side runs: token embedding, position embedding, dropout."""
        return tuple(n for n in (self.embed, self.positions, self.dropout) if n is not None)


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
    base: nn.Module = hf.base_model
    base_name = names[id(base)]
    children = dict(base.named_children())
    norm = next((n for n in _NORMS if n in children), None)
    if not layers or norm is None:
        raise GenerateModelError(
            f"{name}: found {len(layers)} decoder layers (model._no_split_modules = "
            f"{getattr(model, '_no_split_modules', None)}) and final norm {norm!r} among {sorted(children)}; "
            f"the generator needs both (it knows the final norms {list(_NORMS)})"
        )
    signature = inspect.signature(type(model.get_submodule(layers[0])).forward).parameters
    cache_keyword = next((k for k in _CACHE_KEYWORDS if k in signature), None)
    if cache_keyword is None:
        raise GenerateModelError(
            f"{name}: its decoder layers' forward takes no cache (parameters {list(signature)}; looked for "
            f"{list(_CACHE_KEYWORDS)})"
        )
    if config.model_type not in CHECKED_FAMILIES:
        log.warning("%s (model_type %r): the generator's tokens are compared with model.generate for %s only; "
                    "check this family's before relying on them", name, config.model_type,
                    sorted(CHECKED_FAMILIES))

    def child(options: tuple[str, ...]) -> str | None:
        found = next((n for n in options if n in children), None)
        return None if found is None else f"{base_name}.{found}".lstrip(".")

    return DecoderParts(
        model=model, embed=names[id(embed_module)], positions=child(_POSITIONS), dropout=child(_DROPOUTS),
        rotary=child(("rotary_emb",)), layers=layers, kinds=_kinds(config, len(layers)),
        norm=f"{base_name}.{norm}".lstrip("."), head=names[id(head_module)],
        softcap=getattr(config, "final_logit_softcapping", None), cache_keyword=cache_keyword,
        layer_keywords=frozenset(signature),
    )


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


def embed(parts: DecoderParts, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Hidden states (B, T, H) of ``input_ids`` (B, T): token embedding, plus the learned position
    embedding of ``position_ids`` where the model has one, then the embedding dropout."""
    hidden: torch.Tensor = parts.module(parts.embed)(input_ids)
    if parts.positions is not None:
        hidden = hidden + parts.module(parts.positions)(position_ids).to(hidden.device)
    if parts.dropout is not None:
        hidden = parts.module(parts.dropout)(hidden)
    return hidden


def layer_masks(
    parts: DecoderParts, own: Collection[int], hidden: torch.Tensor, attention_mask: torch.Tensor,
    position_ids: torch.Tensor, cache: Any,
) -> dict[str, Any]:
    """The attention mask of each kind the layers ``own`` use, made by transformers' own helpers.

    ``attention_mask`` is the 2-D mask (B, K) of every position seen so far, new ones included.

    The helpers size the mask from the cache: how many positions a layer of that kind holds (a
    sliding layer keeps only its window). Left to choose, they read the *model's* first layer of
    that kind, which may live on another stage and so be empty here. Every layer of one kind has
    seen the same positions, so the helper is given a one-layer view of this cache holding this
    stage's first own layer of that kind: exact, and nothing is stored or sent to track the others.
    """
    from transformers import masking_utils
    from transformers.cache_utils import Cache

    helpers = {FULL: masking_utils.create_causal_mask, SLIDING: masking_utils.create_sliding_window_causal_mask}
    masks: dict[str, Any] = {}
    for i in sorted(own):
        kind = parts.kinds[i]
        if kind in masks:
            continue
        if kind not in helpers:
            raise GenerateModelError(
                f"layer {i} ({parts.layers[i]}) is of kind {kind!r}; the generator makes masks for "
                f"{sorted(helpers)} layers only"
            )
        view = Cache(layers=[cache.layers[i]])
        masks[kind] = _call(helpers[kind], config=parts.config, inputs_embeds=hidden,
                            attention_mask=attention_mask, cache=view, position_ids=position_ids)
    return masks


def run_layer(
    parts: DecoderParts, i: int, hidden: torch.Tensor, masks: Mapping[str, Any], position_ids: torch.Tensor,
    position_embeddings: Any, cache: Any,
) -> torch.Tensor:
    """Layer ``i`` on ``hidden`` (B, T, H): it reads and appends its keys and values in ``cache``."""
    available: dict[str, Any] = {
        "attention_mask": masks[parts.kinds[i]], "position_ids": position_ids, parts.cache_keyword: cache,
        "use_cache": True, "position_embeddings": position_embeddings,
    }
    kwargs = {k: v for k, v in available.items() if k in parts.layer_keywords}
    out = parts.module(parts.layers[i])(hidden, **kwargs)
    # transformers 5 layers return the hidden states; earlier ones a tuple starting with them.
    return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]


def final_logits(parts: DecoderParts, hidden: torch.Tensor) -> torch.Tensor:
    """Logits (B, V) of the last position of ``hidden`` (B, T, H), already through the final norm:
    the head on that position only, then the config's soft-capping."""
    logits: torch.Tensor = parts.module(parts.head)(hidden[:, -1:, :])
    if parts.softcap is not None:
        logits = torch.tanh(logits / parts.softcap) * parts.softcap
    return logits[:, -1, :]


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
