"""What generation refuses: a model it cannot run stage by stage, a plan cut inside a block, a bad option."""

from __future__ import annotations

from partitioner.errors import PipecutError

__all__ = ["GenerateError", "GenerateModelError", "GenerateFamilyError", "SelfCheckError", "CutInsideBlockError",
           "GenerateOptionError"]


class GenerateError(PipecutError, ValueError):
    """The root of generation's errors: a model, plan or option the generator cannot run."""


class GenerateModelError(GenerateError):
    """The model is not a Hugging Face decoder-only causal LM whose parts the generator can find."""


class GenerateFamilyError(GenerateModelError):
    """A family's own module raised inside the generator.

    Attributes:
        family: the model class and ``model_type``.
        part: the part that raised (a layer's name, the embedding side, the head...).
        stage: the stage index.
        rank: the pipeline rank, or ``None`` in one process.
    """

    def __init__(self, message: str, *, family: str = "", part: str = "", stage: int = -1,
                 rank: int | None = None) -> None:
        super().__init__(message)
        self.family, self.part, self.stage, self.rank = family, part, stage, rank


class SelfCheckError(GenerateModelError):
    """The generator's cached path does not compute the model's own logits on its probe.

    Attributes:
        family: the model class and ``model_type``.
        part: the first part whose output differs from the model's own forward.
        stage: the stage that runs it.
        error: the largest absolute difference there.
    """

    def __init__(self, message: str, *, family: str = "", part: str = "", stage: int = -1,
                 error: float = 0.0) -> None:
        super().__init__(message)
        self.family, self.part, self.stage, self.error = family, part, stage, error


class CutInsideBlockError(GenerateError):
    """The plan cuts inside a transformer block (or puts the model's parts out of order): a stage
    would hold part of a layer, so it could not keep that layer's keys and values."""


class GenerateOptionError(GenerateError):
    """A generation option out of range (``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``,
    the prompts' shapes)."""
