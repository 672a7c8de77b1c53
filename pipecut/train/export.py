"""The run's final model as a Hugging Face folder: safetensors, config.json, tokenizer files.

Each rank writes its stages' tensors (``PipelineTrainer.export_safetensors``, a collective that
commits the folder with renames only when all are done); rank 0 then adds the model's
``config.json`` (its dtype set to the fp32 the weights are trained in), ``generation_config.json``
and the tokenizer's files from the source folder, so ``AutoModelForCausalLM.from_pretrained(dir)``
and ``AutoTokenizer.from_pretrained(dir)`` load it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from pipecut.folder import HFFolder
from runtime.trainer import PipelineTrainer

__all__ = ["export_final"]

log = logging.getLogger(__name__)


def export_final(
    trainer: PipelineTrainer, folder: HFFolder, config: Any, directory: str | os.PathLike[str], *,
    leader: bool,
) -> Path:
    """Write ``directory`` as a Hugging Face folder of the trainer's weights. Collective.

    Args:
        trainer: the trained pipeline.
        folder: the source folder (its tokenizer and generation config are copied).
        config: the model's ``transformers`` config.
        directory: where to write.
        leader: whether this process writes the shared files (global rank 0).
    """
    target = trainer.export_safetensors(directory)
    if leader:
        folder.copy_files_to(target)
        # transformers 4.56 renamed torch_dtype to dtype (the old name warns).
        setattr(config, "dtype" if "dtype" in vars(config) else "torch_dtype", torch.float32)
        config.save_pretrained(str(target))  # after the copy: the dtype of these weights
        log.info("exported to %s", target)
    return target
