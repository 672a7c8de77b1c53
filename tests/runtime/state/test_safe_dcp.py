"""safe_dcp.py: no checkpoint or weights folder pipecut reads can run code; damaged files are
named in a typed error; a crashed save's leftovers go with the next save (issue 19).

The exploit is real: each test first shows that plain ``pickle`` would run the payload (it
creates a marker file), then that pipecut refuses the same bytes with the marker absent.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

from partitioner import partition
from partitioner.zoo import MLPChain
from runtime import PipelineTrainer, checkpoint_index
from runtime.options import Init
from runtime.state import checkpoint as ckpt
from runtime.state.weight_errors import CorruptFileError, PartialLoadError, UnsafeFileError, WeightsSourceError
from runtime.state.weights import Weights


class _Exploit:
    """Unpickling it runs ``touch <marker>``: what a shared checkpoint could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _payload(marker: Path) -> bytes:
    data = pickle.dumps(_Exploit(marker))
    pickle.loads(data)  # the control: plain pickle runs it
    assert marker.exists(), "the exploit does not work, so this test would prove nothing"
    marker.unlink()
    return data


def _trainer(*, weights: str | Weights | None = None, seed: int = 3, transport: str = "local") -> PipelineTrainer:
    torch.manual_seed(seed)
    model = MLPChain((8, 16, 16, 4))
    plan = partition(model, (torch.zeros(2, 8),), 2, microbatches=2)
    return PipelineTrainer(
        plan, nn.functional.mse_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-2), transport=transport, timeout=60,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k)),
        init=Init(weights=weights),
    )


def _params(trainer: PipelineTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.named_parameters()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of two steps of a 2-stage MLP."""
    directory = tmp_path_factory.mktemp("safe") / "ckpt"
    trainer = _trainer()
    for k in range(2):
        trainer.step(torch.randn(4, 8, generator=torch.Generator().manual_seed(k)), torch.zeros(4, 4))
    trainer.save(directory)
    return directory


def _copy(saved: Path, tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    shutil.copytree(saved, directory)
    # Without its checksums (as an older or third-party checkpoint, or one whose crafter removed
    # them), so these tests reach the reader itself; with them, every change here is a
    # ChecksumError first (tests/runtime/state/test_integrity.py).
    (directory / "pipecut-manifest.json").unlink()
    return directory


def _distcp(directory: Path) -> Path:
    return sorted(directory.glob("*.distcp"))[0]


# -- code in a checkpoint is refused -------------------------------------------------------------


def test_a_crafted_metadata_runs_nothing_for_trainer_load(saved: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    directory = _copy(saved, tmp_path)
    (directory / ".metadata").write_bytes(_payload(marker))
    trainer = _trainer(seed=4)
    before = _params(trainer)
    with pytest.raises(UnsafeFileError) as info:
        trainer.load(directory)
    assert not marker.exists()
    assert info.value.file == str(directory / ".metadata") and info.value.refused == (f"{os.name}.system",)
    assert str(directory / ".metadata") in str(info.value) and "trust" in str(info.value)
    assert trainer.step_count == 0 and not trainer.optimizer.state  # nothing changed
    for n, t in _params(trainer).items():
        assert torch.equal(t, before[n])
    with pytest.raises(UnsafeFileError):
        ckpt.load_model(MLPChain((8, 16, 16, 4)), directory)
    assert not marker.exists()


def test_a_crafted_metadata_runs_nothing_as_a_weights_source(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    directory = tmp_path / "weights"
    directory.mkdir()
    (directory / ".metadata").write_bytes(_payload(marker))
    (directory / "__0_0.distcp").write_bytes(b"\0" * 64)
    with pytest.raises(UnsafeFileError, match=r"refused to load .*\.metadata: it would import"):
        checkpoint_index(directory)
    assert not marker.exists()
    with pytest.raises(UnsafeFileError):
        _trainer(weights=str(directory))
    assert not marker.exists()


def test_a_crafted_entry_in_a_distcp_file_runs_nothing(saved: Path, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "pwned"
    _payload(marker)
    trainer = _trainer()
    trainer.step(torch.randn(4, 8), torch.zeros(4, 4))  # so that the optimizer has state
    state = ckpt._state(trainer, for_load=False)
    state["trainer.step"] = _Exploit(marker)  # DCP pickles it into a .distcp file
    directory = tmp_path / "evil"
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    with pytest.raises(UnsafeFileError) as info:
        _trainer(seed=4).load(directory)
    assert not marker.exists()
    assert "'trainer.step'" in str(info.value) and info.value.file.endswith(".distcp")
    assert info.value.refused == (f"{os.name}.system",)
    # As a weights source only tensors are read: the entry is never unpickled, the weights load.
    assert "trainer.step" not in checkpoint_index(directory)
    loaded = _trainer(weights=Weights(str(directory), strict=False), seed=4)  # optim.* unused
    assert not marker.exists()
    for n, t in _params(loaded).items():
        assert torch.equal(t, dict(trainer.named_parameters())[n])


def test_a_crafted_tensor_entry_runs_nothing(saved: Path, tmp_path: Path) -> None:
    import dataclasses
    import io

    from runtime.state.safe_dcp import read_metadata

    marker = tmp_path / "pwned"
    _payload(marker)
    directory = _copy(saved, tmp_path)
    blob = io.BytesIO()
    torch.save(_Exploit(marker), blob)  # where the metadata promises a tensor
    (directory / "evil.distcp").write_bytes(blob.getvalue())
    meta = read_metadata(directory)
    key = sorted(k for k in meta.state_dict_metadata if k.startswith("model."))[0]
    for index, info in list(meta.storage_data.items()):
        if index.fqn == key:
            meta.storage_data[index] = dataclasses.replace(
                info, relative_path="evil.distcp", offset=0, length=len(blob.getvalue()))
    (directory / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(UnsafeFileError) as info:
        _trainer(seed=4).load(directory)
    assert not marker.exists()
    assert info.value.file == str(directory / "evil.distcp") and repr(key) in str(info.value)
    assert info.value.refused == (f"{os.name}.system",)
    with pytest.raises(PartialLoadError) as partial:  # as weights: refused while copying
        _trainer(weights=Weights(str(directory), strict=False), seed=4)
    assert not marker.exists() and isinstance(partial.value.__cause__, UnsafeFileError)


def test_errors_survive_the_trip_between_ranks() -> None:
    # DCP pickles a rank's exception to report it on every rank.
    err = pickle.loads(pickle.dumps(UnsafeFileError("m", file="f", refused=("os.system",))))
    assert (str(err), err.file, err.refused) == ("m", "f", ("os.system",))
    err2 = pickle.loads(pickle.dumps(CorruptFileError("m", file="f", key="k")))
    assert (err2.file, err2.key) == ("f", "k")


# -- damaged files are named -------------------------------------------------------------------


def test_a_truncated_distcp_file_is_named_before_anything_is_loaded(saved: Path, tmp_path: Path) -> None:
    directory = _copy(saved, tmp_path)
    target = _distcp(directory)
    target.write_bytes(target.read_bytes()[:100])  # cuts every entry
    trainer = _trainer(seed=4)
    before = _params(trainer)
    with pytest.raises(CorruptFileError, match=r"truncated.*restore the checkpoint") as info:
        trainer.load(directory)
    assert info.value.file == str(target) and info.value.key
    assert str(target) in str(info.value)
    for n, t in _params(trainer).items():  # checked before any destination was written
        assert torch.equal(t, before[n])
    with pytest.raises(WeightsSourceError, match=r"\.distcp has \d+ bytes, its entries need \d+"):
        _trainer(weights=Weights(str(directory), strict=False))  # as a weights source: before any copy


def test_flipped_bytes_in_a_distcp_file_name_the_file_and_key(saved: Path, tmp_path: Path) -> None:
    directory = _copy(saved, tmp_path)
    target = _distcp(directory)
    data = bytearray(target.read_bytes())
    data[:64] = bytes(b ^ 0xFF for b in data[:64])  # the first entry's zip header
    target.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match=r"entry '.+' of .*\.distcp cannot be read") as info:
        _trainer(seed=4).load(directory)
    assert info.value.file == str(target) and info.value.key


def _damaged_on_one_rank(rank: int, world: int, directory: str) -> dict[str, str]:
    """Save over 2 ranks, flip bytes of rank 1's file, load: what each rank raised."""
    import torch.distributed as dist

    trainer = _trainer(transport="dist")
    trainer.step(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), torch.zeros(4, 4))
    trainer.save(directory)
    if rank == 0:
        target = Path(directory) / "__1_0.distcp"
        data = bytearray(target.read_bytes())
        data[:64] = bytes(b ^ 0xFF for b in data[:64])
        target.write_bytes(bytes(data))
        # Past the checksums (test_integrity.py names the file from them): here the reader names the entry.
        (Path(directory) / "pipecut-manifest.json").unlink()
    dist.barrier()
    try:
        _trainer(transport="dist", seed=4).load(directory)
    except CorruptFileError as e:
        return {"file": e.file, "key": e.key}
    return {}


@pytest.mark.multiprocess
def test_a_damaged_file_is_raised_on_every_rank(tmp_path: Path) -> None:
    from rank_pool import spawn

    got = spawn(_damaged_on_one_rank, 2, str(tmp_path / "ckpt"), timeout=300)
    assert got[0] == got[1] and got[0]["file"].endswith("__1_0.distcp") and got[0]["key"]


@pytest.mark.parametrize("cut", [0, 10, -5])
def test_a_damaged_metadata_is_named(saved: Path, tmp_path: Path, cut: int) -> None:
    directory = _copy(saved, tmp_path)
    meta = directory / ".metadata"
    meta.write_bytes(meta.read_bytes()[:cut])
    with pytest.raises(CorruptFileError, match=r"\.metadata is truncated or damaged") as info:
        _trainer(seed=4).load(directory)
    assert info.value.file == str(meta)
    with pytest.raises(WeightsSourceError, match=r"\.metadata is truncated or damaged"):
        checkpoint_index(directory)


def test_damaged_weights_files_are_named(tmp_path: Path) -> None:
    state = {"w": torch.ones(64, 64)}
    single = tmp_path / "w.safetensors"
    safetensors.torch.save_file(state, str(single))
    single.write_bytes(single.read_bytes()[:100])
    with pytest.raises(WeightsSourceError, match=r"w\.safetensors is not a safetensors file.*re-export"):
        checkpoint_index(single)
    torch_file = tmp_path / "w.pt"
    torch.save(state, torch_file)
    torch_file.write_bytes(torch_file.read_bytes()[:200])
    with pytest.raises(WeightsSourceError, match=r"cannot read .*w\.pt.*Re-save it"):
        checkpoint_index(torch_file)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"w": "w.safe')
    with pytest.raises(WeightsSourceError, match=r"cannot read the safetensors index .*restore the file"):
        checkpoint_index(index)


# -- crashed saves are cleaned ------------------------------------------------------------------


def test_the_next_save_removes_partial_folders_of_crashed_saves(saved: Path, tmp_path: Path) -> None:
    directory = _copy(saved, tmp_path)
    stale = [tmp_path / ".ckpt.partial-step1", tmp_path / ".ckpt.partial-step9"]
    for folder in stale:
        folder.mkdir()
        (folder / "__0_0.distcp").write_bytes(b"half")
    other = tmp_path / ".other.partial-step1"  # another target's: not ours to remove
    other.mkdir()
    trainer = _trainer()
    trainer.load(directory)
    trainer.save(directory)
    assert not any(folder.exists() for folder in stale)
    assert other.exists() and (directory / ".metadata").is_file()
    _trainer(seed=4).load(directory)


# -- pipecut's checkpoints hold no pickle --------------------------------------------------------


def test_every_entry_of_a_checkpoint_is_a_tensor(saved: Path) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from runtime.state.safe_dcp import read_metadata

    entries = read_metadata(saved).state_dict_metadata
    assert {"trainer.step", "trainer.scheduler", "trainer.world1"} <= set(entries)
    assert any(k.startswith("optim.group.") for k in entries)
    pickled = sorted(k for k, m in entries.items() if not isinstance(m, TensorStorageMetadata))
    assert pickled == []


def test_records_round_trip_exactly() -> None:
    from runtime.state.safe_dcp import from_record, to_record

    value = {"betas": (0.9, 0.95), "lr": 1e-3, "nan": float("inf"), "foreach": None, "k": [1, True, "s"]}
    record = to_record(value)
    assert isinstance(record, torch.Tensor) and record.dtype == torch.uint8
    assert from_record(record) == value and type(from_record(record)["betas"]) is tuple
    odd = {"t": torch.ones(2)}  # not JSON: left for DCP, read back with weights_only
    assert to_record(odd) is odd and to_record({1: 2}) == {1: 2}


def test_a_checkpoint_with_pickled_values_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    from runtime.state import safe_dcp

    def steps(trainer: PipelineTrainer, ks: range) -> list[float]:
        gens = [torch.Generator().manual_seed(k) for k in ks]
        return [float(trainer.step(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))) for g in gens]

    trainer = _trainer()
    steps(trainer, range(2))
    trainer.save(tmp_path / "new")
    # As versions before records wrote it: plain values, one entry per group setting (pickled by DCP).
    state: dict[str, Any] = {}
    for key, value in ckpt._state(trainer, for_load=False).items():
        if key.endswith(".record"):
            value = safe_dcp.from_record(value)
            state.update({f"{key[: -len('.record')]}.{k}": v for k, v in value.items()})
        elif key == "trainer.scheduler":
            state[key] = safe_dcp.from_record(value)
        elif key == "trainer.step" or key.startswith("trainer.world"):
            state[key] = int(value)
        else:
            state[key] = value
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, checkpoint_id=str(tmp_path / "old"), no_dist=True)
    # Values whose state JSON does not hold exactly are left to DCP: they load too.
    monkeypatch.setattr(safe_dcp, "to_record", lambda value: value)
    trainer.save(tmp_path / "unrecorded")
    monkeypatch.undo()
    want = steps(trainer, range(2, 4))
    for name in ("new", "old", "unrecorded"):
        fresh = _trainer(seed=4)
        fresh.load(tmp_path / name)
        assert fresh.step_count == 2 and fresh.scheduler.last_epoch == trainer.scheduler.last_epoch - 2
        assert type(fresh.optimizer.param_groups[0]["betas"]) is tuple
        assert steps(fresh, range(2, 4)) == want, name
        for n, t in _params(fresh).items():
            assert torch.equal(t, dict(trainer.named_parameters())[n]), name
