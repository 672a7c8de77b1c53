"""Transactional checkpoint loads (issue 31): a load that fails leaves the trainer exactly as it was.

Each bad checkpoint (a truncated file, a missing file, a checkpoint of another model with other
shapes, one damaged entry in the middle of a ``.distcp``) is loaded into a trainer, which then
trains 2 steps; a twin that never tried trains the same 2 steps. Weights, optimizer state,
scheduler, step, RNG state and losses must be equal to the bit. ``except Exception`` catches
every failure (DCP's own ``CheckpointException`` is a ``BaseException``).
"""

from __future__ import annotations

import dataclasses
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import partition
from partitioner.zoo import MLPChain
from rank_pool import spawn
from runtime import PipelineTrainer
from runtime.state.checkpoint import CheckpointError, CheckpointShapeError
from runtime.state.integrity import MANIFEST
from runtime.state.safe_dcp import read_metadata
from runtime.state.weight_errors import CorruptFileError

WIDTHS = (8, 16, 16, 16, 4)
OTHER = (8, 24, 24, 24, 4)  # another model: the same names, other shapes


def _trainer(widths: tuple[int, ...] = WIDTHS, *, seed: int = 3, transport: str = "local",
             stages: int = 2) -> PipelineTrainer:
    torch.manual_seed(seed)
    plan = partition(MLPChain(widths), (torch.zeros(2, widths[0]),), stages, microbatches=2)
    return PipelineTrainer(
        plan, nn.functional.mse_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        transport=transport, timeout=60,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k)),
    )


def _batch(k: int, widths: tuple[int, ...] = WIDTHS) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + k)
    return torch.randn(4, widths[0], generator=gen), torch.randn(4, widths[-1], generator=gen)


def _save(trainer: PipelineTrainer, directory: Path, steps: int = 2, widths: tuple[int, ...] = WIDTHS) -> Path:
    for k in range(steps):
        trainer.step(*_batch(50 + k, widths))
    trainer.save(directory)
    return directory


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of 2 steps of the model (another seed than the trainers under test)."""
    return _save(_trainer(seed=7), tmp_path_factory.mktemp("good") / "ckpt")


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of another model: every name the same, every width other."""
    return _save(_trainer(OTHER, seed=7), tmp_path_factory.mktemp("other") / "ckpt", widths=OTHER)


def _entries(directory: Path) -> list[tuple[str, str, int, int]]:
    """``(key, file, offset, length)`` of every stored entry, by file and offset."""
    meta = read_metadata(directory)
    return sorted((i.fqn, s.relative_path, s.offset, s.length) for i, s in (meta.storage_data or {}).items())


def _largest_distcp(directory: Path) -> Path:
    return max(directory.glob("*.distcp"), key=lambda f: f.stat().st_size)


def _copy_unchecked(good: Path, directory: Path) -> None:
    """A copy without the checksums' manifest, which would catch the damage first (ChecksumError,
    tested in test_integrity.py): what is tested here is that the load stages what it reads."""
    shutil.copytree(good, directory)
    (directory / MANIFEST).unlink()


def truncated(good: Path, tmp: Path) -> Path:
    directory = tmp / "truncated"
    _copy_unchecked(good, directory)
    target = _largest_distcp(directory)
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    return directory


def missing(good: Path, tmp: Path) -> Path:
    directory = tmp / "missing"
    _copy_unchecked(good, directory)
    _largest_distcp(directory).unlink()
    return directory


def damaged_middle(good: Path, tmp: Path, prefix: str = "") -> Path:
    """The header of the middle entry (among keys starting with ``prefix``) of the largest file
    flipped: DCP reads the entries before it (into the destinations, on main) and fails on it."""
    directory = tmp / f"damaged{prefix}"
    _copy_unchecked(good, directory)
    target = _largest_distcp(directory)
    mine = [e for e in _entries(directory) if e[1] == target.name and e[0].startswith(prefix)]
    mine.sort(key=lambda e: e[2])
    _key, _file, offset, length = mine[len(mine) // 2]
    data = bytearray(target.read_bytes())
    data[offset:offset + min(64, length)] = bytes(b ^ 0xFF for b in data[offset:offset + min(64, length)])
    target.write_bytes(bytes(data))
    return directory


def _snapshot(trainer: PipelineTrainer) -> dict[str, Any]:
    """Everything a load could change, by value."""
    opt = trainer.optimizer
    assert opt is not None
    names = {id(p): n for n, p in trainer.named_parameters()}
    optim = {f"{names[id(p)]}.{k}": (v.clone() if isinstance(v, torch.Tensor) else v)
             for p, state in opt.state.items() for k, v in state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {
        "params": {n: p.detach().clone() for n, p in trainer.named_parameters()},
        "optim": optim,
        "groups": groups,
        "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else None,
        "step": trainer.step_count,
        "rng": torch.get_rng_state(),
    }


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["step"] == want["step"]
    assert got["params"].keys() == want["params"].keys()
    for n, t in got["params"].items():
        assert torch.equal(t, want["params"][n]), n
    assert got["optim"].keys() == want["optim"].keys()
    for k, v in got["optim"].items():
        assert (torch.equal(v, want["optim"][k]) if isinstance(v, torch.Tensor) else v == want["optim"][k]), k
    assert got["groups"] == want["groups"]
    assert got["scheduler"] == want["scheduler"]
    assert torch.equal(got["rng"], want["rng"])


def _tried_then_trained(directory: Path, *, trained_before: int, transport: str = "local") -> dict[str, Any]:
    """A trainer that trains ``trained_before`` steps, tries to load ``directory`` (which fails),
    then trains 2 steps; its state, losses, and what the load raised."""
    trainer = _trainer(transport=transport)
    for k in range(trained_before):
        trainer.step(*_batch(k))
    before = _snapshot(trainer)
    error: Exception | None = None
    try:
        trainer.load(directory)
    except Exception as e:
        error = e
    assert error is not None, "the bad checkpoint loaded"
    after_failure = _snapshot(trainer)
    losses = [float(trainer.step(*_batch(k))) for k in range(trained_before, trained_before + 2)]
    return {"error": error, "before": before, "after_failure": after_failure, "losses": losses,
            "final": _snapshot(trainer)}


def _never_tried(*, trained_before: int, transport: str = "local") -> dict[str, Any]:
    trainer = _trainer(transport=transport)
    for k in range(trained_before):
        trainer.step(*_batch(k))
    losses = [float(trainer.step(*_batch(k))) for k in range(trained_before, trained_before + 2)]
    return {"losses": losses, "final": _snapshot(trainer)}


@pytest.mark.parametrize("trained_before", [0, 1], ids=["fresh", "trained"])
@pytest.mark.parametrize("make", [truncated, missing, damaged_middle, "other_model"],
                         ids=["truncated", "missing", "damaged-middle", "other-model"])
def test_a_failed_load_leaves_the_trainer_as_it_was(
    good: Path, other_model: Path, tmp_path: Path, make: Any, trained_before: int
) -> None:
    directory = other_model if make == "other_model" else make(good, tmp_path)
    tried = _tried_then_trained(directory, trained_before=trained_before)
    assert isinstance(tried["error"], CheckpointError | ValueError)
    _assert_same(tried["after_failure"], tried["before"])
    reference = _never_tried(trained_before=trained_before)
    assert tried["losses"] == reference["losses"]  # bitwise: floats compared exactly
    _assert_same(tried["final"], reference["final"])


def test_another_models_checkpoint_names_the_tensor_both_shapes_and_the_cause(other_model: Path) -> None:
    trainer = _trainer()
    with pytest.raises(CheckpointShapeError) as info:
        trainer.load(other_model)
    err = info.value
    assert isinstance(err, CheckpointError) and isinstance(err, ValueError)
    message = str(err)
    assert err.problems and all(p.expected != p.found for p in err.problems)
    first = err.problems[0]
    assert repr(first.key) in message or first.key in message
    assert first.expected in message and first.found in message
    assert "another model" in message and "--out" in message
    # Both shapes, as the user reads them: the model's (16, 8) and the checkpoint's (24, 8).
    assert "(16, 8)" in message and "(24, 8)" in message


def test_a_good_load_after_a_failed_one_still_resumes_exactly(good: Path, tmp_path: Path) -> None:
    trainer = _trainer()
    with pytest.raises(CorruptFileError):
        trainer.load(damaged_middle(good, tmp_path))
    trainer.load(good)
    reference = _trainer(seed=11)
    reference.load(good)
    assert trainer.step_count == reference.step_count == 2
    assert float(trainer.step(*_batch(9))) == float(reference.step(*_batch(9)))
    _assert_same(_snapshot(trainer), _snapshot(reference))


def test_load_model_is_transactional_too(good: Path, other_model: Path, tmp_path: Path) -> None:
    from runtime.state.checkpoint import load_model

    model = MLPChain(WIDTHS)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    for directory in (damaged_middle(good, tmp_path, "model."), other_model):
        with pytest.raises((CorruptFileError, CheckpointShapeError)):
            load_model(model, directory)
        for n, t in model.state_dict().items():
            assert torch.equal(t, before[n]), n


def test_dcp_errors_reach_the_user_typed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever DCP raises (a ``CheckpointException``, a ``BaseException``) comes out as a
    ``CheckpointError``, on save and on load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from runtime.state import safe_dcp

    def failing(*args: Any, **kwargs: Any) -> None:
        raise CheckpointException("boom", {0: (RuntimeError("disk says no"), None)})  # type: ignore[dict-item]

    trainer = _trainer()
    trainer.step(*_batch(0))
    monkeypatch.setattr(dcp, "save", failing)
    with pytest.raises(CheckpointError, match="disk says no"):
        trainer.save(tmp_path / "ckpt")
    monkeypatch.undo()
    trainer.save(tmp_path / "ckpt")
    monkeypatch.setattr(safe_dcp, "_dcp_load", failing)
    before = _snapshot(trainer)
    with pytest.raises(CheckpointError, match="disk says no"):
        trainer.load(tmp_path / "ckpt")
    _assert_same(_snapshot(trainer), before)


# -- over 2 gloo processes ----------------------------------------------------------------------


def _dist_case(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Save over 2 ranks, damage the middle entry of rank 1's file, try to load, train 2 steps;
    beside a twin that never tried."""
    import torch.distributed as dist

    _save(_trainer(seed=7, transport="dist"), Path(directory))
    if rank == 0:
        target = Path(directory) / "__1_0.distcp"
        mine = sorted((e for e in _entries(Path(directory)) if e[1] == target.name), key=lambda e: e[2])
        _key, _file, offset, length = mine[len(mine) // 2]
        data = bytearray(target.read_bytes())
        data[offset:offset + min(64, length)] = bytes(b ^ 0xFF for b in data[offset:offset + min(64, length)])
        target.write_bytes(bytes(data))
        (Path(directory) / MANIFEST).unlink()  # past the checksums: the staging is what is tested
    dist.barrier()
    tried = _tried_then_trained(Path(directory), trained_before=1, transport="dist")
    reference = _never_tried(trained_before=1, transport="dist")
    _assert_same(tried["after_failure"], tried["before"])
    _assert_same(tried["final"], reference["final"])
    return {"error": type(tried["error"]).__name__, "equal": tried["losses"] == reference["losses"]}


@pytest.mark.multiprocess
def test_a_failed_load_over_two_processes_leaves_every_rank_as_it_was(tmp_path: Path) -> None:
    got = spawn(_dist_case, 2, str(tmp_path / "ckpt"), timeout=300)
    assert got[0] == got[1] and got[0]["equal"] and got[0]["error"] == "CorruptFileError"


def test_the_errors_survive_pickling() -> None:
    err = CheckpointShapeError("m", problems=())
    assert str(pickle.loads(pickle.dumps(err))) == "m"
    assert dataclasses.is_dataclass(err) is False
