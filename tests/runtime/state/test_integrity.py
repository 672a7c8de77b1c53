"""Atomic overwrite and integrity of checkpoints and exports (issue 31).

Overwrites cut between their two renames (simulated by a failing ``os.rename``) keep a loadable
copy; one flipped byte in a ``.distcp`` file or an exported shard is named by a typed error; a
checkpoint without a manifest loads with a warning; a 2-rank save writes one manifest.

Names specific to this work are imported inside the tests, so that each test fails on the code
before it for its own reason (a silent load, a lost copy), not for an import.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import partition
from partitioner.zoo import MLPChain
from rank_pool import spawn
from runtime import PipelineTrainer
from runtime.state.weight_errors import CorruptFileError

MANIFEST = "pipecut-manifest.json"


def _trainer(stages: int = 2, transport: str = "local", *, seed: int = 5) -> PipelineTrainer:
    torch.manual_seed(seed)
    model = MLPChain((16, 32, 32, 8))
    plan = partition(model, (torch.zeros(2, 16),), stages, microbatches=2)
    return PipelineTrainer(plan, nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1),
                           transport=transport, timeout=60)


def _step(trainer: PipelineTrainer) -> None:
    gen = torch.Generator().manual_seed(trainer.step_count)
    trainer.step(torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen))


def _params(trainer: PipelineTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.named_parameters()}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for n in got:
        assert torch.equal(got[n], want[n]), n


def _cut_commit(monkeypatch: pytest.MonkeyPatch, marker: str) -> None:
    """Make the rename of a ``.<dir>.partial*`` folder into place fail, as a kill there would:
    the first of the commit's renames (the current copy to ``.<dir>.old``) has happened."""
    real = os.rename

    def rename(src: Any, dst: Any, *a: Any, **kw: Any) -> None:
        if Path(src).name.startswith(marker):
            raise KeyboardInterrupt("killed between the overwrite's renames")
        real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", rename)


@pytest.fixture(scope="module")
def trained() -> tuple[PipelineTrainer, dict[str, torch.Tensor]]:
    """A 2-stage trainer after one step, and its weights then."""
    trainer = _trainer()
    _step(trainer)
    return trainer, _params(trainer)


@pytest.fixture
def ckpt(trained: Any, tmp_path: Path) -> Path:
    """``trained``'s checkpoint, saved in the test's folder."""
    path = tmp_path / "ckpt"
    trained[0].save(path)
    return path


@pytest.fixture
def final(trained: Any, tmp_path: Path) -> Path:
    """``trained``'s weights, exported in the test's folder."""
    path = tmp_path / "final"
    trained[0].export_safetensors(path)
    return path


# -- atomic overwrite --------------------------------------------------------------------------


def test_a_checkpoint_overwrite_cut_between_its_renames_keeps_a_loadable_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = tmp_path / "ckpt"
    trainer = _trainer()
    _step(trainer)
    trainer.save(ckpt)
    first = _params(trainer)
    _step(trainer)
    with monkeypatch.context() as m:
        _cut_commit(m, ".ckpt.partial")
        with pytest.raises(KeyboardInterrupt):
            trainer.save(ckpt)
    assert not ckpt.exists() and (tmp_path / ".ckpt.old").is_dir()
    fresh = _trainer(seed=9)
    with caplog.at_level(logging.WARNING):
        fresh.load(ckpt)  # main: "not a pipecut checkpoint"
    _assert_same(_params(fresh), first)
    assert fresh.step_count == 1
    assert "loading the previous copy" in caplog.text

    # Cut again: main's second save deleted .ckpt.old first, leaving no loadable copy.
    _step(trainer)
    with monkeypatch.context() as m:
        _cut_commit(m, ".ckpt.partial")
        with pytest.raises(KeyboardInterrupt):
            trainer.save(ckpt)
    fresh = _trainer(seed=9)
    fresh.load(ckpt)
    _assert_same(_params(fresh), first)

    trainer.save(ckpt)  # uncut: the new copy, and no leftovers
    fresh.load(ckpt)
    _assert_same(_params(fresh), _params(trainer))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_an_export_overwrite_cut_between_its_renames_keeps_a_loadable_copy(
    trained: Any, final: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, weights = trained
    other = _trainer(seed=7)
    with monkeypatch.context() as m:
        _cut_commit(m, ".final.partial")
        with pytest.raises(KeyboardInterrupt):
            other.export_safetensors(final)
        with pytest.raises(KeyboardInterrupt):  # cut twice: main deletes .final.old here
            other.export_safetensors(final)
    fresh = _trainer(seed=9)
    fresh.load_weights(final)  # main: "does not exist"
    _assert_same(_params(fresh), weights)
    other.export_safetensors(final)
    fresh.load_weights(final)
    _assert_same(_params(fresh), _params(other))


# -- integrity ---------------------------------------------------------------------------------


def _flip(path: Path, offset: int) -> None:
    """XOR one byte: the low mantissa byte of a float32 keeps it finite, so only a checksum sees it."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _tensor_offset(path: Path, key: str) -> int:
    """Where ``key``'s bytes start in a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return 8 + n + int(header[key]["data_offsets"][0])


def test_a_flipped_byte_in_a_distcp_file_is_named(ckpt: Path) -> None:
    distcp = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
    _flip(distcp, distcp.stat().st_size // 2)
    with pytest.raises(CorruptFileError, match=re.escape(distcp.name)) as err:  # main: loads silently
        _trainer(seed=9).load(ckpt)
    from runtime.state.integrity import ChecksumError

    assert isinstance(err.value, ChecksumError) and err.value.file == str(distcp)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert set(manifest["files"]) == {p.name for p in ckpt.iterdir()} - {MANIFEST}
    with pytest.raises(ChecksumError, match=re.escape(distcp.name)):
        from runtime.state.checkpoint import load_model

        load_model(MLPChain((16, 32, 32, 8)), ckpt)


def test_a_flipped_byte_in_an_exported_shard_names_file_and_tensor(final: Path) -> None:
    shard = final / "model-00001-of-00001.safetensors"
    key = sorted(json.loads((final / "model.safetensors.index.json").read_text())["weight_map"])[-1]
    _flip(shard, _tensor_offset(shard, key))
    with pytest.raises(CorruptFileError, match=re.escape(shard.name)) as err:  # main: loads silently
        _trainer(seed=9).load_weights(final)
    assert err.value.key == key and repr(key) in str(err.value)


def test_a_checkpoint_without_a_manifest_loads_with_a_warning(
    trained: Any, ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, weights = trained
    (ckpt / MANIFEST).unlink(missing_ok=True)  # as older pipecut versions wrote it
    fresh = _trainer(seed=9)
    with caplog.at_level(logging.WARNING):
        fresh.load(ckpt)
    _assert_same(_params(fresh), weights)
    assert f"{ckpt} has no {MANIFEST}" in caplog.text and "without checksum verification" in caplog.text


# -- several ranks ---------------------------------------------------------------------------


def _save_and_export(rank: int, world: int, ckpt: str, final: str) -> dict[str, Any]:
    trainer = _trainer(world, "dist")
    _step(trainer)
    trainer.save(ckpt)
    trainer.export_safetensors(final)
    return {n: t.numpy().copy() for n, t in _params(trainer).items()}


@pytest.mark.multiprocess
def test_a_two_rank_save_writes_one_manifest_of_every_rank_s_files(tmp_path: Path) -> None:
    ckpt, final = tmp_path / "ckpt", tmp_path / "final"
    held = spawn(_save_and_export, 2, str(ckpt), str(final), timeout=180)
    weights = {n: torch.from_numpy(v) for part in held for n, v in part.items()}
    for folder, want in ((ckpt, {".metadata", "__0_0.distcp", "__1_0.distcp"}),
                         (final, {"model.safetensors.index.json", "model-00001-of-00002.safetensors",
                                  "model-00002-of-00002.safetensors"})):
        listed = set(json.loads((folder / MANIFEST).read_text())["files"])
        assert listed == {p.name for p in folder.iterdir()} - {MANIFEST} == want
    fresh = _trainer(seed=9)
    fresh.load(ckpt)
    _assert_same(_params(fresh), weights)
    # Rank 1's files, hashed by rank 1, verified here.
    _flip(ckpt / "__1_0.distcp", (ckpt / "__1_0.distcp").stat().st_size - 5)
    with pytest.raises(CorruptFileError, match=r"__1_0\.distcp"):
        fresh.load(ckpt)
    shard = final / "model-00002-of-00002.safetensors"
    key = sorted(json.loads((final / "model.safetensors.index.json").read_text())["weight_map"])[-1]
    assert json.loads((final / "model.safetensors.index.json").read_text())["weight_map"][key] == shard.name
    _flip(shard, _tensor_offset(shard, key) + 4)
    with pytest.raises(CorruptFileError, match=re.escape(shard.name)) as err:
        fresh.load_weights(final)
    assert err.value.key == key
