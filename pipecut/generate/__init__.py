"""Generation from a Hugging Face folder: its model as a generator, a file of prompts, a job's ranks.

``folder_generator`` opens a folder and builds a :class:`~runtime.generate.Generator` over its
model, each rank loading only its own stages (:func:`load_generator`, re-exported as
``pipecut.load_generator``); ``prompts`` reads a file of prompts; ``job`` is a ``pipecut
generate`` job's processes under torchrun (their ``dp x pp`` layout, their checks together,
one-line errors). The command itself, its flags and its output, is ``pipecut.cli.generate``.
"""

from __future__ import annotations

from pipecut.generate.folder_generator import (
    FolderGenerator,
    GenerationFolder,
    NoTokenizerError,
    build_generator,
    load_generator,
    open_generation_folder,
)
from pipecut.generate.job import GenerateJobError, Job, agree, job_layout, one_line_errors, together
from pipecut.generate.prompts import Prompt, PromptsError, read_prompts

__all__ = [
    "load_generator", "FolderGenerator", "GenerationFolder", "open_generation_folder", "build_generator",
    "NoTokenizerError", "Prompt", "PromptsError", "read_prompts", "GenerateJobError", "Job", "job_layout", "agree",
    "together", "one_line_errors",
]
