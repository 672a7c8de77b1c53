"""Model kinds checked at the door: a folder is trained or planned only when it holds a causal LM as saved."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import write_llama
from pipecut.cli import main
from pipecut.folder import HFFolder, UnsupportedModelError

_BERT = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=64)


def _save(directory: Path, cls_name: str, **settings: object) -> Path:
    """A tiny ``cls_name`` model saved as save_pretrained writes it (config.json names the class)."""
    import transformers

    cls = getattr(transformers, cls_name)
    torch.manual_seed(0)
    cls(cls.config_class(**settings)).save_pretrained(directory)
    return directory


def bert_masked_lm(d: Path) -> Path:
    return _save(d, "BertForMaskedLM", **_BERT)


def bert_classifier(d: Path) -> Path:
    return _save(d, "BertForSequenceClassification", **_BERT)


def t5(d: Path) -> Path:
    return _save(d, "T5ForConditionalGeneration", d_model=16, num_layers=1, num_heads=2, d_ff=32, vocab_size=32)


def llama_classifier(d: Path) -> Path:
    return _save(d, "LlamaForSequenceClassification", vocab_size=128, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, intermediate_size=64, max_position_embeddings=64, pad_token_id=0)


# Each folder, and what the refusal must say: the model as saved, and why it is not a causal LM.
REFUSED = {
    "bert-masked-lm": (bert_masked_lm, (r"model_type 'bert' \(BertForMaskedLM\): BertForMaskedLM is not a causal-LM "
                       r"class .*fine-tune a BertLMHeadModel checkpoint instead")),
    "bert-classifier": (bert_classifier, (r"\(BertForSequenceClassification\): BertForSequenceClassification is not "
                        r"a causal-LM class .*classification")),
    "llama-classifier": (llama_classifier, (r"\(LlamaForSequenceClassification\): LlamaForSequenceClassification is "
                         r"not a causal-LM class .*fine-tune a LlamaForCausalLM checkpoint instead")),
    "t5": (t5, r"model_type 't5' \(T5ForConditionalGeneration\), an encoder-decoder \(is_encoder_decoder is true\)"),
}


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_folders_that_are_not_causal_lms_are_refused_by_train_and_plan(
    kind: str, tmp_path: Path, token_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    write, says = REFUSED[kind]
    folder = write(tmp_path / kind)
    with pytest.raises(UnsupportedModelError, match=says):
        HFFolder(folder).check_causal_lm()

    def no_planning(*args: object, **kwargs: object) -> None:
        raise AssertionError("planned a model the door should have refused")

    monkeypatch.setattr("pipecut.train.loop.partition", no_planning)
    monkeypatch.setattr("pipecut.cli.command.partition", no_planning)
    train = ["train", "--model", str(folder), "--data", str(token_file), "--out", str(tmp_path / "run"),
             "--seq-len", "16"]
    plan = ["plan", str(folder), "--stages", "2", "--device", "cpu", "--seq-len", "16"]
    for argv, command in ((train, "pipecut train"), (plan, "pipecut plan")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{command} supports causal language models (those AutoModelForCausalLM builds" in err
        assert re.search(says, err), err
    assert not (tmp_path / "run").exists()


def test_an_encoder_family_is_a_causal_lm_only_when_saved_as_a_decoder(tmp_path: Path) -> None:
    # BERT's causal class with is_decoder unset attends both ways: a masked-LM encoder, not a causal LM.
    folder = _save(tmp_path / "encoder", "BertLMHeadModel", **_BERT)
    with pytest.raises(UnsupportedModelError, match=r"bert is an encoder family, and its causal-LM class "
                       r"BertLMHeadModel is a causal LM only with is_decoder=True.*set \"is_decoder\": true"):
        HFFolder(folder).check_causal_lm()
    decoder = _save(tmp_path / "decoder", "BertLMHeadModel", is_decoder=True, **_BERT)
    HFFolder(decoder).check_causal_lm()
    assert type(HFFolder(decoder).build(meta=True)).__name__ == "BertLMHeadModel"


@pytest.mark.parametrize("cls_name", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_causal_lms_are_still_accepted(cls_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if cls_name == "LlamaForCausalLM":
        folder = write_llama(tmp_path / "m", tokenizer=False)
    else:
        folder = _save(tmp_path / "m", cls_name, n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=64)
    HFFolder(folder).check_causal_lm()
    assert main(["plan", str(folder), "--stages", "2", "--device", "cpu", "--seq-len", "16"]) == 0
    assert "pipecut plan: 2 stages" in capsys.readouterr().out
