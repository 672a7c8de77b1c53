"""``pipecut.load_generator``: a Hugging Face folder's model as a Generator of ``pp`` stages, text in and text out
as ``model.generate`` gives it, its precision on every rank thread, and its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import pipecut
from conftest import write_llama
from pipecut.errors import FolderError, GenerateOptionError, NoTokenizerError, PrecisionError

TEXTS = ["the quick brown fox", "dog", "the lazy dog jumps over the quick brown fox"]
NEW = 6


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama(tmp_path_factory.mktemp("load-llama"), vocab_size=64)


def test_a_folder_in_two_stages_completes_text_as_model_generate(folder: Path) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    loaded = pipecut.load_generator(folder, pp=2)
    assert isinstance(loaded, pipecut.FolderGenerator)
    assert len(loaded.generator.spans) == 2 and loaded.generator.transport == "sequential"  # one process: in turn
    assert loaded.eos_token_id == 2  # the folder's generation_config.json
    got = loaded.complete(TEXTS, max_new_tokens=NEW)
    tok = AutoTokenizer.from_pretrained(folder)
    model = LlamaForCausalLM.from_pretrained(folder).eval()  # type: ignore[no-untyped-call]
    for text, completion in zip(TEXTS, got, strict=True):
        ids = torch.tensor([tok(text)["input_ids"]])
        whole = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW)
        assert completion == tok.decode(whole[0, ids.shape[1]:], skip_special_tokens=True)
    # The folder's stop and pad tokens are the generator's own defaults.
    rows = [tok(t)["input_ids"] for t in TEXTS]
    explicit = loaded.generator.generate(rows, max_new_tokens=NEW, eos_token_id=loaded.eos_token_id,
                                         pad_token_id=loaded.pad_token_id)
    assert loaded.generator.generate(rows, max_new_tokens=NEW).tokens == explicit.tokens


def test_bf16_on_rank_threads(folder: Path) -> None:
    fp32 = pipecut.load_generator(folder, pp=2, transport="threads")
    bf16 = pipecut.load_generator(folder, pp=2, transport="threads", precision="bf16")
    prompt = [[1, 20, 21, 22]]
    plain = fp32.generator.generate(prompt, max_new_tokens=2, output_logits=True).logits
    low = bf16.generator.generate(prompt, max_new_tokens=2, output_logits=True).logits
    assert plain is not None and plain[0].dtype == torch.float32
    assert low is not None and low[0].dtype == torch.bfloat16


def test_refusals_say_what_to_do(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(GenerateOptionError, match="dp=2 needs transport='dist'"):
        pipecut.load_generator(folder, pp=2, dp=2)
    with pytest.raises(GenerateOptionError, match="pp must be a positive int"):
        pipecut.load_generator(folder, pp=0)
    with pytest.raises(PrecisionError, match="unknown precision 'int8'"):
        pipecut.load_generator(folder, precision="int8")
    empty = write_llama(tmp_path / "untrained", vocab_size=64, weights=False)
    with pytest.raises(FolderError, match="holds no weights"):
        pipecut.load_generator(empty)
    bare = write_llama(tmp_path / "no-tokenizer", vocab_size=64, tokenizer=False)
    loaded = pipecut.load_generator(bare)
    assert loaded.tokenizer is None
    assert len(loaded.generator.generate([[1, 5, 6]], max_new_tokens=3, eos_token_id=[]).tokens[0]) == 3
    with pytest.raises(NoTokenizerError, match="no tokenizer files"):
        loaded.complete(["the quick"])
