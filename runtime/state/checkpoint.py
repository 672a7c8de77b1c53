"""Training checkpoints of a pipeline: save, resume exactly, reshard to any plan, export.

Legend: ``s`` a stage, ``r`` a rank, *name* a tensor's fully qualified name in the original
model (what ``model.state_dict()`` calls it).

A checkpoint is a torch.distributed.checkpoint (DCP) directory holding one flat state:

* ``model.<name>``: every tensor of the model's ``state_dict``, each rank writing its stages'
  (a tied weight under each of its names; DCP writes a key several ranks hold once);
* ``optim.state.<name>.<key>`` and ``optim.group.<name>.record``: the optimizer's per-parameter
  state (``exp_avg``, ``step``...) and its group settings (``lr``, ``betas``...; a tensor-valued
  one at ``optim.group.<name>.<key>``), by parameter name, so that any plan, schedule or world
  size, and the plain model, can read them;
* ``trainer.step``, ``trainer.world<N>``, ``trainer.scheduler`` (the LR scheduler's
  ``state_dict``), ``trainer.loss_scaler`` (fp16), and ``rng.rank<r>.cpu`` / ``.cuda``: each
  rank's RNG states (restored where the world size is the same).

Every entry is a tensor: non-tensor values are JSON records in ``uint8`` tensors
(``runtime.state.safe_dcp.to_record``), so a checkpoint holds no pickle; checkpoints of older
versions, which DCP pickled those values into, still load (read with ``weights_only``).

Names, not stage or rank numbers, key everything, so a checkpoint saved under a 2-stage plan
loads into a 4-stage plan, another schedule, or the unpartitioned model (:func:`load_model`).

Crash safety: the state is written to a sibling folder ``.<dir>.partial-step<N>`` and renamed
to ``dir`` only after every rank has finished (DCP writes its ``.metadata`` last); an existing
``dir`` is replaced only then. A save that dies midway leaves the previous checkpoint in place
and a partial folder that is not at ``dir``, so it never loads as a whole checkpoint; the next
save to ``dir`` that succeeds deletes such leftovers. Overwriting ``dir`` keeps a loadable copy
at every moment (``runtime.state.commit``: a load reads ``.<dir>.old`` when the overwrite was cut
between its renames, a save puts it back first).

Integrity: every rank hashes the files it wrote and rank 0 writes ``pipecut-manifest.json``
(size and CRC-32 of every file; per tensor for an export's shards) before the commit; a load
checks it first and raises ``ChecksumError`` naming the file (``runtime.state.integrity``).

Loading runs no code from the files (``runtime.state.safe_dcp``): metadata and non-tensor
entries are read through allow-listing unpicklers, and a damaged file is named in the error.
A load is a transaction (``runtime.state.staging``): checked, read into staging, then applied,
so one that raises changes nothing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from runtime.state import commit as _commits
from runtime.state import integrity, staging
from runtime.state.hf_conversion import checkpoint_names
from runtime.state.weight_errors import (
    CheckpointDtypeError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointShapeError,
)

__all__ = [
    "CheckpointDtypeError", "CheckpointError", "CheckpointMismatchError", "CheckpointShapeError", "Checkpointable",
    "save", "load", "load_model", "export_safetensors",
]

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]


class _StateDict(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> None: ...


class _StageModule(Protocol):
    @property
    def module(self) -> nn.Module: ...


class _BoundPlan(Protocol):
    @property
    def param_aliases(self) -> Sequence[tuple[str, Sequence[str]]]: ...

    @property
    def model(self) -> nn.Module: ...


class Checkpointable(Protocol):
    """What this module reads and writes of a trainer (``runtime.trainer.PipelineTrainer`` is one).

    A protocol, so that this module does not import the trainer, which imports it.
    """

    step_count: int

    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...

    @property
    def scheduler(self) -> _StateDict | None: ...

    @property
    def scaler(self) -> _StateDict | None: ...

    @property
    def stages(self) -> Mapping[int, _StageModule]: ...

    @property
    def plan(self) -> _BoundPlan: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def sync_tied_copies(self) -> None: ...


def save(trainer: Checkpointable, directory: PathLike) -> Path:
    """Write ``trainer``'s model, optimizer, step, scheduler and RNG states to ``directory``.

    Collective under torch.distributed: every rank calls it. Returns the directory.
    """
    target = Path(directory)
    partial = target.parent / f".{target.name}.partial-step{trainer.step_count}"
    leader = _rank() == 0
    if leader:
        target.parent.mkdir(parents=True, exist_ok=True)
        _commits.restore(target)  # an overwrite cut between its renames: its previous copy first
        shutil.rmtree(partial, ignore_errors=True)  # a save of this step that died before
    _barrier()
    state = _state(trainer, for_load=False)
    _safe_dcp().save(state, partial, collective=_distributed())
    _barrier()  # every rank's files are written, and the metadata
    _write_manifest(partial, _dcp_files(partial))
    if leader:
        _commit(partial, target)
        _remove_stale_partials(target)
    _barrier()
    log.info("saved step %d to %s", trainer.step_count, target)
    return target


def load(trainer: Checkpointable, directory: PathLike, *, optimizer: bool = True) -> None:
    """Read a checkpoint written by :func:`save` (under any plan) into ``trainer``, in place.

    A transaction (:mod:`runtime.state.staging`): every file, entry, shape and dtype is checked
    against the checkpoint's metadata first, the values are read into staging, and only when
    all of them were read are they copied into the model and optimizer and the scheduler, loss
    scaler, step and RNG states set. A load that raises leaves all of these as they were, on
    every rank. Staging holds a second copy of this rank's weights (and of its optimizer state,
    when the optimizer already had some) for the length of the load.

    Args:
        trainer: a trainer whose stages and optimizer are built (its parameters are
            overwritten; a meta model is materialised first by the trainer).
        directory: the checkpoint.
        optimizer: also load the optimizer's state and the scheduler's (``False``: weights and
            step only, e.g. to fine-tune with a fresh optimizer).

    Raises:
        CheckpointError: ``directory`` is not a checkpoint, lacks an entry this trainer needs,
            or DCP failed (its ``CheckpointException`` never escapes).
        CheckpointShapeError: a tensor's shape differs from the checkpoint's (the message names
            it and both shapes: another model, or another run's folder); a ``ValueError`` too.
        CheckpointDtypeError: a tensor's dtype differs from the checkpoint's.
        UnsafeFileError: a file would import a class or function a checkpoint never holds
            (nothing of it ran).
        CorruptFileError: a file is missing, truncated or damaged (the error names it and the entry).
    """
    # Integrity (issue 31), before any read: an overwrite cut between its renames undone, every file checksummed.
    path = integrity.verify_manifest(_commits.resolve(directory), collective=_distributed())
    if not (path / ".metadata").is_file():
        raise CheckpointError(
            f"{path} is not a pipecut checkpoint (no .metadata): pass the directory trainer.save() "
            "wrote; a folder named .<dir>.partial-* is a save that did not finish"
        )
    saved = _safe_dcp().read_metadata(path).state_dict_metadata  # first: a bad .metadata changes nothing
    opt = trainer.optimizer if optimizer else None
    fresh = opt is not None and not opt.state  # its state is created for the load: its own staging
    with staging.optimizer_rolled_back(opt):
        state, rng, problem = _planned(trainer, path, saved, optimizer=optimizer, init=fresh)
        staging.agree(problem, distributed=_distributed())  # every rank reads, or none
        staged = staging.stage(state, keep=lambda key: fresh and key.startswith("optim.state."))
        _safe_dcp().load(staged, path, collective=_distributed())
        problem = None
        changes: _Changes | None = None
        try:
            changes = _decoded(trainer, staged, optimizer=optimizer)
        except Exception as e:  # a record that is not what pipecut writes: nothing applied yet
            problem = CheckpointError(f"{path} holds an entry pipecut cannot read back ({type(e).__name__}: {e}); "
                                      "restore the checkpoint from a good copy")
        staging.agree(problem, distributed=_distributed())  # every rank applies, or none
    assert changes is not None  # else agree() raised
    # Everything was read: apply (copies and assignments only).
    staging.commit(state, staged)
    _apply(trainer, changes)
    for key in rng:
        if key.endswith(".cpu"):
            torch.set_rng_state(staged[key])
        else:
            torch.cuda.set_rng_state(staged[key])
    log.info("loaded %s at step %d", path, trainer.step_count)


def _planned(trainer: Checkpointable, path: Path, saved: Mapping[str, Any], *, optimizer: bool,
             init: bool) -> tuple[dict[str, Any], list[str], Exception | None]:
    """The state to read, the RNG keys among it, and why it cannot be read (``None``: it can).

    Creates a fresh optimizer's state when ``init`` (undone by the caller on failure). A
    problem is returned, not raised, so that the ranks agree on it before any collective read.
    """
    present = set(saved)
    if init and trainer.optimizer is not None:
        _init_optimizer_state(trainer.optimizer)
    state = _state(trainer, for_load=True, optimizer=optimizer, saved=saved)
    world = dist.get_world_size() if _distributed() else 1
    rng = [k for k in _rng_keys() if k in present] if f"trainer.world{world}" in present else []
    for key in rng:  # the same world size: this rank continues its own random streams
        state[key] = torch.empty_like(torch.get_rng_state() if key.endswith(".cpu") else torch.cuda.get_rng_state())
    # DCP flattens nested values (a scheduler's state_dict) into dotted keys below theirs.
    missing = sorted(k for k in state if k not in present and not any(p.startswith(k + ".") for p in present))
    if "trainer.loss_scaler" in missing:  # saved without fp16: the scale starts afresh
        missing.remove("trainer.loss_scaler")
        del state["trainer.loss_scaler"]
    if missing:
        return state, rng, CheckpointError(
            f"{path} lacks {len(missing)} entries this trainer needs, e.g. {missing[:4]}; it was saved "
            "from another model, or without an optimizer (load(..., optimizer=False) reads weights only)"
        )
    try:
        staging.check_against(state, saved, str(path))
    except CheckpointMismatchError as e:
        return state, rng, e
    return state, rng, None


def load_model(model: nn.Module, directory: PathLike, *, strict: bool = True) -> list[str]:
    """Load a checkpoint's weights into a plain (unpartitioned) model, in place.

    Returns the names loaded. With ``strict``, every entry of ``model.state_dict()`` must be in
    the checkpoint. Like :func:`load`, a transaction: names, shapes and dtypes are checked
    first and the values read into staging (a second copy of the model's tensors, for the
    length of the load), so a load that raises leaves the model as it was.

    Raises:
        CheckpointError: an entry is missing (``strict``), or DCP failed.
        CheckpointShapeError: a tensor's shape differs from the checkpoint's (another model).
        CheckpointDtypeError: a tensor's dtype differs from the checkpoint's.
        CorruptFileError: a file is missing, truncated or damaged.

    Example:
        ``trainer.save("ckpt")`` under any plan, then ``load_model(MyModel(), "ckpt")``.
    """
    path = integrity.verify_manifest(_commits.resolve(directory))
    saved = _safe_dcp().read_metadata(path).state_dict_metadata
    state = model.state_dict()
    wanted = {f"model.{k}": v for k, v in state.items() if (not strict and f"model.{k}" in saved) or strict}
    missing = [k for k in wanted if k not in saved]
    if missing:
        raise CheckpointError(
            f"{path} lacks {len(missing)} of the model's tensors, e.g. {[k[6:] for k in missing[:4]]}; "
            "it was saved from another model (or pass strict=False)"
        )
    staging.check_against(wanted, saved, str(path))
    staged = staging.stage(wanted)
    _safe_dcp().load(staged, path, collective=False)
    model.load_state_dict({k[len("model."):]: v for k, v in staged.items()}, strict=strict)
    return [k[len("model."):] for k in wanted]


def export_safetensors(trainer: Checkpointable, directory: PathLike, *, prefix: str = "") -> Path:
    """Write the model's weights as a Hugging Face safetensors checkpoint (shards and an index),
    under the keys ``save_pretrained`` writes (:func:`~runtime.state.hf_conversion.checkpoint_names`).

    Each rank writes one shard with its stages' tensors (a tied weight once, by its lowest
    rank; with data parallelism, only the first replica's ranks; a sharded one, FSDP's or
    tensor parallelism's, gathered whole and written by its group's first rank), rank 0 writes
    ``model.safetensors.index.json`` naming every key's shard, and the folder is committed
    with renames only after all have finished. ``prefix`` is removed from the names
    (``"model."`` for a model wrapped in ``CausalLMLogits``), so the folder, with the model's
    ``config.json`` beside it, loads with ``from_pretrained``. Collective under torch.distributed.
    """
    from safetensors.torch import save_file

    target = Path(directory)
    rank = _rank()
    partial = target.parent / f".{target.name}.partial-export"
    if rank == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        _commits.restore(target)  # an overwrite cut between its renames: its previous copy first
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()
    mine = _owned_tensors(trainer)
    # A tensor several ranks hold (a tied weight, a shard's group) is written by the lowest one;
    # aliases are dropped (save_pretrained stores a tied weight once too).
    keys = {name: _hf_name(name, prefix) for name in mine}
    held = _gather([(name, keys[name]) for name in mine])
    first_rank: dict[str, int] = {}
    for r, items in enumerate(held):
        for name, _ in items:
            first_rank.setdefault(name, r)
    kept = _kept_names(trainer, first_rank)
    shard = {}
    for name, t in mine.items():
        # Gathered one at a time (a collective for a shard), kept on the host by its writer only:
        # no rank holds its stages whole on the device.
        whole = _whole(t)
        if first_rank[name] == rank and kept.get(name, name) == name:
            shard[keys[name]] = whole.detach().to("cpu").contiguous()
        del whole
    # The keys save_pretrained writes (transformers' conversion reversed: experts one by one,
    # legacy names); every group of a conversion lies in one stage, so each rank converts its own.
    shard = checkpoint_names(shard, trainer.plan.model, prefix=prefix)
    # Only ranks with something to write get a file (data-parallel replicas hold copies of the
    # first replica's tensors), numbered among the writers.
    sizes = _gather((sorted(shard), sum(int(t.numel() * t.element_size()) for t in shard.values())))
    writers = [r for r, (ks, _) in enumerate(sizes) if ks] or [0]
    files = {r: f"model-{i + 1:05d}-of-{len(writers):05d}.safetensors" for i, r in enumerate(writers)}
    if rank in files:
        save_file(shard, str(partial / files[rank]), metadata={"format": "pt"})
    if rank == 0:
        weight_map = {key: files[r] for r, (ks, _) in enumerate(sizes) for key in ks}
        total = sum(nbytes for _, nbytes in sizes)
        body = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (partial / "model.safetensors.index.json").write_text(json.dumps(body, indent=2) + "\n")
    _barrier()
    _write_manifest(partial, {files[rank]} if rank in files else set(), extra={"model.safetensors.index.json"})
    if rank == 0:
        _commit(partial, target)
    _barrier()
    return target


def _commit(partial: Path, target: Path) -> None:
    """Put the finished ``partial`` folder at ``target``, replacing an older one only now, and
    never leaving a moment with no loadable copy (:func:`runtime.state.commit.commit`)."""
    _commits.commit(partial, target)


def _dcp_files(partial: Path) -> set[str]:
    """The files of ``partial`` this rank hashes: the ``__<rank>_*.distcp`` it wrote; the leader
    also every file no rank's name claims (``.metadata``)."""
    rank = _rank()
    world = dist.get_world_size() if _distributed() else 1
    mine = {p.name for p in partial.glob(f"__{rank}_*")}
    if rank == 0:
        ranks = tuple(f"__{r}_" for r in range(world))
        mine |= {p.name for p in partial.iterdir()
                 if p.is_file() and not p.name.startswith(ranks) and p.name != integrity.MANIFEST}
    return mine


def _write_manifest(partial: Path, mine: set[str], *, extra: Collection[str] = ()) -> None:
    """Every rank hashes the files it wrote; the leader writes one manifest covering all (and
    ``extra``, files it wrote itself). Collective; ends with every rank past the manifest."""
    leader = _rank() == 0
    digests = integrity.digest_files(partial, mine | (set(extra) if leader else set()))
    merged = {name: entry for part in _gather(digests) for name, entry in part.items()}
    if leader:
        integrity.write_manifest(partial, merged)
    _barrier()


def _remove_stale_partials(target: Path) -> None:
    """Delete the ``.<dir>.partial-step<N>`` folders that saves to ``target`` which died left."""
    for stale in sorted(target.parent.glob(f".{target.name}.partial-step*")):
        log.info("removing %s, left by a save to %s that did not finish", stale, target)
        shutil.rmtree(stale, ignore_errors=True)


# -- the state ---------------------------------------------------------------------------------


def _state(trainer: Checkpointable, *, for_load: bool, optimizer: bool = True,
           saved: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The flat state this rank writes or reads (tensors are the live ones: loads land in place).

    Non-tensor values (the step, settings, the scheduler's and scaler's state) are written as
    tensors (:func:`~runtime.state.safe_dcp.to_record`), so a checkpoint holds no pickle. A load
    reads each in the form ``saved`` (the checkpoint's metadata) has, which for checkpoints of
    older pipecut versions is DCP's pickled form (read with ``weights_only``).
    """
    records = _safe_dcp()
    saved = saved or {}

    def put(key: str, value: Any) -> None:
        # setdefault: a tied weight's copy on another device repeats the first's name.
        if isinstance(value, torch.Tensor):
            state.setdefault(key, value.detach())
        elif not for_load:
            state.setdefault(key, records.to_record(value))
        else:
            state.setdefault(key, records.record_slot(saved.get(key), value))

    # Detached views: DCP loads into them in place, which a parameter that requires grad refuses.
    state: dict[str, Any] = {f"model.{name}": t.detach() for name, t in _owned_tensors(trainer).items()}
    names = {id(p): n for n, p in trainer.named_parameters()}
    opt = trainer.optimizer
    if opt is not None and optimizer:
        for group in opt.param_groups:
            settings = {k: v for k, v in group.items() if k != "params" and not isinstance(v, torch.Tensor)}
            for p in group["params"]:
                name = names[id(p)]
                for key, value in opt.state.get(p, {}).items():
                    put(f"optim.state.{name}.{key}", value)
                for key, value in group.items():
                    if isinstance(value, torch.Tensor):
                        state.setdefault(f"optim.group.{name}.{key}", value)
                if not (for_load and any(f"optim.group.{name}.{k}" in saved for k in settings)):
                    put(f"optim.group.{name}.record", settings)
                else:  # saved by an older version: one pickled entry per setting
                    for key, value in settings.items():
                        state.setdefault(f"optim.group.{name}.{key}", value)
        if trainer.scheduler is not None:
            put("trainer.scheduler", trainer.scheduler.state_dict())
    if trainer.scaler is not None:  # fp16: resume with the scale reached (absent from older saves)
        put("trainer.loss_scaler", trainer.scaler.state_dict())
    put("trainer.step", torch.tensor(trainer.step_count) if not for_load else trainer.step_count)
    if not for_load:
        world = dist.get_world_size() if _distributed() else 1
        state[f"trainer.world{world}"] = torch.tensor(world)  # RNG states continue only under the same world size
        for key in _rng_keys():
            state[key] = torch.get_rng_state() if key.endswith(".cpu") else torch.cuda.get_rng_state()
    return state


def _rng_keys() -> list[str]:
    """This rank's RNG entries: the CPU generator's, and the current CUDA device's when in use."""
    keys = [f"rng.rank{_rank()}.cpu"]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        keys.append(f"rng.rank{_rank()}.cuda")
    return keys


@dataclass
class _Changes:
    """What a load assigns (rather than copies into live tensors), decoded before any is made."""

    step: int
    settings: list[tuple[dict[str, Any], str, Any]] = field(default_factory=list)  # (group, key, value)
    values: list[tuple[torch.Tensor, str, Any]] = field(default_factory=list)  # (param, key, value)
    scheduler: Any = None
    scaler: Any = None


def _decoded(trainer: Checkpointable, state: Mapping[str, Any], *, optimizer: bool) -> _Changes:
    """Decode the non-tensor values DCP read (records, the step); changes nothing, so that a
    record that fails to decode leaves the trainer as it was."""
    decode = _safe_dcp().from_record
    changes = _Changes(step=int(state["trainer.step"]))
    opt = trainer.optimizer
    if opt is not None and optimizer:
        names = {id(p): n for n, p in trainer.named_parameters()}
        for group in opt.param_groups:
            first = names[id(group["params"][0])]
            record = f"optim.group.{first}.record"  # a suffix: a prefix + name would look like weights
            settings = decode(state[record]) if record in state else {}
            for key in list(group):
                if key in settings:
                    changes.settings.append((group, key, settings[key]))
                elif key != "params" and f"optim.group.{first}.{key}" in state:
                    changes.settings.append((group, key, state[f"optim.group.{first}.{key}"]))
            for p in group["params"]:
                for key, live in list(opt.state.get(p, {}).items()):
                    if not isinstance(live, torch.Tensor):
                        changes.values.append((p, key, decode(state[f"optim.state.{names[id(p)]}.{key}"])))
        if trainer.scheduler is not None and "trainer.scheduler" in state:
            changes.scheduler = decode(state["trainer.scheduler"])
    if trainer.scaler is not None and "trainer.loss_scaler" in state:
        changes.scaler = decode(state["trainer.loss_scaler"])
    return changes


def _apply(trainer: Checkpointable, changes: _Changes) -> None:
    """Make the assignments of a load whose tensors are already copied into the live ones."""
    trainer.step_count = changes.step
    opt = trainer.optimizer
    for group, key, value in changes.settings:
        if isinstance(group.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
            group[key].copy_(value)  # a tensor setting (lr): in place, as the optimizer holds it
        else:
            group[key] = value
    for p, key, value in changes.values:
        assert opt is not None
        opt.state[p][key] = value
    if changes.scheduler is not None and trainer.scheduler is not None:
        trainer.scheduler.load_state_dict(changes.scheduler)
    if changes.scaler is not None and trainer.scaler is not None:
        trainer.scaler.load_state_dict(changes.scaler)
    trainer.sync_tied_copies()


def _owned_tensors(trainer: Checkpointable) -> dict[str, torch.Tensor]:
    """This process's stages' state_dict tensors by every name (a copy on another device: the first's)."""
    from runtime.state.weights import stage_tensors

    return stage_tensors({s: st.module for s, st in trainer.stages.items()})[0]


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor whole: a ``DTensor`` (FSDP's shard) gathered over its mesh, collectively (the
    ranks holding the same stages ask for the same names in the same order), else itself."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _alias_groups(trainer: Checkpointable) -> dict[str, tuple[str, ...]]:
    groups: dict[str, tuple[str, ...]] = {}
    for _name, names in trainer.plan.param_aliases:
        for n in names:
            groups[n] = tuple(names)
    return groups


def _kept_names(trainer: Checkpointable, held: Collection[str]) -> dict[str, str]:
    """Each tied name -> the one of its group an export writes: the first in the model's own order
    that a rank holds (save_pretrained's choice: ``model.embed_tokens.weight``, not ``lm_head.weight``,
    whatever name the trace gave the tensor)."""
    order = {n: i for i, n in enumerate(trainer.plan.model.state_dict(keep_vars=True))}
    kept = {}
    for name, group in _alias_groups(trainer).items():
        present = [n for n in group if n in held]
        kept[name] = min(present, key=lambda n: (order.get(n, len(order)), n)) if present else name
    return kept


def _hf_name(name: str, prefix: str) -> str:
    return name[len(prefix):] if prefix and name.startswith(prefix) else name


def _init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-parameter state (a step with zero gradients and lr 0), so a
    load has tensors of the right shapes to read into. Gradients are left as they were."""
    if opt.state:
        return
    params = [p for g in opt.param_groups for p in g["params"]]
    grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in opt.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in opt.param_groups:
        if "lr" in g:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    before = [p.detach().clone() for p in params]
    opt.step()
    with torch.no_grad():
        for p, b in zip(params, before):
            p.copy_(b)  # weight decay with lr 0 changes nothing, but some optimizers might
    for g, lr in zip(opt.param_groups, lrs):
        if lr is not None:
            g["lr"] = lr
    for p, grad in zip(params, grads):
        p.grad = grad


def _keys(path: Path) -> set[str]:
    return set(_safe_dcp().read_metadata(path).state_dict_metadata)


def _dcp() -> Any:
    """torch.distributed.checkpoint, imported on first use (it takes seconds to import)."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _safe_dcp() -> Any:
    """runtime.state.safe_dcp (DCP read without pickle), imported on first use like DCP itself."""
    from runtime.state import safe_dcp as module

    return module


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _gather(obj: Any) -> list[Any]:
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
