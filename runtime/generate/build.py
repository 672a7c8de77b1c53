"""Give each stage of a generator its modules, real and loaded, as training does: only its own tensors.

Legend: ``s`` a stage index.

A stage's modules are the model's own (its embedding, its layers, the final norm, the head), so a
stage is gathered under the model's qualified names (:func:`stage_module`) and handed to the same
two steps the trainer uses: :func:`runtime.state.materialize.materialize` for a model built under
:func:`runtime.state.materialize.empty_weights` (only these stages' meta tensors are allocated) and
:func:`runtime.state.weights.load_weights` (only these stages' tensors are read from the
checkpoint, through transformers' own name conversion).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch
from torch import nn

from partitioner.plan.plan import Plan
from runtime.generate.cut import StageSpan
from runtime.generate.parts import DecoderParts
from runtime.state.materialize import InitFn, materialize
from runtime.state.weights import LoadReport, Weights, load_weights, stage_tensors

__all__ = ["stage_module", "build_stages"]

log = logging.getLogger(__name__)


def stage_module(parts: DecoderParts, span: StageSpan) -> nn.Module:
    """The model's modules that ``span`` runs, gathered in one module under their qualified names
    (its ``state_dict`` keys are the model's): no tensor is copied.

    Example:
        >>> import transformers
        >>> from runtime.generate.parts import decoder_parts
        >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
        ...                                num_attention_heads=2, intermediate_size=32)
        >>> parts = decoder_parts(transformers.LlamaForCausalLM(cfg))
        >>> last = stage_module(parts, StageSpan(1, embed=False, layers=range(1, 2), norm=True, head=True))
        >>> sorted(last.state_dict())[:3], len(last.state_dict())  # layer 1's 9 tensors, the norm, the head
        (['lm_head.weight', 'model.layers.1.input_layernorm.weight', 'model.layers.1.mlp.down_proj.weight'], 11)
    """
    names: list[str] = []
    if span.embed:
        # and what else the embedding side calls (NanoChat's final norm, run on the embeddings too)
        names += [*parts.pre, *(n for n in (parts.glue.pre if parts.glue is not None else ()) if n not in parts.pre)]
    if len(span.layers):
        names += [parts.layers[i] for i in span.layers]
        if parts.rotary is not None:
            names.append(parts.rotary)
    if span.norm:
        names += [*parts.tail, *([parts.norm] if parts.norm else [])]
    if span.head:
        names += [*parts.post, parts.head]
    root = nn.Module()
    for name in names:
        *path, leaf = name.split(".")
        node = root
        for key in path:
            if key not in node._modules:
                node.add_module(key, nn.Module())
            node = node._modules[key]  # type: ignore[assignment]
        node.add_module(leaf, parts.module(name))
    return root


def build_stages(
    plan: Plan, parts: DecoderParts, spans: Sequence[StageSpan], *,
    weights: str | os.PathLike[str] | Weights | None = None, device: torch.device | str | None = None,
    seed: int = 0, init_fn: InitFn | None = None,
) -> tuple[dict[int, nn.Module], LoadReport | None]:
    """Make each stage's tensors real on ``device`` (those still on ``meta``) and load ``weights``.

    Args:
        plan: the plan, bound to the model (its tied names are read from it).
        parts: the model's parts.
        spans: what each stage runs.
        weights: a checkpoint (a Hugging Face folder, a ``.safetensors`` file, a DCP folder...) or a
            :class:`~runtime.state.weights.Weights` with options; ``None`` keeps the model's values
            (a model on ``meta`` is then initialised as the trainer would, from ``seed``).
        device: where meta tensors are made (and each stage's modules moved); default: the CPU for
            meta tensors, and real modules stay where they are.
        seed: the initialisation seed for meta tensors no checkpoint fills.
        init_fn: ``init_fn(name, module)`` for those tensors instead of the model's own initialiser.

    Returns:
        Each stage's module (:func:`stage_module`) by stage index, and the load's report (``None``
        without ``weights``).

    Raises:
        MaterializeError: a meta tensor no initialiser writes.
        WeightsError: a checkpoint key missing, unexpected, or of another shape or dtype.
    """
    model = parts.model
    stages = {span.index: stage_module(parts, span) for span in spans}
    spec = None if weights is None else weights if isinstance(weights, Weights) else Weights(weights)
    into, stage_of = stage_tensors(stages)
    target = torch.device(device) if device is not None else torch.device("cpu")
    if any(t.is_meta for t in into.values()) or any(t.is_meta for st in stages.values() for t in st.buffers()):
        will_load = set(into) if spec is not None else set()
        report = materialize(model, stages, target, init_fn=init_fn, seed=seed, will_load=will_load)
        log.info("generator: materialised %d tensors (%.1f MiB) on %s", len(report.tensors),
                 report.bytes / 2**20, target)
        plan.refresh_binding()
    if device is not None:
        for st in stages.values():
            st.to(target)
    loaded = None
    if spec is not None:
        into, stage_of = stage_tensors(stages)
        loaded = load_weights(
            spec.source, into, names=list(model.state_dict(keep_vars=True)), aliases=plan.param_aliases,
            stage_of=stage_of, prefix=spec.prefix, cast=spec.cast, strict=spec.strict, model=model,
            allow_nonfinite=spec.allow_nonfinite,
        )
    return stages, loaded
