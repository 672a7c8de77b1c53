"""One stage of a generating pipeline: its span of the model, its own key/value cache, one call per step.

Legend: ``B`` sequences, ``T`` new positions this call (the prompt's length at prefill, 1 at each
decode step), ``K`` positions seen so far including the new ones, ``H`` hidden size, ``V`` vocabulary.

What crosses from stage to stage each call is a :class:`Hop`: the new positions' hidden states
(token ids into the first stage, logits of the last position out of the last) with the small
side inputs every stage needs to run its layers: the new positions' ids and the 2-D attention
mask. Nothing the stage computed before is computed again: its layers' keys and values for the
earlier positions are in its cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from runtime.generate.cut import StageSpan
from runtime.generate.errors import GenerateFamilyError, GenerateModelError
from runtime.generate.parts import DecoderParts, drop_rows, layer_masks, new_cache, rotary_embeddings, run_layer

__all__ = ["Hop", "StageRunner"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hop:
    """What one stage hands the next for one step.

    Attributes:
        data: token ids (B, T) into the first stage; hidden states (B, T, H) between stages; the
            last position's logits (B, V) out of the stage running the head.
        position_ids: the new positions' ids (B, T), per sequence (left padding shifts them).
        attention_mask: which of the K positions seen so far are real tokens (B, K), new ones
            included; 0 marks left padding.
        keep: ``None`` when the hop's sequences are those of the step before; else which of the
            step before's sequences still run (their indices among them, ascending): the others
            have stopped and left, and each stage drops their rows from its cache first.
        carried: what the stage's last layer handed on beside its hidden states, for the next
            stage's first layer (``DecoderParts.carries``: Zaya's router states); empty for most
            families, and before the first layer.
    """

    data: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    keep: torch.Tensor | None = None
    carried: tuple[torch.Tensor | None, ...] = ()


class StageRunner:
    """Runs one :class:`~runtime.generate.cut.StageSpan` of a model, keeping its layers' keys and values.

    The stage calls the model's own modules (``runtime.generate.parts``) and keeps a transformers
    ``DynamicCache`` in which only its own layers' entries are ever written: the entries of other
    stages' layers stay empty (:meth:`cached_layers` lists the filled ones).

    Args:
        parts: the model's parts, with their glue (:func:`runtime.generate.glue.derive_glue`).
        span: what this stage runs.
        rank: the pipeline rank running the stage (named in errors).

    Raises:
        GenerateModelError: ``parts`` has no glue.
    """

    def __init__(self, parts: DecoderParts, span: StageSpan, rank: int | None = None) -> None:
        if parts.glue is None:
            raise GenerateModelError("the stage's parts have no glue: make them with "
                                     "dataclasses.replace(parts, glue=derive_glue(plan, parts))")
        self.parts = parts
        self.glue = parts.glue
        self.rank = rank
        self.span = span
        self.cache: Any = None
        self.calls: list[tuple[int, ...]] = []  # the shape of ``data`` each call received, in order

    def reset(self) -> None:
        """Forget the cached keys and values (a new batch of prompts starts)."""
        self.cache = new_cache(self.parts) if len(self.span.layers) else None
        self.calls.clear()

    @torch.no_grad()
    def __call__(self, hop: Hop) -> Hop:
        """Run the stage's parts on ``hop`` and return what the next stage needs.

        Raises:
            GenerateFamilyError: the model's modules raised (a device mismatch, an argument the
                family's layers take that the generator does not give...): the error names the
                family, the part, the stage and the rank, and chains the original.
        """
        self.calls.append(tuple(hop.data.shape))
        if hop.keep is not None and self.cache is not None:
            drop_rows(self.cache, hop.keep)  # stopped sequences leave: their keys, values and states go
        x = hop.data
        gm, parts = self.glue.gm, self.parts
        if self.span.embed:
            x = self._part("the embedding side", self.glue.embed, parts, gm,
                           {"tokens": x, "positions": hop.position_ids})
        if len(self.span.layers):
            if self.cache is None:
                self.reset()
            kinds = [parts.kinds[i] for i in self.span.layers]
            position_embeddings = self._part(parts.rotary or "the rotary", rotary_embeddings, parts, x,
                                             hop.position_ids, kinds)
            masks = self._part("the attention masks", layer_masks, parts, self.span.layers, x, hop.attention_mask,
                               hop.position_ids, self.cache)
            carried = hop.carried
            for i in self.span.layers:
                x, carried = self._part(parts.layers[i], run_layer, parts, i, x, masks, hop.position_ids,
                                        position_embeddings, self.cache, carried)
            hop = replace(hop, carried=carried)
        if self.span.norm:
            # The head reads the last position only (generate's logits_to_keep=1): only it travels on.
            x = self._part(parts.norm or "the last layer's output", self.glue.norm, parts, gm,
                           {"hidden": x})[:, -1:, :]
            hop = replace(hop, carried=())  # the layers are done: nothing is handed on to a head
        if self.span.head:
            x = self._part(parts.head, self.glue.head, parts, gm, {"hidden": x})[:, -1, :]
        return replace(hop, data=x)  # the next stage drops the same rows (keep travels on)

    def _part(self, part: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except GenerateModelError:
            raise
        except Exception as err:
            family = self.parts.family
            rank = "" if self.rank is None else f" on pipeline rank {self.rank}"
            raise GenerateFamilyError(
                f"{family}: {part} (stage {self.span.index}{rank}) raised {type(err).__name__}: {err}. The "
                "generator calls the family's own modules; this family's need something it does not give them",
                family=family, part=part, stage=self.span.index, rank=self.rank,
            ) from err

    def cached_layers(self) -> list[int]:
        """The layers whose keys and values (or states) this stage's cache holds (empty before the first call)."""
        if self.cache is None:
            return []
        return [i for i, layer in enumerate(self.cache.layers) if any(t.numel() for t in _held(layer))]

    def cached_bytes(self) -> int:
        """Bytes of keys, values and states this stage's cache holds."""
        if self.cache is None:
            return 0
        return sum(t.numel() * t.element_size() for layer in self.cache.layers for t in _held(layer))


def _held(layer: Any) -> list[torch.Tensor]:
    # A cache layer's tensors: keys and values, and the convolution and recurrent states of a layer
    # that keeps a state (transformers keeps those in dicts by state index).
    held = [getattr(layer, name, None) for name in ("keys", "values")]
    for name in ("conv_states", "recurrent_states"):
        held += list((getattr(layer, name, None) or {}).values())
    return [t for t in held if isinstance(t, torch.Tensor)]
