"""A Hugging Face model folder: its config, the model built from it (on meta or real), its files.

Legend: ``b`` micro-batch rows, ``L`` sequence length.

A folder as ``save_pretrained`` writes it: ``config.json``, weights (absent when training from
the model's own initialisation), and the tokenizer's files. Nothing is read from the hub: the
folder is local. Every folder is honoured or refused at the door, never half-read:

* weights are the file ``from_pretrained`` would load, in its order (``model.safetensors``,
  ``model.safetensors.index.json``, ``pytorch_model.bin``, ``pytorch_model.bin.index.json``);
  weights only in another format (TensorFlow, Flax, GGUF...) are refused with how to convert them;
* the model must be a causal LM as saved: its ``architectures`` a causal-LM class, not an
  encoder-decoder, not an encoder (BERT, RoBERTa...) whose causal class needs ``is_decoder``;
* no code from the folder runs (``trust_remote_code=False`` on every ``transformers`` call): a
  folder whose model needs its own code (``auto_map``, ``modeling_*.py``) is refused unless the
  caller passes ``trust_remote_code=True`` (``--trust-remote-code``).

``transformers`` is an optional dependency (the ``hf`` extra): it is imported only when a
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

import json
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
from runtime.state.weight_sources import find_checkpoint

__all__ = [
    "HFFolder", "FolderError", "UnsupportedModelError", "RemoteCodeError", "is_hf_folder",
    "TOKENIZER_FILES", "INSTALL_HF",
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
# The files a model's own code lives in (transformers' dynamic modules), and the configs that point at it.
_CODE_FILES = ("modeling_*.py", "configuration_*.py", "tokenization_*.py")
_CODE_CONFIGS = ("config.json", "tokenizer_config.json")
# What brings transformers (pyproject.toml's `hf` extra).
INSTALL_HF = 'pip install "pipecut[hf]"'
_SUPPORTED = "Llama, Mistral, Qwen2, GPT-2, Gemma, Phi, Mixtral..."


class FolderError(PipecutError, FileNotFoundError):
    """A path is not a Hugging Face model folder (no ``config.json``) or lacks a file it needs."""


class UnsupportedModelError(PipecutError, ValueError):
    """The folder's model is of a kind this command does not train or plan (it is not a causal LM)."""


class RemoteCodeError(PipecutError, ValueError):
    """The folder's model needs code from the folder, and the caller did not allow it to run."""


def is_hf_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory (the CLI's sign of a Hugging Face folder, not ``file.py:factory``)."""
    return Path(path).is_dir()


@dataclass(frozen=True)
class HFFolder:
    """A local Hugging Face model folder.

    Args:
        path: the folder, holding at least ``config.json``.
        trust_remote_code: let ``transformers`` import the folder's own code (``auto_map``,
            ``modeling_*.py``) to build its config, model and tokenizer. Off by default: that
            code runs with your rights, so read it first.

    Raises:
        FolderError: ``path`` is not a directory, has no ``config.json``, or it is not JSON.
        RemoteCodeError: the folder's model needs its own code and ``trust_remote_code`` is off.
    """

    path: Path
    trust_remote_code: bool = False

    def __init__(self, path: str | os.PathLike[str], *, trust_remote_code: bool = False) -> None:
        p = Path(path)
        if not p.is_dir():
            raise FolderError(f"{p} is not a directory: pass a Hugging Face model folder (with config.json)")
        if not (p / "config.json").is_file():
            raise FolderError(
                f"{p} has no config.json: pass a folder written by save_pretrained (config.json, and "
                "model.safetensors when fine-tuning)"
            )
        object.__setattr__(self, "path", p)
        object.__setattr__(self, "trust_remote_code", trust_remote_code)
        code = self.custom_code()
        if code and not trust_remote_code:
            raise RemoteCodeError(
                f"{p}: the model needs code from the folder ({'; '.join(code)}), and pipecut runs no code "
                "from a model folder unless asked (it would run with your rights). Read those files; if you "
                "trust them, pass --trust-remote-code (trust_remote_code = true in a --config file, "
                "HFFolder(..., trust_remote_code=True) from Python)"
            )

    def custom_code(self) -> list[str]:
        """What in the folder asks ``transformers`` to run the folder's own code: ``auto_map``
        entries of ``config.json`` and ``tokenizer_config.json``, and ``modeling_*.py``,
        ``configuration_*.py``, ``tokenization_*.py`` files. Empty for a folder of data only."""
        found = []
        for name in _CODE_CONFIGS:
            auto_map = _json(self.path / name).get("auto_map") if (self.path / name).is_file() else None
            if auto_map:
                entries = auto_map.items() if isinstance(auto_map, dict) else [("", auto_map)]
                found.append(f"auto_map in {name}: " + ", ".join(f"{k} -> {v}" if k else str(v) for k, v in entries))
        files = sorted({f.name for pattern in _CODE_FILES for f in self.path.glob(pattern) if f.is_file()})
        if files:
            found.append("files " + ", ".join(files))
        return found

    @property
    def config(self) -> Any:
        """The folder's ``transformers`` config (``AutoConfig.from_pretrained``; local files only)."""
        return _transformers().AutoConfig.from_pretrained(
            str(self.path), local_files_only=True, trust_remote_code=self.trust_remote_code
        )

    def check_causal_lm(self, config: Any | None = None, *, command: str = "pipecut") -> None:
        """Raise :class:`UnsupportedModelError` unless the folder holds a causal language model as saved.

        The config's ``model_type`` must be one ``AutoModelForCausalLM`` builds, each of its
        ``architectures`` a causal-LM class (not ``BertForMaskedLM``, not a classification head),
        the model not an encoder-decoder (T5, BART), and an encoder family whose causal class is
        its encoder with a causal mask (BERT, RoBERTa...) saved as a decoder (``is_decoder``).
        With ``trust_remote_code``, a model of the folder's own code must name an
        ``AutoModelForCausalLM`` class in its ``auto_map``.
        """
        _transformers()
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal

        cfg = self.config if config is None else config
        kind = getattr(cfg, "model_type", None)
        archs = [str(a) for a in getattr(cfg, "architectures", None) or []]
        named = f"model_type {kind!r}{' (' + ', '.join(archs) + ')' if archs else ''}"

        def refuse(why: str, fix: str) -> UnsupportedModelError:
            return UnsupportedModelError(
                f"{self.path}: {command} supports causal language models (those AutoModelForCausalLM builds: "
                f"{_SUPPORTED}), got {named}{why}; {fix}"
            )

        from_python = "for other models call partitioner.partition() on the model from Python"
        if getattr(cfg, "is_encoder_decoder", False):
            raise refuse(
                ", an encoder-decoder (is_encoder_decoder is true): its decoder reads the encoder's output, "
                "so it is no next-token model on its own", from_python,
            )
        auto_map = getattr(cfg, "auto_map", None) or {}
        if self.trust_remote_code and auto_map:
            if "AutoModelForCausalLM" not in auto_map:
                raise refuse(
                    f", whose own code maps no AutoModelForCausalLM (auto_map has {', '.join(auto_map)})",
                    from_python,
                )
            return
        if kind not in causal:
            raise refuse("", from_python)
        kind = str(kind)
        heads = [a for a in archs if a not in set(causal.values()) and not a.endswith(("ForCausalLM", "LMHeadModel"))]
        if heads:
            raise refuse(
                f": {heads[0]} is not a causal-LM class (its head is not a next-token head: a masked-LM, "
                "classification or other task head, which a causal LM would replace with a new, untrained one)",
                f"fine-tune a {causal[kind]} checkpoint instead, or {from_python}",
            )
        flag = _decoder_flag(kind)
        if flag is not None and not getattr(cfg, flag, False):
            raise refuse(
                f": {kind} is an encoder family, and its causal-LM class {causal[kind]} is a causal LM only "
                f"with {flag}=True, which config.json does not set (as saved, the model attends both ways)",
                f"if the checkpoint was trained as a decoder, set \"{flag}\": true in config.json; else "
                f"{from_python}",
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
                model = auto.from_config(cfg, trust_remote_code=self.trust_remote_code)
        else:
            model = auto.from_config(cfg, trust_remote_code=self.trust_remote_code)
        # Trained in fp32 (master weights; --precision sets autocast), whatever dtype the config
        # names; on meta this costs nothing.
        built: nn.Module = model.float()
        return built

    @property
    def weights(self) -> Path | None:
        """The checkpoint ``from_pretrained`` would load, or ``None`` when the folder holds no weights.

        In transformers' order: the file ``config.json``'s ``transformers_weights`` names, else
        the first of ``model.safetensors``, ``model.safetensors.index.json``, ``pytorch_model.bin``,
        ``pytorch_model.bin.index.json``
        (:func:`~runtime.state.weight_sources.find_checkpoint`).

        Raises:
            WeightsSourceError: weights only in a format pipecut does not read (TensorFlow, Flax,
                GGUF, ONNX) or under names ``from_pretrained`` does not look for; the message says
                how to convert them.
        """
        explicit = _json(self.path / "config.json").get("transformers_weights")
        return find_checkpoint(self.path, explicit=explicit if isinstance(explicit, str) else None)

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
        return _transformers().AutoTokenizer.from_pretrained(
            str(self.path), local_files_only=True, trust_remote_code=self.trust_remote_code
        )

    def example_inputs(self, *, seq_len: int, micro_batch_size: int) -> tuple[torch.Tensor]:
        """One micro-batch of token ids, ``(b, L)`` zeros, for tracing and costing."""
        return (torch.zeros(micro_batch_size, seq_len, dtype=torch.long),)

    def copy_files_to(self, directory: str | os.PathLike[str]) -> list[str]:
        """Copy ``config.json``, ``generation_config.json``, the tokenizer's files and the model's
        own code files (``modeling_*.py``..., of a folder opened with ``trust_remote_code``);
        returns their names."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        copied = []
        code = sorted({f for pattern in _CODE_FILES for f in self.path.glob(pattern) if f.is_file()})
        for src in [self.path / n for n in _CONFIG_FILES if (self.path / n).is_file()] + self.tokenizer_files + code:
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


def _json(path: Path) -> dict[str, Any]:
    """A folder's JSON file as a dict (``{}`` for another JSON value).

    Raises:
        FolderError: the file is not JSON.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FolderError(f"cannot read {path} as JSON ({e}): write it again with save_pretrained") from e
    return data if isinstance(data, dict) else {}


def _decoder_flag(model_type: str) -> str | None:
    """The config flag that makes an encoder family's causal-LM class causal, or ``None`` for a decoder family.

    The encoder families are those transformers maps to a masked-LM class as well as a causal-LM
    one (BERT, RoBERTa, ELECTRA...; their causal class is the encoder with a causal mask, which
    needs ``is_decoder``), and BertGeneration; XLM's flag is ``causal``.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES as masked

    if model_type == "xlm":
        return "causal"
    if model_type in masked or model_type == "bert-generation":
        return "is_decoder"
    return None


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:  # an optional dependency: only folders need it
        raise MissingDependencyError(
            f"reading a Hugging Face folder needs transformers: {INSTALL_HF} (or pip install transformers)"
        ) from e
    return transformers
