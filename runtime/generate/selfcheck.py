"""The generator's self-check: a short probe through the cached path must give the model's own logits.

Legend: ``B`` probe sequences, ``T`` probe positions, ``L`` layers.

The stages run the model's modules with the glue read off its traced graph
(:mod:`runtime.generate.glue`), so a family's arithmetic is the model's by construction. The
check makes sure of it, for families nobody has listed: probes through fresh stage runners (the
generator's own path, its masks, rotaries and cache included) against the model's own
``forward`` on the same tokens, mask and positions. Each probe is a prefill of ``PROBE``
positions, then ``STEPS`` decode steps of one position each, so the cache is read as well as
written (a layer keeping a state, a sliding window). Two probes: two sequences, the second
left-padded (the masks' padding path), and one sequence without padding (the path where the
helpers may skip a mask).

Where the prefill differs, the first part that differs is named: the embedding side (the first
layer's input), a layer (its output), or the last layer, final norm and head (the logits). The
model's own values are caught with hooks on the same layers during its forward, so no family's
``hidden_states`` convention is assumed. Only the probe's real positions are compared (left padding
is masked out of every result that counts). A decode step is compared on its logits.

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

PROBE = 6  # positions of a probe's prefill (its longer sequence)
STEPS = 2  # decode steps after it
RTOL = 1e-4


def _probes(vocab: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    # Ordinary ids (above the usual special ones): two sequences, the second two shorter and
    # left-padded; then one without padding. Each with its mask and per-sequence positions.
    n = PROBE + STEPS
    ids = (torch.arange(n * 2, device=device).view(2, n) * 7 + 3) % max(vocab, 1)
    mask = torch.ones(2, n, dtype=torch.long, device=device)
    mask[1, :2] = 0
    probes = []
    for rows, m in ((ids.masked_fill(mask == 0, 0), mask), (ids[:1], mask[:1])):
        probes.append((rows, m, (m.cumsum(-1) - 1).masked_fill(m == 0, 0)))
    return probes


@contextlib.contextmanager
def _eval(model: torch.nn.Module) -> Iterator[None]:
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes.items():
            m.train(mode)


@contextlib.contextmanager
def _caught(layers: Sequence[torch.nn.Module], seen: dict[str, torch.Tensor]) -> Iterator[None]:
    # The first layer's input and every layer's output, as the last call gave them.
    def first_input(_m: Any, args: Any, kwargs: Any) -> None:
        value = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(value, torch.Tensor):
            seen["embed"] = value

    hooks = [layers[0].register_forward_pre_hook(first_input, with_kwargs=True)]
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_hook(
            lambda _m, _a, out, i=i: seen.__setitem__(f"layer {i}", out[0] if isinstance(out, tuple) else out)))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _worst(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[float, float]:
    # The largest difference and the largest reference value, over ``rows`` (a mask) or everything.
    diff, ref = (a.float() - b.float()).abs(), b.float().abs()
    if rows is not None:
        diff, ref = diff[rows], ref[rows]
    return (diff.max().item(), ref.max().item()) if diff.numel() else (0.0, 0.0)


def _own_logits(model: Any, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    # The model's own forward, without a cache: the last position's logits (B, V).
    try:
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    except TypeError:  # a family whose forward takes no position_ids
        out = model(input_ids=ids, attention_mask=mask, use_cache=False)
    return out.logits[:, -1, :]  # type: ignore[no-any-return]


def self_check(parts: DecoderParts, spans: Sequence[StageSpan], device: torch.device) -> None:
    """Check the generator's stages (``spans``, every stage of the model) on the probes.

    Raises:
        SelfCheckError: a part's output or a step's logits differ from the model's own forward:
            the message names the family, the part, its stage, the difference and what the glue
            replayed there.
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
    layers = [parts.module(name) for name in parts.layers]
    stage_of = {name: span.index for span in spans for name in
                ([parts.embed] if span.embed else []) + [parts.layers[i] for i in span.layers]}
    last = next(span.index for span in spans if span.head)
    logits_part = f"{', '.join(n for n in (parts.layers[-1], parts.norm) if n)} or {parts.head} (the logits)"
    worst = 0.0
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast(device.type, enabled=False))
        stack.enter_context(_eval(model))
        for ids, mask, positions in _probes(int(parts.config.vocab_size), device):
            runners = [StageRunner(parts, span) for span in spans]
            for runner in runners:
                runner.reset()
            for t in range(PROBE, PROBE + STEPS + 1):
                prefill = t == PROBE  # its parts are compared; a decode step's logits only
                lo = 0 if prefill else t - 1  # the prefill's positions, then one at a time
                mine: dict[str, torch.Tensor] = {}
                theirs: dict[str, torch.Tensor] = {}
                with _caught(layers, mine) if prefill else contextlib.nullcontext():
                    hop = Hop(ids[:, lo:t], positions[:, lo:t], mask[:, :t])
                    for runner in runners:
                        hop = runner(hop)
                with _caught(layers, theirs) if prefill else contextlib.nullcontext():
                    want = _own_logits(model, ids[:, :t], mask[:, :t], positions[:, :t])
                if prefill:
                    _compare_parts(parts, mine, theirs, mask[:, :t].bool(), stage_of)
                step = "" if prefill else f", decode step {t - PROBE} of {STEPS}"
                diff, size = _worst(hop.data, want)
                if diff > RTOL * max(want.abs().max().item(), 1.0):
                    _fail(parts, logits_part + step, last, diff, size)
                worst = max(worst, diff)
    log.debug("%s: the generator's probe logits are the model's (largest difference %.2e)", parts.family, worst)


def _compare_parts(parts: DecoderParts, mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor],
                   real: torch.Tensor, stage_of: dict[str, int]) -> None:
    # The prefill's parts in order: the first layer's input, then each layer's output but the last
    # (the last is checked with the norm and head, on the logits).
    checks = [("embed", "the embedding side", parts.embed)]
    checks += [(f"layer {i}", parts.layers[i], parts.layers[i]) for i in range(len(parts.layers) - 1)]
    for key, part, owner in checks:
        a, b = mine.get(key), theirs.get(key)
        if a is None or b is None or a.shape != b.shape or a.shape[:2] != real.shape:
            continue
        diff, size = _worst(a, b, real)
        if diff > RTOL * max(size, 1.0):
            _fail(parts, part, stage_of.get(owner, 0), diff, size)


def _fail(parts: DecoderParts, part: str, stage: int, worst: float, size: float) -> None:
    glue = parts.glue.ops() if parts.glue is not None else {}
    family = parts.family
    raise SelfCheckError(
        f"{family}: the generator's cached path differs from the model's own forward at {part} (stage {stage}): "
        f"by up to {worst:.3g} on values up to {size:.3g}, on a {PROBE}-position probe. The generator replays the "
        f"model's top-level ops it found in the traced graph ({glue}); this family computes something else. "
        "Generation is refused rather than giving different tokens: generate with model.generate, or report "
        "the family",
        family=family, part=part, stage=stage, error=worst,
    )
