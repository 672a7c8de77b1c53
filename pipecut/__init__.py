"""pipecut: cut a PyTorch model into pipeline stages, show the plan, and train it as a pipeline.

The distribution's own name for the public API of its two packages: ``partitioner`` (trace, cost,
cut, schedule and plan) and ``runtime`` (the executor, transports, data parallelism, weights and
checkpoints). Both stay importable on their own; this package re-exports them, and adds what
needs a Hugging Face folder: :func:`load_generator` (a generator of a folder's model, each rank
loading only its own stages; docs/reference/load-generator.md).

Example:
    >>> import torch
    >>> from torch import nn
    >>> import pipecut
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    >>> plan = pipecut.partition(model, (torch.randn(2, 8),), num_stages=2)
    >>> plan.num_stages
    2
    >>> pipecut.PipelineTrainer is pipecut.runtime.PipelineTrainer
    True
"""

from __future__ import annotations

import partitioner as partitioner
import runtime as runtime
from partitioner import *  # noqa: F403  (the public API, listed in partitioner.__all__)
from pipecut.generate import FolderGenerator, load_generator
from runtime import *  # noqa: F403  (the public API, listed in runtime.__all__)

__version__ = "0.1.0"  # the distribution's version (pyproject.toml's, checked by tests/pipecut/test_cli.py)

__all__ = list(partitioner.__all__)
__all__ += [name for name in runtime.__all__ if name not in __all__]
__all__ += ["load_generator", "FolderGenerator"]  # pipecut's own: a Hugging Face folder's generator
