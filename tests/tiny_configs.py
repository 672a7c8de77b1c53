"""A tiny config for every decoder-only causal-LM family transformers ships, made from its config's names.

``transformers``' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` lists every model type with a causal-LM
head. :func:`tiny_config` makes each one small enough to build, train and generate on a CPU in
about a second, without knowing the family: it starts from the config class's defaults and
shrinks what the standard names say is big (``hidden_size``, ``num_hidden_layers``,
``intermediate_size``...; a family's own spellings reach them through its ``attribute_map``),
then every other size-like integer it finds (an expert count, a LoRA rank, a state size), and
cuts every per-layer list to the new depth, keeping one layer of each kind the full model has
(sliding and full attention, dense and MoE). A float multiplier left at its neutral 1.0
(Granite's ``embedding_multiplier``, Cohere's ``logit_scale``...) is set to 1.5, so that a
path that skipped it would differ. Every dropout-like probability is zeroed
(:func:`families.zero_dropout`), so a train-mode forward is deterministic.

:func:`sweep_entries` classifies every entry: decoder-only families get a tiny config; the others
(encoder families used as decoders, decoders of encoder-decoder models, multimodal composites,
configs that do not build small) get the reason they are not swept.

``transformers`` is imported inside the functions: importing this module does not need it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["Entry", "TINY", "sweep_entries", "tiny_config", "build_model", "MAX_PARAMS"]

LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 8
HIDDEN = HEADS * HEAD_DIM
VOCAB = 96
MAX_PARAMS = 2_000_000  # a config over this after shrinking is reported as not tiny
# The standard names, set through each config's attribute_map (GPT-2's n_embd is hidden_size).
TINY: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "intermediate_size": 2 * HIDDEN,
    "max_position_embeddings": 128, "sliding_window": 4,
}
# Families whose configs check a relation the standard names alone break; each entry says which.
_OVERRIDES: dict[str, dict[str, Any]] = {
    "dots3_note_text": {"num_key_value_heads": HEADS},  # "num_key_value_heads must match num_attention_heads"
    "mamba2": {"num_heads": 8, "head_dim": 8},  # num_heads * head_dim must be hidden_size * expand (64)
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},  # "must be 0"
    # "If you want to use BertGenerationDecoder as a standalone, add is_decoder=True": without it the
    # decoder attends both ways and caches nothing.
    "bert-generation": {"is_decoder": True},
}
# Integers named like these are counts that stay small but above one (a router needs a choice).
_EXPERTS = re.compile(r"(^|_)(num_experts|num_local_experts|n_routed_experts|moe_num_experts|num_experts_total)$")
_TOP_K = re.compile(r"(experts_per_tok|top_k|topk|moe_k)$")
_SIZE = re.compile(r"(_size|_dim|_rank|_channels|_features|_width|_inner|_heads|_hidden)$"
                   r"|intermediate|^d_|^n_|(^|_)dff$|ffn")
# Float multipliers a family's forward applies at top level or per layer (Granite's, Cohere's
# logit scale, MiniCPM's): at their neutral 1.0 a generator that skipped them would still pass.
_SCALES = re.compile(r"multiplier|logit_scale|logits_scaling|scale_emb")
_KEEP = re.compile(r"token_id|vocab|position|window|max_|seq|chunk|group|bucket|window|theta|period|"
                   r"rope|bos|eos|pad|num_hidden_layers|layers$|stride|_every|interval|pattern|offset|freq")


@dataclass(frozen=True)
class Entry:
    """One entry of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``.

    Attributes:
        model_type: the config's ``model_type`` (the mapping's key).
        model: the causal-LM class's name.
        config: the tiny config, or ``None`` when the family is not swept.
        reason: why it is not swept (empty when it is).
    """

    model_type: str
    model: str
    config: Any = None
    reason: str = ""


def _layer_list(values: list[Any], n: int) -> list[Any]:
    # The first n of a per-layer list, then one layer of each kind the list holds that those miss
    # (Gemma 3's one full layer in six, Qwen3-Next's one in four).
    out = list(values[:n])
    missing = [v for v in dict.fromkeys(values) if v not in out]
    for k, v in enumerate(missing[: n - 1]):
        out[n - 1 - k] = v
    return out


def _derived(cls: type, key: str) -> bool:
    # A read-only property, computed from other attributes (Falcon's head_dim).
    attr = getattr(cls, key, None)
    return isinstance(attr, property) and attr.fset is None


def tiny_config(model_type: str) -> Any:
    """The config class of ``model_type`` with tiny sizes and no dropout.

    Raises:
        ValueError: the config cannot be made tiny (with the reason): a composite config with
            sub-configs, or one that fails to build with the tiny sizes.

    Example:
        >>> cfg = tiny_config("llama")
        >>> cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads
        (32, 4, 2)
    """
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    from families import zero_dropout

    cls = CONFIG_MAPPING[model_type]
    base = cls()
    subs = [k for k, v in vars(base).items() if isinstance(v, transformers.PreTrainedConfig)]
    if subs:
        raise ValueError(f"a composite config (sub-configs {subs}): its text model is swept on its own entry "
                         "where transformers lists one")
    if getattr(base, "is_encoder_decoder", False):
        raise ValueError("the decoder of an encoder-decoder model: not a decoder-only family")
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        raise ValueError("an encoder family (a masked LM whose causal-LM head needs is_decoder=True): not a "
                         "decoder-only family")
    depth = getattr(base, "num_hidden_layers", None)
    kwargs: dict[str, Any] = {}
    names = set(vars(base)) | set(getattr(base, "attribute_map", {}))
    for key, value in TINY.items():
        if (key in names or hasattr(base, key)) and not _derived(cls, key):
            kwargs[key] = value
    for key, value in vars(base).items():
        if key in kwargs or key.startswith("_") or isinstance(value, bool):
            continue
        if _derived(cls, key):
            continue
        if isinstance(value, int):
            if key.endswith("token_id") and value >= VOCAB:
                kwargs[key] = VOCAB - 1  # inside the tiny vocabulary (an embedding's padding_idx must be)
            elif "vocab" in key and value > VOCAB:
                kwargs[key] = VOCAB
            elif "heads" in key and value > HEADS:
                kwargs[key] = KV_HEADS if "kv" in key or "key_value" in key else HEADS
            elif _EXPERTS.search(key):
                kwargs[key] = min(value, 4)
            elif _TOP_K.search(key):
                kwargs[key] = min(value, 2)
            elif value > 64 and _SIZE.search(key) and not _KEEP.search(key):
                kwargs[key] = 16
        elif isinstance(value, float) and value == 1.0 and _SCALES.search(key):
            kwargs[key] = 1.5
        elif isinstance(value, list) and depth and len(value) == depth:
            kwargs[key] = _layer_list(value, LAYERS)
    # Sizes tied to others: a partial rotary within the head (GPT-J's rotary_dim), an attention
    # width that is the hidden size (RWKV's), expert groups that must divide the experts (DeepSeek's).
    for key, value in (("rotary_dim", HEAD_DIM // 2), ("attention_hidden_size", HIDDEN), ("n_group", 1),
                       ("topk_group", 1)):
        if key in names and isinstance(getattr(base, key, None), int):
            kwargs[key] = value
    if "qk_rope_head_dim" in names:  # multi-head latent attention: its rope part is the head_dim the rotary uses
        # (and its keys and values are made per query head from the latent: as many kv heads as heads)
        kwargs.update(qk_rope_head_dim=HEAD_DIM, qk_nope_head_dim=HEAD_DIM, v_head_dim=HEAD_DIM, head_dim=HEAD_DIM)
        if "num_key_value_heads" in names:
            kwargs["num_key_value_heads"] = HEADS
    kwargs.update(_OVERRIDES.get(model_type, {}))
    cfg = cls(**kwargs)
    return zero_dropout(cfg)


def build_model(entry: Entry, seed: int = 0) -> Any:
    """The entry's causal LM from its tiny config, in train mode, the same weights for a seed."""
    import torch
    import transformers

    torch.manual_seed(seed)
    return getattr(transformers, entry.model)(entry.config).train()


def _runs(model: str, cfg: Any) -> str | None:
    # Whether the plain model runs a forward and a short greedy generate on the tiny config;
    # the failure, if not (a family whose sizes are tied in ways the standard names do not say).
    import torch
    import transformers

    try:
        torch.manual_seed(0)
        built = getattr(transformers, model)(cfg).eval()
        ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            built(input_ids=ids)
    except Exception as err:  # the reason is the result
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"{type(err).__name__}: {text[:160]}"
    return None


def sweep_entries(only: list[str] | None = None, *, run: bool = True) -> list[Entry]:
    """Every entry of transformers' causal-LM mapping (or those named in ``only``), classified; with
    ``run``, an entry whose tiny model's plain forward fails is not swept either (the reason given)."""
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    entries = []
    for model_type, model in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        if only is not None and model_type not in only:
            continue
        try:
            cfg = tiny_config(model_type)
            with torch.device("meta"):
                built = getattr(transformers, model)(cfg)
        except Exception as err:  # the reason is the result
            text = str(err).strip().splitlines()[0] if str(err).strip() else ""
            entries.append(Entry(model_type, model, reason=text if isinstance(err, ValueError) and
                                 text.startswith(("a composite", "the decoder", "an encoder")) else
                                 f"the tiny config does not build: {type(err).__name__}: {text[:160]}"))
            continue
        n = sum(t.numel() for t in built.parameters())
        if n > MAX_PARAMS:
            big = sorted(((t.numel(), name) for name, t in built.named_parameters()), reverse=True)[:3]
            entries.append(Entry(model_type, model, reason=f"{n:,} parameters after shrinking (largest {big})"))
            continue
        failure = _runs(model, cfg) if run else None
        if failure:
            entries.append(Entry(model_type, model, reason=f"the tiny config does not run in transformers: {failure}"))
            continue
        entries.append(Entry(model_type, model, config=cfg))
    return entries
