"""Which file of a Hugging Face model folder is its checkpoint: the one ``from_pretrained`` would
load, in transformers' own order, or a typed refusal for weights pipecut does not read.

The readers of those files are :mod:`runtime.state.weight_sources`.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

from runtime.state.weight_errors import WeightsSourceError

__all__ = ["HF_CHECKPOINTS", "INDEX_FILE", "SINGLE_FILE", "TORCH_FILE", "TORCH_INDEX_FILE", "find_checkpoint"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_INDEX_FILE = "pytorch_model.bin.index.json"
# The names from_pretrained looks for in a local folder, in its order: transformers 5.24's
# modeling_utils._get_resolved_checkpoint_files (use_safetensors unset, no variant) takes the first
# that exists of SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME.
HF_CHECKPOINTS = (SINGLE_FILE, INDEX_FILE, TORCH_FILE, TORCH_INDEX_FILE)

# Weights in a format no reader here understands (transformers 5 reads only GGUF of these, and
# converts it on load): the file pattern, what it is, and how to get a folder pipecut reads
# ({name}: the file found).
_FROM_V4 = ("load the folder with a transformers 4 release and {lib} installed, "
            "AutoModelForCausalLM.from_pretrained(folder, {flag}=True), and save_pretrained() it (model.safetensors)")
_FOREIGN: tuple[tuple[str, str, str], ...] = (
    ("tf_model*.h5", "TensorFlow weights", _FROM_V4.format(lib="TensorFlow", flag="from_tf")),
    ("tf_model.h5.index.json", "a TensorFlow shard index", _FROM_V4.format(lib="TensorFlow", flag="from_tf")),
    ("model.ckpt.index", "a TensorFlow 1 checkpoint",
     ("convert it with the model's conversion script in transformers 4 "
      "(convert_*_original_tf_checkpoint_to_pytorch), then save_pretrained() the model (model.safetensors)")),
    ("flax_model*.msgpack", "Flax weights", _FROM_V4.format(lib="Flax", flag="from_flax")),
    ("flax_model.msgpack.index.json", "a Flax shard index", _FROM_V4.format(lib="Flax", flag="from_flax")),
    ("*.gguf", "GGUF (llama.cpp) weights",
     ("dequantise it with transformers (pip install gguf): AutoModelForCausalLM.from_pretrained(folder, "
      "gguf_file='{name}').save_pretrained(new_folder), and use new_folder")),
    ("*.onnx", "an ONNX graph", "use the PyTorch weights it was exported from (model.safetensors)"),
)
# Files of a weight-file suffix that a transformers Trainer checkpoint holds beside the model and
# that are not its weights.
_NOT_WEIGHTS = ("training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state*.pth")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def find_checkpoint(directory: str | os.PathLike[str], *, explicit: str | None = None) -> Path | None:
    """The checkpoint ``from_pretrained`` would load from a model folder, or ``None`` when it holds no weights.

    The first of :data:`HF_CHECKPOINTS` that exists (transformers' own order: safetensors before
    torch files, a single file before an index), or ``explicit``: the file a config's
    ``transformers_weights`` names, which ``from_pretrained`` takes before any of them.

    Args:
        directory: the folder.
        explicit: a file name relative to ``directory`` (a config's ``transformers_weights``).

    Returns:
        The file or index to read, or ``None`` when the folder holds no weight file at all.

    Raises:
        WeightsSourceError: the folder holds weights only in a format pipecut does not read
            (TensorFlow, Flax, GGUF, ONNX), or under names ``from_pretrained`` does not look for
            (a variant such as ``model.fp16.safetensors``, shards without their index), or
            ``explicit`` is missing, outside the folder, or not safetensors.

    Example:
        >>> import tempfile, safetensors.torch, torch
        >>> d = Path(tempfile.mkdtemp())
        >>> find_checkpoint(d) is None
        True
        >>> torch.save({"w": torch.zeros(2)}, d / "pytorch_model.bin")
        >>> find_checkpoint(d).name
        'pytorch_model.bin'
        >>> safetensors.torch.save_file({"w": torch.zeros(2)}, str(d / "model.safetensors"))
        >>> find_checkpoint(d).name   # safetensors first, as from_pretrained
        'model.safetensors'
    """
    folder = Path(directory)
    if explicit is not None:
        return _explicit(folder, explicit)
    for name in HF_CHECKPOINTS:
        if (folder / name).is_file():
            return folder / name
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    for pattern, what, fix in _FOREIGN:
        found = fnmatch.filter(names, pattern)
        if found:
            raise WeightsSourceError(
                f"{folder} holds {what} ({', '.join(found[:3])}), which pipecut does not read: it reads "
                f"{', '.join(HF_CHECKPOINTS)} (from_pretrained's order). To convert: {fix.format(name=found[0])}",
                source=str(folder / found[0]),
            )
    stray = [n for n in names if n.endswith(_WEIGHT_SUFFIXES)
             and not any(fnmatch.fnmatch(n, pattern) for pattern in _NOT_WEIGHTS)]
    if stray:
        shards = [n for n in stray if n.endswith(".safetensors")]
        hint = (
            f" It holds {len(shards)} .safetensors file(s) ({', '.join(shards[:3])}) but no index: an "
            "interrupted export never writes its index, so re-export, or pass one file's path to load it."
            if len(shards) > 1 else ""
        )
        raise WeightsSourceError(
            f"{folder} holds weight files under names from_pretrained does not look for "
            f"({', '.join(stray[:3])}{', ...' if len(stray) > 3 else ''}): it reads {', '.join(HF_CHECKPOINTS)}, "
            "in that order. Rename the file (a variant such as model.fp16.safetensors to model.safetensors), "
            f"or write the index of its shards.{hint}",
            source=str(folder / stray[0]),
        )
    return None


def _explicit(folder: Path, name: str) -> Path:
    """The file a config's ``transformers_weights`` names, checked as ``from_pretrained`` checks it."""
    path = (folder / name).resolve()
    inside = path.is_relative_to(folder.resolve())
    if not inside or not name.endswith((".safetensors", ".safetensors.index.json")) or not path.is_file():
        why = ("is outside the folder" if not inside else "is not a safetensors file or index"
               if not name.endswith((".safetensors", ".safetensors.index.json")) else "does not exist")
        raise WeightsSourceError(
            f"{folder}/config.json names its weights 'transformers_weights': {name!r}, which {why}; "
            "name a .safetensors file or .safetensors.index.json inside the folder, or remove the key to "
            f"read {', '.join(HF_CHECKPOINTS)}",
            source=str(folder / name),
        )
    return path
