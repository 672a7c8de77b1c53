"""A Hugging Face model folder: its config, the model built from it (on meta or real), its files.

Legend: ``b`` micro-batch rows, ``L`` sequence length.

A folder as ``save_pretrained`` writes it: ``config.json``, weights as ``model.safetensors`` or
shards with ``model.safetensors.index.json`` (absent when training from the model's own
initialisation), and the tokenizer's files. Nothing is read from the hub: the folder is local.

``transformers`` is an optional dependency (the ``dev`` extra): it is imported only when a
folder is opened, with :class:`~partitioner.errors.MissingDependencyError` saying how to install
it when it is missing.

Example:
    >>> import tempfile
    >>> from transformers import LlamaConfig  # doctest: +SKIP
    >>> d = tempfile.mkdtemp()  # doctest: +SKIP
    >>> LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...             intermediate_size=64, vocab_size=128).save_pretrained(d)  # doctest: +SKIP
    >>> folder = HFFolder(d)  # doctest: +SKIP
    >>> model = folder.build(meta=True)  # doctest: +SKIP
    >>> folder.example_inputs(seq_len=16, micro_batch_size=2)[0].shape  # doctest: +SKIP
    torch.Size([2, 16])
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from partitioner.errors import MissingDependencyError, PipecutError
from runtime.state.materialize import empty_weights

__all__ = [
    "HFFolder", "FolderError", "UnsupportedModelError", "is_hf_folder",
    "TOKENIZER_FILES",
]

log = logging.getLogger(__name__)

# The files of a tokenizer as save_pretrained writes them (copied to an export as they are).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
    "chat_template.json",
)
# Beside config.json, what an export carries over unchanged.
_CONFIG_FILES = ("config.json", "generation_config.json")


class FolderError(PipecutError, FileNotFoundError):
    """A path is not a Hugging Face model folder (no ``config.json``) or lacks a file it needs."""


class UnsupportedModelError(PipecutError, ValueError):
    """The folder's model is of a kind this command does not train or plan (it is not a causal LM)."""


def is_hf_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory (the CLI's sign of a Hugging Face folder, not ``file.py:factory``)."""
    return Path(path).is_dir()


@dataclass(frozen=True)
class HFFolder:
    """A local Hugging Face model folder.

    Args:
        path: the folder, holding at least ``config.json``.

    Raises:
        FolderError: ``path`` is not a directory or has no ``config.json``.
    """

    path: Path

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        if not p.is_dir():
            raise FolderError(f"{p} is not a directory: pass a Hugging Face model folder (with config.json)")
        if not (p / "config.json").is_file():
            raise FolderError(
                f"{p} has no config.json: pass a folder written by save_pretrained (config.json, and "
                "model.safetensors when fine-tuning)"
            )
        object.__setattr__(self, "path", p)

    @property
    def config(self) -> Any:
        """The folder's ``transformers`` config (``AutoConfig.from_pretrained``; local files only)."""
        return _transformers().AutoConfig.from_pretrained(str(self.path), local_files_only=True)

    def check_causal_lm(self, config: Any | None = None, *, command: str = "pipecut") -> None:
        """Raise :class:`UnsupportedModelError` unless the folder holds a causal language model."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        cfg = self.config if config is None else config
        kind = getattr(cfg, "model_type", None)
        if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            archs = getattr(cfg, "architectures", None) or []
            raise UnsupportedModelError(
                f"{self.path}: {command} supports causal language models (those AutoModelForCausalLM "
                f"builds: Llama, Mistral, Qwen2, GPT-2, Gemma, Phi, Mixtral...), got model_type {kind!r}"
                f"{' (' + ', '.join(archs) + ')' if archs else ''}; for other models call "
                "partitioner.partition() on the model from Python"
            )

    def build(self, *, meta: bool = True, config: Any | None = None) -> nn.Module:
        """The causal LM the config describes, fp32: on ``meta`` (no memory) or initialised for real.

        Raises:
            UnsupportedModelError: the folder's model is not a causal LM.
        """
        cfg = self.config if config is None else config
        self.check_causal_lm(cfg)
        auto = _transformers().AutoModelForCausalLM
        if meta:
            with empty_weights():
                model = auto.from_config(cfg)
        else:
            model = auto.from_config(cfg)
        # Trained in fp32 (master weights; --precision sets autocast), whatever dtype the config
        # names; on meta this costs nothing.
        built: nn.Module = model.float()
        return built

    @property
    def weights(self) -> Path | None:
        """The safetensors checkpoint (the index of a sharded one, or the single file), or ``None``."""
        for name in ("model.safetensors.index.json", "model.safetensors"):
            if (self.path / name).is_file():
                return self.path / name
        return None

    @property
    def tokenizer_files(self) -> list[Path]:
        """The tokenizer's files present in the folder."""
        return [self.path / n for n in TOKENIZER_FILES if (self.path / n).is_file()]

    def tokenizer(self) -> Any:
        """The folder's tokenizer (``AutoTokenizer``, local files only).

        Raises:
            FolderError: the folder holds no tokenizer files.
        """
        if not self.tokenizer_files:
            raise FolderError(
                f"{self.path} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}...) to tokenise "
                "text with: save the tokenizer there (tokenizer.save_pretrained), or pass token ids as "
                ".npy / .bin"
            )
        return _transformers().AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)

    def example_inputs(self, *, seq_len: int, micro_batch_size: int) -> tuple[torch.Tensor]:
        """One micro-batch of token ids, ``(b, L)`` zeros, for tracing and costing."""
        return (torch.zeros(micro_batch_size, seq_len, dtype=torch.long),)

    def copy_files_to(self, directory: str | os.PathLike[str]) -> list[str]:
        """Copy ``config.json``, ``generation_config.json`` and the tokenizer's files; returns their names."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        copied = []
        for src in [self.path / n for n in _CONFIG_FILES if (self.path / n).is_file()] + self.tokenizer_files:
            shutil.copyfile(src, out / src.name)
            copied.append(src.name)
        return copied


def max_positions(config: Any) -> int | None:
    """The longest sequence the config allows (``max_position_embeddings`` or ``n_positions``)."""
    for key in ("max_position_embeddings", "n_positions", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:  # an optional dependency: only folders need it
        raise MissingDependencyError(
            "reading a Hugging Face folder needs transformers: pip install 'pipecut[dev]' (or pip install "
            "transformers)"
        ) from e
    return transformers
