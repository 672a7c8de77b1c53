"""A folder's weights, honoured or refused: pytorch_model.bin (one file or shards) trains from its
weights, other formats are refused before planning, a folder without weights warns."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from conftest import VOCAB, write_llama
from pipecut.cli import main
from pipecut.folder import HFFolder
from pipecut.train.data import TRAIN, open_tokens
from pipecut.train.loop import lm_loss
from runtime.state.weight_errors import WeightsSourceError


def _train_args(folder: Path, data: Path, out: Path) -> list[str]:
    return ["train", "--model", str(folder), "--data", str(data), "--out", str(out), "--seq-len", "16",
            "--global-batch", "4", "--micro-batch-size", "2", "--pp", "2", "--steps", "1"]


def write_bin_folder(directory: Path, *, sharded: bool) -> torch.nn.Module:
    """A Llama folder as transformers 4's save_pretrained(safe_serialization=False) wrote it:
    config.json and pytorch_model.bin, or pytorch_model-0000i-of-00002.bin with their index."""
    from transformers import LlamaForCausalLM

    write_llama(directory, weights=False, tokenizer=False)
    torch.manual_seed(7)
    model = LlamaForCausalLM(HFFolder(directory).config)
    state = model.state_dict()
    if not sharded:
        torch.save(state, directory / "pytorch_model.bin")
        return model
    keys = list(state)
    groups = [keys[: len(keys) // 2], keys[len(keys) // 2 :]]
    weight_map = {}
    for i, group in enumerate(groups):
        name = f"pytorch_model-{i + 1:05d}-of-{len(groups):05d}.bin"
        torch.save({k: state[k] for k in group}, directory / name)
        weight_map.update(dict.fromkeys(group, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (directory / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return model


@pytest.mark.parametrize("sharded", [False, True], ids=["pytorch_model.bin", "bin-shards"])
def test_a_pytorch_model_bin_folder_trains_from_its_weights(
    sharded: bool, token_file: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    model = write_bin_folder(folder, sharded=sharded)
    expected = "pytorch_model.bin.index.json" if sharded else "pytorch_model.bin"
    assert HFFolder(folder).weights == folder / expected
    out = tmp_path / "run"
    assert main(_train_args(folder, token_file, out)) == 0
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    # The Hugging Face model with the folder's weights gives the same loss on step 0's batch ...
    x, y = open_tokens(token_file).batch(seed=0, step=0, rows=4, seq_len=16, stream=TRAIN, vocab_size=VOCAB)
    with torch.no_grad():
        reference = float(lm_loss(model(x).logits, y))
    assert first == pytest.approx(reference, rel=1e-5)
    # ... and a model from its own initialisation does not (the bug: a .bin folder trained from random init).
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.no_grad():
        fresh = float(lm_loss(LlamaForCausalLM(HFFolder(folder).config)(x).logits, y))
    assert abs(fresh - reference) > 1e-3


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("tf_model.h5", "TensorFlow weights"),
        ("flax_model.msgpack", "Flax weights"),
        ("model.ckpt.index", "a TensorFlow 1 checkpoint"),
        ("tinyllama-q4_0.gguf", "GGUF (llama.cpp) weights"),
    ],
)
def test_a_folder_with_weights_pipecut_does_not_read_is_refused_before_planning(
    name: str, says: str, token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = write_llama(tmp_path / "model", weights=False, tokenizer=False)
    (folder / name).write_bytes(b"\0" * 16)
    with pytest.raises(WeightsSourceError, match=re.escape(says) + f" .*{re.escape(name)}.*To convert"):
        _ = HFFolder(folder).weights

    def no_planning(*args: object, **kwargs: object) -> None:
        raise AssertionError("planned a folder whose weights cannot be read")

    monkeypatch.setattr("pipecut.train.loop.partition", no_planning)
    assert main(_train_args(folder, token_file, tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert name in err and says in err and "To convert" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_bin_with_pickled_code_is_refused_by_train(token_file: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    model = write_bin_folder(folder, sharded=False)
    marker = tmp_path / "ran"

    class Code:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (exec, (f"open({str(marker)!r}, 'w').write('ran')",))

    torch.save({**model.state_dict(), "extra": Code()}, folder / "pytorch_model.bin")
    assert main(_train_args(folder, token_file, tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert f"{folder / 'pytorch_model.bin'} is not a plain state dict" in err and "builtins.exec" in err
    assert "safetensors.torch.save_file" in err
    assert not marker.exists()


def test_a_folder_without_weights_trains_from_init_and_warns(
    token_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = write_llama(tmp_path / "model", weights=False, tokenizer=False)
    assert HFFolder(folder).weights is None
    with caplog.at_level(logging.WARNING, logger="pipecut.train.loop"):
        assert main(_train_args(folder, token_file, tmp_path / "run")) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"{folder} holds no weights" in w and "random initialisation (--seed 0)" in w for w in warnings)


def test_a_folder_with_weights_does_not_warn(
    llama_folder: Path, token_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="pipecut.train.loop"):
        assert main(_train_args(llama_folder, token_file, tmp_path / "run")) == 0
    assert not [r for r in caplog.records if "holds no weights" in r.getMessage()]


def test_the_configs_transformers_weights_is_followed(tmp_path: Path) -> None:
    folder = write_llama(tmp_path / "model", tokenizer=False)
    (folder / "model.safetensors").rename(folder / "custom.safetensors")
    config = json.loads((folder / "config.json").read_text())
    with pytest.raises(WeightsSourceError, match=r"names from_pretrained does not look for \(custom.safetensors\)"):
        _ = HFFolder(folder).weights
    (folder / "config.json").write_text(json.dumps({**config, "transformers_weights": "custom.safetensors"}))
    assert HFFolder(folder).weights == (folder / "custom.safetensors").resolve()
    from transformers import AutoModelForCausalLM  # which is the file from_pretrained loads, too

    AutoModelForCausalLM.from_pretrained(folder)


def test_a_nan_weight_stops_train_before_any_step_unless_named(
    token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pretrained weights holding NaN once trained to a NaN loss at every step and exported NaN
    everywhere, exit 0; now the load names the tensor and the file, and exit 2."""
    from safetensors.torch import load_file, save_file

    folder = write_llama(tmp_path / "model", tokenizer=False)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert main(_train_args(folder, token_file, tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert "NaN or infinity" in err and "model.layers.1.mlp.up_proj.weight" in err
    assert str(folder / "model.safetensors") in err and "--allow-nonfinite-weights" in err
    assert not (tmp_path / "run" / "checkpoints").exists()
    # Named on purpose: it loads; this model's loss is then NaN, which finite training stops at step 1.
    args = [*_train_args(folder, token_file, tmp_path / "run2"), "--allow-nonfinite-weights", "*.up_proj.weight"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "step 1: the loss is nan" in err and "NaN or infinity" not in err
