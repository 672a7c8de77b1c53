"""Checkpoint readers: a folder read the way from_pretrained reads it, torch files and shards, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from runtime.state.weight_errors import UnsafeFileError, WeightsSourceError
from runtime.state.weight_sources import HF_CHECKPOINTS, find_checkpoint, open_source
from runtime.state.weights import checkpoint_index, load_weights


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(3, 2, generator=g) for k in ("a.weight", "b.weight", "c.weight")}


def write_torch_shards(folder: Path, state: dict[str, torch.Tensor], groups: list[list[str]], *,
                       legacy: bool = False) -> Path:
    """pytorch_model-0000i-of-0000n.bin shards and their index, as transformers 4 wrote them."""
    weight_map = {}
    for i, keys in enumerate(groups):
        name = f"pytorch_model-{i + 1:05d}-of-{len(groups):05d}.bin"
        torch.save({k: state[k] for k in keys}, folder / name, _use_new_zipfile_serialization=not legacy)
        weight_map.update(dict.fromkeys(keys, name))
    index = folder / "pytorch_model.bin.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


class _Code:
    """Pickles as a call of ``exec``: loading it with weights_only=False would run the code."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (exec, (self.code,))


def _touch(marker: Path) -> _Code:
    return _Code(f"open({str(marker)!r}, 'w').write('ran')")


def test_a_folder_is_read_in_from_pretrained_order(tmp_path: Path) -> None:
    state = _state()
    assert find_checkpoint(tmp_path) is None  # no weights at all: the caller decides (init, or refuse)
    write_torch_shards(tmp_path, state, [["a.weight"], ["b.weight", "c.weight"]])
    assert find_checkpoint(tmp_path) == tmp_path / "pytorch_model.bin.index.json"
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert find_checkpoint(tmp_path) == tmp_path / "pytorch_model.bin"
    safetensors.torch.save_file({"a.weight": state["a.weight"]}, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a.weight": "model-00001-of-00001.safetensors"}}))
    assert find_checkpoint(tmp_path) == tmp_path / "model.safetensors.index.json"
    safetensors.torch.save_file(state, str(tmp_path / "model.safetensors"))
    assert find_checkpoint(tmp_path) == tmp_path / "model.safetensors"
    assert HF_CHECKPOINTS == ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                              "pytorch_model.bin.index.json")


def test_the_order_is_transformers_own(tmp_path: Path) -> None:
    # Remove the files one by one, best first: at each point, pipecut and from_pretrained's own
    # resolution (a private function of transformers 5; skipped where it has another form) agree.
    modeling_utils = pytest.importorskip("transformers.modeling_utils")
    resolve = getattr(modeling_utils, "_get_resolved_checkpoint_files", None)
    if resolve is None:
        pytest.skip("transformers has no _get_resolved_checkpoint_files")
    state = _state()
    safetensors.torch.save_file(state, str(tmp_path / "model.safetensors"))
    safetensors.torch.save_file(state, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": dict.fromkeys(state, "model-00001-of-00001.safetensors")}))
    torch.save(state, tmp_path / "pytorch_model.bin")
    write_torch_shards(tmp_path, state, [list(state)])
    for name in HF_CHECKPOINTS:
        try:
            files, _ = resolve(str(tmp_path), variant=None, gguf_file=None, use_safetensors=None, user_agent=None,
                               is_remote_code=False)
        except TypeError as e:  # another signature
            pytest.skip(f"transformers' _get_resolved_checkpoint_files changed: {e}")
        chosen = find_checkpoint(tmp_path)
        assert chosen == tmp_path / name
        expected = [str(chosen)] if not name.endswith(".index.json") else sorted(
            str(tmp_path / f) for f in set(json.loads(chosen.read_text())["weight_map"].values()))
        assert sorted(files) == expected
        (tmp_path / name).unlink()


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-format"])
def test_torch_shards_open_only_the_shards_read(tmp_path: Path, legacy: bool) -> None:
    state = _state()
    write_torch_shards(tmp_path, state, [["a.weight"], ["b.weight", "c.weight"]], legacy=legacy)
    with open_source(tmp_path) as src:
        assert src.kind == "torch shards" and src.touched == []  # the index alone lists the keys
        assert sorted(src.keys()) == sorted(state)
        info = src.info(["b.weight"])
        assert info["b.weight"].shape == (3, 2) and info["b.weight"].dtype == torch.float32
        assert src.touched == [str(tmp_path / "pytorch_model-00002-of-00002.bin")]
        assert "2 files, 3 keys" in src.describe()
    into = {k: torch.zeros(3, 2) for k in ("b.weight", "c.weight")}
    load_weights(tmp_path, into, names=list(state))
    assert all(torch.equal(into[k], state[k]) for k in into)
    assert set(checkpoint_index(tmp_path / "pytorch_model.bin.index.json")) == set(state)


def test_torch_files_are_memory_mapped_where_the_format_allows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    torch.save(state, tmp_path / "zip.bin")
    torch.save(state, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    seen: list[bool] = []
    real = torch.load

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(bool(kwargs.get("mmap")))
        assert kwargs.get("weights_only") is True
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "load", spy)
    for name in ("zip.bin", "legacy.bin"):
        with open_source(tmp_path / name) as src:
            assert src.kind == "torch file" and sorted(src.keys()) == sorted(state)
    assert seen == [True, False]


def test_torch_shard_refusals(tmp_path: Path) -> None:
    state = _state()
    index = write_torch_shards(tmp_path, state, [["a.weight"], ["b.weight", "c.weight"]])
    data = json.loads(index.read_text())
    data["weight_map"]["c.weight"] = "pytorch_model-00001-of-00002.bin"  # stale
    index.write_text(json.dumps(data))
    with open_source(tmp_path) as src, pytest.raises(WeightsSourceError, match=r"puts key 'c.weight' in .*stale"):
        src.info(["c.weight"])
    (tmp_path / "pytorch_model-00001-of-00002.bin").unlink()
    with open_source(tmp_path) as src, pytest.raises(WeightsSourceError, match=r"00001-of-00002.bin does not exist"):
        src.info(["a.weight"])
    index.write_text("{")
    with pytest.raises(WeightsSourceError, match=r"cannot read the torch index .*pytorch_model\.bin\.index\.json"):
        open_source(tmp_path)


@pytest.mark.parametrize("layout", ["single", "shards"])
def test_a_torch_file_with_pickled_code_is_refused_and_nothing_runs(tmp_path: Path, layout: str) -> None:
    marker = tmp_path / "ran"
    state: dict[str, object] = {**_state(), "extra": _touch(marker)}
    if layout == "single":
        torch.save(state, tmp_path / "pytorch_model.bin")
        bad = tmp_path / "pytorch_model.bin"
    else:
        write_torch_shards(tmp_path, _state(), [["a.weight"], ["b.weight", "c.weight"]])
        bad = tmp_path / "pytorch_model-00002-of-00002.bin"
        torch.save({**{k: _state()[k] for k in ("b.weight", "c.weight")}, "extra": _touch(marker)}, bad)
    with pytest.raises(UnsafeFileError) as caught, open_source(tmp_path) as src:
        src.info(src.keys())
    message = str(caught.value)
    assert str(bad) in message and "builtins.exec" in message and "weights_only=True" in message
    assert "safetensors.torch.save_file" in message  # how to convert it, in a Python the user trusts
    assert caught.value.file == str(bad) and caught.value.refused == ("builtins.exec",)
    assert not marker.exists()
    # The same file read without weights_only runs the code: the refusal above is what kept it out.
    torch.load(bad, weights_only=False)
    assert marker.exists()


def test_a_damaged_torch_file_is_not_called_unsafe(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(WeightsSourceError, match=r"cannot read .*pytorch_model.bin as a torch state dict"):
        open_source(tmp_path)


def test_torch_before_2_6_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.save(_state(), tmp_path / "pytorch_model.bin")
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    with pytest.raises(WeightsSourceError, match=r"needs torch >= 2.6 \(this is 2.5.1\).*CVE-2025-32434"):
        open_source(tmp_path)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")  # compared as versions, not as text
    with open_source(tmp_path) as src:
        assert len(src.keys()) == 3


@pytest.mark.parametrize(
    ("name", "what", "fix"),
    [
        ("tf_model.h5", "TensorFlow weights", "from_tf=True"),
        ("flax_model.msgpack", "Flax weights", "from_flax=True"),
        ("model.ckpt.index", "a TensorFlow 1 checkpoint", "convert_"),
        ("llama-7b.Q4_K_M.gguf", "GGUF", "gguf_file="),
        ("model.onnx", "an ONNX graph", "PyTorch weights"),
    ],
)
def test_weights_in_a_format_pipecut_does_not_read_are_refused(tmp_path: Path, name: str, what: str, fix: str) -> None:
    (tmp_path / name).write_bytes(b"\0")
    (tmp_path / "config.json").write_text("{}")
    for call in (find_checkpoint, open_source):
        with pytest.raises(WeightsSourceError) as caught:
            call(tmp_path)
        message = str(caught.value)
        assert name in message and what in message and fix in message and "pytorch_model.bin" in message


def test_weights_under_names_from_pretrained_does_not_read_are_refused(tmp_path: Path) -> None:
    torch.save(_state(), tmp_path / "training_args.bin")  # a Trainer's file, not weights: no refusal
    assert find_checkpoint(tmp_path) is None
    safetensors.torch.save_file(_state(), str(tmp_path / "model.fp16.safetensors"))
    with pytest.raises(WeightsSourceError, match=r"names from_pretrained does not look for \(model.fp16.safetensors\)"):
        find_checkpoint(tmp_path)


def test_a_configs_transformers_weights_names_the_file(tmp_path: Path) -> None:
    safetensors.torch.save_file(_state(), str(tmp_path / "model.safetensors"))
    safetensors.torch.save_file(_state(), str(tmp_path / "custom.safetensors"))
    assert find_checkpoint(tmp_path, explicit="custom.safetensors") == (tmp_path / "custom.safetensors").resolve()
    for name, why in (("../x.safetensors", "outside the folder"), ("w.bin", "not a safetensors file"),
                      ("gone.safetensors", "does not exist")):
        with pytest.raises(WeightsSourceError, match=f"'transformers_weights': .*{why}"):
            find_checkpoint(tmp_path, explicit=name)

