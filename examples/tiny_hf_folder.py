"""A small Hugging Face Llama folder and a token file to try ``pipecut train`` on, with no download.

Run::

    python examples/tiny_hf_folder.py tiny-llama tokens.npy

``tiny-llama/`` is what ``save_pretrained`` writes (``config.json``, ``model.safetensors``): a
4-layer Llama with a 256-token vocabulary, standing in for your checkpoint. ``tokens.npy`` is a
1-D array of token ids, the format ``pipecut train --data`` reads (nanoGPT's raw uint16 ``.bin``
works too): sequences that count up from random starts, so the loss visibly falls in a few
dozen steps.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch


def write_folder(directory: Path, *, layers: int = 4, vocab: int = 256) -> None:
    """A randomly initialised Llama saved as a Hugging Face folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(directory)


def write_tokens(path: Path, *, tokens: int = 200_000, vocab: int = 256, seed: int = 0) -> None:
    """Runs of 64 tokens counting up (mod ``vocab``) from random starts, as one flat stream."""
    starts = np.random.default_rng(seed).integers(0, vocab, size=(tokens + 63) // 64)
    ids = (starts[:, None] + np.arange(64)) % vocab  # (runs, 64)
    np.save(path, ids.reshape(-1)[:tokens].astype(np.uint16))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where to write the model folder")
    parser.add_argument("tokens", type=Path, help="where to write the token file (.npy)")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    write_folder(args.folder, layers=args.layers)
    write_tokens(args.tokens)
    print(f"wrote {args.folder}/ (config.json, model.safetensors) and {args.tokens}")


if __name__ == "__main__":
    main()
