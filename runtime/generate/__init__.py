"""Inference over a plan's stages: each keeps its own layers' key/value cache, and the generator decodes with them.

The room's modules, from the model up: ``parts`` (the model's own modules and helpers a stage
calls), ``glue`` (the model's own arithmetic between those parts, read off the traced graph),
``cut`` (what each stage of the plan holds), ``stage`` (one stage and its cache), ``build`` (each
stage's tensors made real and loaded, as training does), ``sampling`` (choosing the next token),
``pipelined`` (groups of sequences in flight on each rank), ``ring`` (the messages between
ranks), ``ranks`` (ranks as threads or processes), ``selfcheck`` (a probe through the stages
against the model's own forward, at build) and ``generator`` (the decoding loop). See
docs/generate.md.
"""

from __future__ import annotations

from runtime.generate.cut import StageSpan, stage_spans
from runtime.generate.errors import (
    CutInsideBlockError,
    GenerateError,
    GenerateFamilyError,
    GenerateModelError,
    GenerateOptionError,
    SelfCheckError,
)
from runtime.generate.generator import Generation, Generator, left_pad
from runtime.generate.glue import Glue, derive_glue
from runtime.generate.parts import DecoderParts, decoder_parts
from runtime.generate.pipelined import Step, chunk_groups, split_groups
from runtime.generate.ranks import rank_spans
from runtime.generate.sampling import Sampling
from runtime.generate.selfcheck import self_check
from runtime.generate.stage import Hop, StageRunner

__all__ = [
    "Generator", "Generation", "Sampling", "left_pad", "StageSpan", "stage_spans", "DecoderParts", "decoder_parts",
    "Hop", "StageRunner", "Step", "split_groups", "chunk_groups", "rank_spans",
    "Glue", "derive_glue", "self_check",
    "GenerateError", "GenerateModelError", "GenerateFamilyError", "SelfCheckError", "CutInsideBlockError",
    "GenerateOptionError",
]
