"""Tiny Hugging Face folders and token files, written the way users have them (save_pretrained, np.save)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

VOCAB = 128
TEXT = "the quick brown fox jumps over the lazy dog. " * 40


def write_llama(directory: Path, *, weights: bool = True, tokenizer: bool = True, **overrides: object) -> Path:
    """A 2-layer Llama folder: config.json, model.safetensors (optional) and a small BPE tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    config = LlamaConfig(**{**settings, **overrides})
    if weights:
        torch.manual_seed(1)
        LlamaForCausalLM(config).save_pretrained(directory)
    else:
        config.save_pretrained(directory)
    if tokenizer:
        write_tokenizer(directory)
    return directory


def write_gpt2(directory: Path) -> Path:
    """A 2-layer GPT-2 folder (q, k and v packed in c_attn, its embedding tied to the LM head; dropout 0,
    so that a tensor-parallel run computes what the plain model does) and a small BPE tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(1)
    GPT2LMHeadModel(config).save_pretrained(directory)
    write_tokenizer(directory)
    return directory


def write_tokenizer(directory: Path) -> None:
    """A word-piece BPE trained here on TEXT (no hub), saved as a fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(directory)


def write_lines(path: Path, lines: list[str]) -> Path:
    """``lines`` written to ``path``, one per line (a prompts file, say)."""
    path.write_text("\n".join(lines) + "\n")
    return path


def prompts_fixture(lines: list[str], folder: str) -> Any:
    """A module-scoped fixture: ``lines`` as ``prompts.jsonl`` in a fresh folder named ``folder``."""

    @pytest.fixture(scope="module")
    def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return write_lines(tmp_path_factory.mktemp(folder) / "prompts.jsonl", lines)

    return prompts


@pytest.fixture(scope="session")
def generation_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama folder whose vocabulary is close to the tokenizer's (53 tokens), so that most new
    tokens decode to text: what the generation commands are tried on."""
    return write_llama(tmp_path_factory.mktemp("gen-llama"), vocab_size=64)


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def gpt2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gpt2(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="session")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, VOCAB, 4000))
    return path
