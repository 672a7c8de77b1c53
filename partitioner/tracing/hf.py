"""Hugging Face ``transformers`` models, traced as they are: no cache, a ModelOutput out, whole blocks.

A model is a Hugging Face model when ``transformers`` is already imported and the model is one of
its ``PreTrainedModel`` s; pipecut never imports ``transformers`` itself, so it stays an optional
dependency. For such a model ``trace`` (and so ``partition`` and ``Plan.bind``):

* passes ``use_cache=False`` (where the forward takes it) and, where the model would return a
  tuple, ``return_dict=True`` as keyword inputs of the trace, unless the caller gave them: the
  key/value cache is an object no pipeline stage can send, and the output is the model's
  ``ModelOutput``, whose tensors are its fields. Nothing is written to the model or its config;
* uses ``torch.export`` (transformers v5 has no ``torch.fx`` tracer; ``symbolic_trace`` fails on
  every model's ``**kwargs`` forward), so ``method='auto'`` goes straight to export;
* names, when the trace still fails, the fix that applies to a Hugging Face model
  (:func:`failure_hint`) instead of the generic advice about leaf modules, which export ignores.

``partition`` also reads :func:`block_depth`: by default it cuts only between whole transformer
blocks (``granularity='module'`` at the blocks' depth), the modules transformers itself never
splits across devices (``model._no_split_modules``).
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

from torch import nn

__all__ = ["is_hf_model", "trace_kwargs", "blocks", "block_depth", "failure_hint"]

log = logging.getLogger(__name__)

# torch.export's complaint about an output it cannot flatten, when that output is a cache object.
_CACHE = re.compile(r"Found <class '(?:[\w.]*\.)?(\w*Cache)'> in output")


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers.PreTrainedModel`` (``False`` when transformers is not imported).

    Example:
        >>> from torch import nn
        >>> is_hf_model(nn.Linear(2, 2))
        False
    """
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return False
    base = getattr(transformers, "PreTrainedModel", None)
    return isinstance(base, type) and isinstance(model, base)


def trace_kwargs(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword inputs to trace a Hugging Face model with: ``kwargs`` plus ``use_cache=False``
    (when ``forward`` has that parameter) and ``return_dict=True`` (when ``forward`` names it, or
    takes ``**kwargs`` and the config does not already ask for a ModelOutput), the caller's
    values kept.

    Non-tensor keywords are specialised into the graph, so the stages take the tensors only.

    Example:
        >>> from torch import nn
        >>> class Lm(nn.Module):
        ...     def forward(self, input_ids, use_cache=None, return_dict=None):
        ...         return input_ids
        >>> trace_kwargs(Lm(), {"attention_mask": None})
        {'attention_mask': None, 'use_cache': False, 'return_dict': True}
        >>> class Plain(nn.Module):
        ...     def forward(self, x):
        ...         return x
        >>> trace_kwargs(Plain(), {})
        {}
    """
    out = dict(kwargs)
    try:
        params = dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):  # a forward without a readable signature: pass nothing more
        return out
    if "use_cache" in params:
        out.setdefault("use_cache", False)
    # A ModelOutput, not a tuple: return_dict=True where forward names it (transformers v4). v5's
    # forwards take it through **kwargs and default to config.return_dict; a non-tensor there
    # makes torch.export refuse dynamic sizes (torch 2.13), so it is passed only when the config
    # says otherwise (that trace then fixes every size). A custom forward may take neither.
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    config_dicts = getattr(getattr(model, "config", None), "return_dict", True) is not False
    if "return_dict" in params or (takes_kwargs and not config_dicts):
        out.setdefault("return_dict", True)
    if out.get("use_cache"):
        log.warning(
            "tracing %s with use_cache=%r: the key/value cache it returns cannot cross pipeline stages; "
            "leave use_cache out (pipecut passes use_cache=False)", type(model).__name__, out["use_cache"],
        )
    return out


def blocks(model: nn.Module) -> list[str]:
    """The qualified names of the model's transformer blocks, outermost only, in model order.

    A block is a module whose class ``transformers`` lists in ``model._no_split_modules`` (the
    modules it never splits across devices itself: ``LlamaDecoderLayer``, ``T5Block``...). A
    model that lists none (BioGPT, CTRL) has as blocks the children of its one ``ModuleList`` of
    ``config.num_hidden_layers`` modules of one class, where it has exactly one such list.

    Example:
        >>> from torch import nn
        >>> class Block(nn.Linear): ...
        >>> class Lm(nn.Module):
        ...     _no_split_modules = ["Block"]
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.embed, self.layers = nn.Embedding(4, 2), nn.ModuleList(Block(2, 2) for _ in range(2))
        >>> blocks(Lm())
        ['layers.0', 'layers.1']
    """
    classes = set(getattr(model, "_no_split_modules", None) or ())
    found: list[str] = []
    for name, module in model.named_modules():
        if name and type(module).__name__ in classes and not any(name.startswith(b + ".") for b in found):
            found.append(name)
    if not found and not classes:
        return _layer_list(model)
    return found


def _layer_list(model: nn.Module) -> list[str]:
    # The children of the one ModuleList holding config.num_hidden_layers modules of one class.
    depth = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if not isinstance(depth, int) or depth < 1:
        return []
    lists = [(name, module) for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and len(module) == depth
             and len({type(m) for m in module}) == 1]
    if len(lists) != 1:
        return []
    name, module = lists[0]
    return [f"{name}.{i}" if name else str(i) for i in range(len(module))]


def block_depth(model: nn.Module) -> int | None:
    """The module depth of the model's transformer blocks (``model.layers.3`` is depth 3), for
    ``granularity='module'``; the most common depth when blocks sit at several (BERT's embeddings
    count as a block one level up), ``None`` when the model names no blocks."""
    depths = Counter(name.count(".") + 1 for name in blocks(model))
    if not depths:
        return None
    return max(depths, key=lambda d: (depths[d], d))


def failure_hint(model: nn.Module, failures: Sequence[tuple[str, BaseException]]) -> str:
    """What to change when a Hugging Face model could not be traced, for that failure.

    Example:
        >>> from torch import nn
        >>> err = RuntimeError("Found <class 'transformers.cache_utils.DynamicCache'> in output, which is ...")
        >>> print(failure_hint(nn.Linear(2, 2), [("torch.export.export(strict=False)", err)]))
        ... # doctest: +ELLIPSIS
        To fix: the model returned its key/value cache (DynamicCache), ...
    """
    name = type(model).__name__
    exported = [e for tracer, e in failures if tracer.startswith("torch.export")]
    if not exported:  # method='fx' was asked for
        return (
            "To fix: Hugging Face models are traced with torch.export (transformers v5 has no torch.fx "
            "tracer); use method='auto' or method='export'."
        )
    cache = _CACHE.search("\n".join(str(e) for e in exported))
    if cache:
        return (
            f"To fix: the model returned its key/value cache ({cache.group(1)}), an object no pipeline "
            "stage can send. Trace without it: do not pass use_cache=True (pipecut passes "
            "use_cache=False when forward takes it); if this model's forward has no use_cache "
            "parameter, pass example_kwargs={'use_cache': False}, or build the model from a config "
            "with use_cache=False."
        )
    return (
        f"To fix: {name} is a Hugging Face model, traced with torch.export (leaf_modules do not apply). "
        "Pass every input its forward needs as a tensor (example_kwargs={'attention_mask': ..., "
        "'decoder_input_ids': ...}; an encoder-decoder needs decoder_input_ids or labels); build the "
        "model with attn_implementation='sdpa' or 'eager' when the failure is in a fused attention "
        "kernel; and check that the model exports on its own: torch.export.export(model, args, "
        "kwargs | {'use_cache': False}, strict=False) raises the same error when its forward has "
        "data-dependent Python control flow, which its authors must make exportable."
    )
