"""``pipecut generate``: the completions are ``model.generate``'s, sampling is reproducible across
stage counts, and every refusal is one ``pipecut: error:`` line with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import prompts_fixture, write_llama, write_tokenizer
from pipecut.cli import EXIT_ERROR, main
from pipecut.generate.prompts import PromptsError, read_prompts
from test_readme import readme_block

NEW = 8
# Ragged: 4, 1 and 9 words; the second as a plain text line.
PROMPTS = ['{"prompt": "the quick brown fox"}', "dog",
           '{"prompt": "the lazy dog jumps over the quick brown fox", "id": 3}']
TEXTS = ["the quick brown fox", "dog", "the lazy dog jumps over the quick brown fox"]
FIELDS = {"prompt", "completion", "prompt_tokens", "completion_tokens", "seconds"}


@pytest.fixture(scope="module")
def folder(generation_folder: Path) -> Path:
    return generation_folder


prompts = prompts_fixture(PROMPTS, "prompts")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[list[dict[str, object]], str]:
    assert main(["generate", *argv]) == 0
    out, err = capsys.readouterr()
    return [json.loads(line) for line in out.splitlines()], err


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["generate", *argv]) == EXIT_ERROR
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipecut: error: "), lines
    return lines[0]


def test_greedy_on_2_stages_is_model_generate(
    folder: Path, prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    out = tmp_path / "completions.jsonl"
    records, err = _run(capsys, "--model", str(folder), "--prompts", str(prompts), "--max-new-tokens", str(NEW),
                        "--pp", "2", "--batch-size", "3", "--out", str(out))
    assert records == []  # with --out, stdout holds nothing
    assert "2 stages" in err and "tokens/s" in err.strip().splitlines()[-1]
    written = [json.loads(line) for line in out.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(folder)
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    assert [r["prompt"] for r in written] == TEXTS
    for record, text in zip(written, TEXTS, strict=True):
        assert set(record) == FIELDS and float(record["seconds"]) > 0  # type: ignore[arg-type]
        ids = torch.tensor([tok(text)["input_ids"]])
        whole = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW)
        new = whole[0, ids.shape[1]:]
        assert record["prompt_tokens"] == ids.shape[1]
        assert record["completion_tokens"] == len(new)
        assert record["completion"] == tok.decode(new, skip_special_tokens=True)
    assert len({r["prompt_tokens"] for r in written}) == 3  # the prompts were ragged
    # Each prompt entering the 2 stages in pieces of 2 positions: the same completions.
    pieces, _ = _run(capsys, "--model", str(folder), "--prompts", str(prompts), "--max-new-tokens", str(NEW),
                     "--pp", "2", "--batch-size", "3", "--prefill-chunk", "2")
    assert [r["completion"] for r in pieces] == [r["completion"] for r in written]


def test_sampling_with_a_seed_is_the_same_on_1_and_2_stages(
    folder: Path, prompts: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--model", str(folder), "--prompts", str(prompts), "--max-new-tokens", str(NEW),
             "--temperature", "1.5", "--top-k", "40", "--top-p", "0.95"]
    one, _ = _run(capsys, *flags, "--seed", "3", "--pp", "1")
    two, _ = _run(capsys, *flags, "--seed", "3", "--pp", "2")
    other, _ = _run(capsys, *flags, "--seed", "4", "--pp", "2")
    assert [r["completion"] for r in one] == [r["completion"] for r in two]
    assert [r["completion_tokens"] for r in one] == [r["completion_tokens"] for r in two]
    assert [r["completion"] for r in other] != [r["completion"] for r in two]  # the seed is used


def test_sampled_text_does_not_depend_on_the_batch_size(
    folder: Path, prompts: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--model", str(folder), "--prompts", str(prompts), "--max-new-tokens", str(NEW),
             "--temperature", "1.5", "--seed", "3", "--pp", "2"]
    whole, _ = _run(capsys, *flags)
    ones, _ = _run(capsys, *flags, "--batch-size", "1")
    assert [r["completion"] for r in ones] == [r["completion"] for r in whole]


def test_bf16_runs_and_batches_split_the_prompts(
    folder: Path, prompts: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records, err = _run(capsys, "--model", str(folder), "--prompts", str(prompts), "--max-new-tokens", "3",
                        "--pp", "2", "--precision", "bf16", "--batch-size", "2")
    assert [r["prompt"] for r in records] == TEXTS and all(set(r) == FIELDS for r in records)
    assert all(1 <= int(r["completion_tokens"]) <= 3 for r in records)  # type: ignore[call-overload]
    assert "2/3 prompts" in err and "3/3 prompts" in err  # one progress line per batch off a terminal


def test_refusals_are_one_line_exit_2(
    folder: Path, prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import BertConfig

    base = ["--model", str(folder), "--prompts", str(prompts), "--max-new-tokens", "4"]
    missing = _refused(capsys, "--model", str(folder), "--prompts", str(tmp_path / "nope.jsonl"),
                       "--max-new-tokens", "4")
    assert "nope.jsonl does not exist" in missing
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    assert "holds no prompt" in _refused(capsys, *base[:2], "--prompts", str(blank), "--max-new-tokens", "4")
    assert "--max-new-tokens must be a positive integer, got 0" in _refused(capsys, *base[:4], "--max-new-tokens", "0")
    assert "--prefill-chunk must be a positive integer, got 0" in _refused(capsys, *base, "--prefill-chunk", "0")
    bert = tmp_path / "bert"
    BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               architectures=["BertForMaskedLM"]).save_pretrained(bert)
    refused = _refused(capsys, "--model", str(bert), *base[2:])
    assert "pipecut generate supports causal language models" in refused and "BertForMaskedLM" in refused
    assert "--temperature" in _refused(capsys, *base, "--top-k", "5")
    bare = tmp_path / "no-tokenizer"
    write_llama(bare, vocab_size=64, tokenizer=False)
    capsys.readouterr()  # save_pretrained's progress bar
    assert "has no tokenizer files" in _refused(capsys, "--model", str(bare), *base[2:])
    assert "more than the model's 64" in _refused(capsys, *base[:4], "--max-new-tokens", "60")


def test_settings_config_json_rules_out_are_refused_before_any_model_is_built(
    folder: Path, prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import MambaConfig, MambaForCausalLM

    from pipecut.folder import HFFolder

    def no_build(*_: object, **__: object) -> None:
        raise AssertionError("a model was built")

    monkeypatch.setattr(HFFolder, "build", no_build)
    base = ["--prompts", str(prompts), "--max-new-tokens", "4"]
    layers = HFFolder(str(folder)).config.num_hidden_layers
    too_many = _refused(capsys, "--model", str(folder), *base, "--pp", str(layers + 1))
    assert f"--pp {layers + 1}: {layers + 1} stages for {layers} layers" in too_many
    assert f"pick --pp of at most {layers}" in too_many
    mamba = tmp_path / "mamba"
    config = MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, state_size=4)
    MambaForCausalLM(config).save_pretrained(mamba)
    write_tokenizer(mamba)
    capsys.readouterr()
    refused = _refused(capsys, "--model", str(mamba), *base)
    assert "pipecut generate cannot plan mamba's stages" in refused and "attention heads" in refused
    assert "runtime.generate.Generator" in refused and "model.generate" in refused


def test_a_bad_prompt_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    with pytest.raises(PromptsError, match=r"p.jsonl:2: a JSON line needs a string \"prompt\" field, got \['text'\]"):
        read_prompts(path)
    path.write_text('ok\n{"prompt": "unterminated\n')
    with pytest.raises(PromptsError, match=r"p.jsonl:2: the line starts with '\{' but is not JSON"):
        read_prompts(path)


def test_readme_generate_command(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's `pipecut generate` as written, on the tiny folder and a prompts file of its format."""
    (cmd,) = readme_block("tests/pipecut/test_generate_cli.py::test_readme_generate_command").commands
    argv = [str(folder) if a == "path/to/hf-folder" else a for a in cmd.argv[1:]]
    assert cmd.argv[0] == "pipecut" and str(folder) in argv and "prompts.jsonl" in argv
    monkeypatch.chdir(tmp_path)
    Path("prompts.jsonl").write_text('{"prompt": "the quick brown fox"}\n{"prompt": "over the lazy"}\n')
    assert main(argv) == 0
    assert "tokens/s" in capsys.readouterr().err
    records = [json.loads(line) for line in Path("completions.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["the quick brown fox", "over the lazy"]
