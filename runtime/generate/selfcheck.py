"""The generator's self-check: a short probe through the cached path must give the model's own logits.

Legend: ``B`` probe sequences (2, the second left-padded), ``T`` probe positions, ``L`` layers.

The stages run the model's modules with the glue read off its traced graph
(:mod:`runtime.generate.glue`), so a family's arithmetic is the model's by construction. The
check makes sure of it, for families nobody has listed: a probe prefill through fresh stage
runners (the generator's own path, its masks, rotaries and cache included) against the model's
own ``forward`` on the same tokens, mask and positions. Where they differ, the first part that
differs is named: the embedding side (the first layer's input against the model's
``hidden_states[0]``), a layer (its output against ``hidden_states[i + 1]``), or the last layer,
final norm and head (the logits). Only the probe's real positions are compared (left padding
is masked out of every result that counts).

It runs in fp32 (autocast off) and in eval mode, and leaves the model's mode, grad mode and
autocast as it found them. It needs the whole model in this process: under ``'dist'`` with a
rank holding only its own stages, it is skipped (logged), as the first rank cannot run the others.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from runtime.generate.cut import StageSpan
from runtime.generate.errors import SelfCheckError
from runtime.generate.parts import DecoderParts
from runtime.generate.stage import Hop, StageRunner

__all__ = ["self_check", "PROBE"]

log = logging.getLogger(__name__)

PROBE = 6  # positions of the probe's longer sequence
RTOL = 1e-4


def _probe(vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Two sequences of ordinary ids (above the usual special ones), the second two shorter and
    # left-padded, with their per-sequence positions.
    ids = (torch.arange(PROBE * 2, device=device).view(2, PROBE) * 7 + 3) % max(vocab, 1)
    mask = torch.ones(2, PROBE, dtype=torch.long, device=device)
    mask[1, :2] = 0
    ids = ids.masked_fill(mask == 0, 0)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    return ids, mask, positions


@contextlib.contextmanager
def _eval(model: torch.nn.Module) -> Iterator[None]:
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes.items():
            m.train(mode)


def _worst(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[float, float]:
    # The largest difference and the largest reference value, over ``rows`` (a mask) or everything.
    diff, ref = (a.float() - b.float()).abs(), b.float().abs()
    if rows is not None:
        diff, ref = diff[rows], ref[rows]
    return (diff.max().item(), ref.max().item()) if diff.numel() else (0.0, 0.0)


def self_check(parts: DecoderParts, spans: Sequence[StageSpan], device: torch.device) -> None:
    """Check the generator's stages (``spans``, every stage of the model) on a probe.

    Raises:
        SelfCheckError: a part's output differs from the model's own forward: the message names
            the family, the part, its stage, the difference and what the glue replayed there.
        GenerateFamilyError: a family module raised on the generator's path.

    Example:
        >>> import torch, transformers
        >>> from partitioner import partition
        >>> from runtime.generate import Generator
        >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
        ...                                num_attention_heads=2, intermediate_size=32)
        >>> model = transformers.LlamaForCausalLM(cfg)
        >>> gen = Generator(partition(model, (torch.zeros(1, 8, dtype=torch.long),), 2))  # checks itself
        >>> self_check(gen.parts, gen.spans, gen.device)  # the same check again: no error
    """
    model: Any = parts.model
    ids, mask, positions = _probe(int(parts.config.vocab_size), device)
    real = mask.bool()  # (B, T) the probe's real positions
    layers = [parts.module(name) for name in parts.layers]
    seen: dict[str, torch.Tensor] = {}
    hooks = [layers[0].register_forward_pre_hook(lambda _m, args: seen.__setitem__("embed", args[0]))]
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_hook(
            lambda _m, _a, out, i=i: seen.__setitem__(f"layer {i}", out[0] if isinstance(out, tuple) else out)))
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast(device.type, enabled=False))
        stack.enter_context(_eval(model))
        try:
            hop = Hop(ids, positions, mask)
            for span in spans:
                runner = StageRunner(parts, span)
                runner.reset()
                hop = runner(hop)
        finally:
            for hook in hooks:
                hook.remove()
        got = hop.data  # (B, V) the last position's logits
        own = dict(seen)
        seen.clear()
        try:
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                        output_hidden_states=True)
            states = getattr(out, "hidden_states", None)
        except TypeError:  # a family whose forward takes no position_ids or hidden-state output
            out = model(input_ids=ids, attention_mask=mask, use_cache=False)
            states = None
        want = out.logits[:, -1, :]
    family = parts.family
    stage_of = {name: span.index for span in spans for name in
                ([parts.embed] if span.embed else []) + [parts.layers[i] for i in span.layers]}
    scale = max(want.abs().max().item(), 1.0)
    if states is not None and len(states) == len(layers) + 1:
        checks = [("embed", states[0], "the embedding side", parts.embed)]
        checks += [(f"layer {i}", states[i + 1], parts.layers[i], parts.layers[i]) for i in range(len(layers) - 1)]
        for key, ref, part, owner in checks:
            mine = own.get(key)
            if mine is None or mine.shape != ref.shape:
                continue
            worst, size = _worst(mine, ref, real)
            if worst > RTOL * max(size, 1.0):
                _fail(parts, family, part, stage_of.get(owner, 0), worst, size)
    worst, size = _worst(got, want)
    if worst > RTOL * scale:
        last = next(span.index for span in spans if span.head)
        _fail(parts, family, f"{parts.layers[-1]}, {parts.norm} or {parts.head} (the logits)", last, worst, size)
    log.debug("%s: the generator's probe logits are the model's (largest difference %.2e)", family, worst)


def _fail(parts: DecoderParts, family: str, part: str, stage: int, worst: float, size: float) -> None:
    glue = parts.glue.ops() if parts.glue is not None else {}
    raise SelfCheckError(
        f"{family}: the generator's cached path differs from the model's own forward at {part} (stage {stage}): "
        f"by up to {worst:.3g} on values up to {size:.3g}, on a {PROBE}-token probe. The generator replays the "
        f"model's top-level ops it found in the traced graph ({glue}); this family computes something else. "
        "Generation is refused rather than giving different tokens: generate with model.generate, or report "
        "the family",
        family=family, part=part, stage=stage, error=worst,
    )
