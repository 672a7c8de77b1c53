"""What generation refuses: a model it cannot run stage by stage, a plan cut inside a block, a bad option."""

from __future__ import annotations

from partitioner.errors import PipecutError

__all__ = ["GenerateError", "GenerateModelError", "CutInsideBlockError", "GenerateOptionError"]


class GenerateError(PipecutError, ValueError):
    """The root of generation's errors: a model, plan or option the generator cannot run."""


class GenerateModelError(GenerateError):
    """The model is not a Hugging Face decoder-only causal LM whose parts the generator can find."""


class CutInsideBlockError(GenerateError):
    """The plan cuts inside a transformer block (or puts the model's parts out of order): a stage
    would hold part of a layer, so it could not keep that layer's keys and values."""


class GenerateOptionError(GenerateError):
    """A generation option out of range (``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``,
    the prompts' shapes)."""
