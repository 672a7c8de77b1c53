"""Choosing the next token from the last stage's logits: greedy, or sampled with a seed per sequence.

Legend: ``B`` sequences, ``V`` vocabulary.

Sampling filters the logits as transformers' warpers do, in their order: temperature, then top-k,
then top-p (nucleus, keeping at least one token). Each sequence draws from its own
``torch.Generator``, seeded from the run's seed and the sequence's index among the prompts, so its
tokens do not depend on which other sequences share its batch, on the number of stages or on how
the stages are run: only on the seed, the prompt and the model.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.generate.errors import GenerateOptionError

__all__ = ["Sampling", "sequence_generators", "kept_generators", "filter_logits", "next_tokens"]


@dataclass(frozen=True)
class Sampling:
    """How to sample instead of taking the most likely token.

    Attributes:
        temperature: logits are divided by it (> 0; 1 leaves them).
        top_k: keep the ``top_k`` most likely tokens (``None``: all).
        top_p: keep the smallest set of most likely tokens whose probability reaches ``top_p``
            (in (0, 1]; ``None``: all).
        seed: the run's seed; sequence ``b`` draws from a generator seeded from
            ``(seed, first_index + b)``.
        first_index: the index of the batch's first sequence among all the prompts of a run that
            is cut into batches (default 0), so a prompt draws the same numbers whatever batch it
            falls in (``pipecut generate --batch-size``).

    Example:
        >>> Sampling(temperature=0.7, top_k=50, top_p=0.9, seed=1).top_k
        50
        >>> Sampling(temperature=0)
        Traceback (most recent call last):
        ...
        runtime.generate.errors.GenerateOptionError: temperature must be a positive finite number, got 0; \
for greedy decoding pass sampling=None
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    first_index: int = 0

    def __post_init__(self) -> None:
        if type(self.first_index) is not int or self.first_index < 0:
            raise GenerateOptionError(
                f"first_index must be a non-negative int (the batch's first prompt among all), got {self.first_index!r}"
            )
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise GenerateOptionError(
                f"temperature must be a positive finite number, got {self.temperature!r}; for greedy decoding "
                "pass sampling=None"
            )
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise GenerateOptionError(f"top_k must be a positive int or None, got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise GenerateOptionError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")


def sequence_generators(sampling: Sampling, indices: Sequence[int], device: torch.device) -> list[torch.Generator]:
    """One generator per sequence, seeded from ``sampling.seed`` and the sequence's index among all prompts
    (``sampling.first_index`` plus its index in the batch)."""
    gens = []
    for b in indices:
        g = torch.Generator(device=device)
        g.manual_seed(zlib.crc32(f"{sampling.seed}:{sampling.first_index + b}".encode()))
        gens.append(g)
    return gens


def filter_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """``logits`` (B, V) divided by the temperature, with tokens outside top-k and top-p at ``-inf``.

    Example:
        >>> x = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
        >>> filter_logits(x, Sampling(top_k=2))
        tensor([[-inf, 3., 2., -inf]])
        >>> filter_logits(x, Sampling(top_p=0.5))  # the top token alone holds 0.64
        tensor([[-inf, 3., -inf, -inf]])
    """
    x = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < x.shape[-1]:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1:
        ordered, order = torch.sort(x, dim=-1, descending=True)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        # A token is dropped when the tokens before it already reach top_p; the first always stays.
        drop = (cumulative - ordered.softmax(dim=-1)) >= sampling.top_p
        drop[..., 0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return x


def next_tokens(
    logits: torch.Tensor, sampling: Sampling | None, generators: Sequence[torch.Generator] = (),
) -> torch.Tensor:
    """The next token of each sequence (B,) from its logits (B, V): the most likely one (greedy,
    ``sampling=None``), or one drawn from the filtered distribution with that sequence's generator.
    """
    scores = logits.float()
    if sampling is None:
        return scores.argmax(dim=-1)
    probs = filter_logits(scores, sampling).softmax(dim=-1)
    return torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(generators)])


def kept_generators(generators: Sequence[torch.Generator], keep: torch.Tensor | None) -> list[torch.Generator]:
    """The generators of the sequences still running after a step that left out some (``Hop.keep``:
    their indices among the step before's); all of them when ``keep`` is ``None``, none in greedy
    decoding (``generators`` empty)."""
    if keep is None or not generators:
        return list(generators)
    return [generators[int(i)] for i in keep.tolist()]
