"""A training run's settings: one frozen record, read from TOML and flags, written back as TOML.

The keys are the ``pipecut train`` flags with ``_`` for ``-`` (``--seq-len`` is ``seq_len``); a
``run.toml`` holds any of them at its top level, flags override it, and the run writes the
resolved settings to ``OUT/config.toml``, which runs the same job again with ``--config``.

Example:
    >>> cfg = resolve({"model": "m", "data": "d.bin", "out": "run"}, {"steps": 10, "seq_len": None})
    >>> cfg.steps, cfg.seq_len, cfg.decay_end
    (10, 256, 10)
    >>> print(to_toml(cfg).splitlines()[0])
    model = "m"
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partitioner.cost.devices import parse_reserve
from partitioner.errors import ClusterError, MissingDependencyError, PipecutError
from partitioner.plan.layout import ZERO_OPTIONS
from partitioner.schedule.registry import TRAINING_SCHEDULES

__all__ = [
    "TrainConfig", "TrainConfigError", "resolve", "read_toml", "to_toml", "KEYS", "LAYOUT_KEYS", "check_tp_options",
]


class TrainConfigError(PipecutError, ValueError):
    """A training setting is missing, unknown, of the wrong type, or inconsistent with another."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a ``pipecut train`` run depends on (docs/train.md describes each key)."""

    model: str
    """A Hugging Face folder: config.json, weights to fine-tune (else the model's own init: a warning says so)."""
    data: str
    """Training tokens: ``.npy`` (1-D ints), ``.bin`` (raw ``data_dtype``), or ``.txt``/``.jsonl`` text."""
    out: str
    """The run's folder: plan, metrics, checkpoints, the final export."""
    steps: int = 100
    seq_len: int = 256
    global_batch: int = 8
    """Sequences per optimizer step, over all replicas."""
    micro_batch_size: int | None = None
    """Sequences per micro-batch (default 1; with ``layout = "auto"`` the planner's unless given)."""
    pp: int | None = None
    """Pipeline ranks (default: the world size over ``dp``; 1 in one process)."""
    dp: int | None = None
    """Data-parallel replicas (default: the world size over ``pp``; 1 in one process)."""
    tp: int | None = None
    """Tensor-parallel processes per pipeline rank: each stage's layers split over ``tp`` processes in
    the model's column/row pairs (``base_model_tp_plan``; docs/tensor-parallel.md). The job runs
    ``dp x pp x tp`` processes, under torchrun (default 1; with ``layout = "auto"`` the planner's
    unless given, with ``plan`` the plan's)."""
    schedule: str | None = None
    """The pipeline schedule, or ``auto`` (default 1f1b; with ``layout = "auto"`` the planner's unless given)."""
    zero: str | None = None
    """How the replicas shard the training state: ``none``, ``zero1`` (the optimizer state) or ``fsdp``
    (FSDP2); with dp > 1 only (default none; with ``layout = "auto"`` the planner's unless given)."""
    layout: str = "manual"
    """``manual``: dp, pp, schedule, micro-batch size and sharding as given (their defaults where not);
    ``auto``: the planner searches them (``partitioner.plan_layout``), the ones given constraining it."""
    plan: str | None = None
    """A saved plan to train (``pipecut plan ... --json``, or a run's ``OUT/plan.json``): its layout,
    checked against the job's processes and the model."""
    calibrate: str | None = None
    """With ``layout = "auto"``: the cluster JSON (``pipecut calibrate``) the layouts are priced on."""
    precision: str = "fp32"
    recompute: str = "auto"
    lr: float = 3e-4
    warmup: int = 0
    min_lr: float | None = None
    """The learning rate the cosine decays to (default ``lr / 10``)."""
    decay_steps: int | None = None
    """The step the decay ends at (default ``steps``): fix it to extend a run bitwise."""
    weight_decay: float = 0.1
    max_norm: float = 1.0
    checkpoint_every: int = 100
    keep: int = 2
    eval_every: int = 0
    eval_data: str | None = None
    eval_batches: int = 4
    seed: int = 0
    data_dtype: str = "uint16"
    device: str = "auto"
    """The device preset the plan is costed for (``auto``: this machine's, as ``pipecut plan`` defaults to:
    ``partitioner.cost.devices.default_device``)."""
    memory_reserve: str | None = None
    """Memory each device keeps out of the plan: a size (``'2GiB'``) or a share (``'10%'``); default the
    device's own (``DeviceSpec.memory_reserve``)."""
    trust_remote_code: bool = False
    """Let the folder's own code (``auto_map``, ``modeling_*.py``) run; a folder that needs it is refused without."""
    allow_nonfinite_weights: str = ""
    """Comma-separated ``fnmatch`` patterns of weight names that may load holding NaN or infinity
    (a model that stores a ``-inf`` mask); every other loaded tensor must be finite."""
    check_finite: bool = False
    """Check each micro-batch's loss before the optimizer step (``Execution(check_finite=True)``)."""
    allow_nonfinite_loss: bool = False
    """Train on past a NaN or infinite loss or gradient norm (no checkpoint of non-finite weights is
    written even so). Not ``allow_nonfinite_weights``, which is about the tensors loaded."""
    log_every: int | None = None
    """A plain progress line (stdout when it is not a terminal, and ``OUT/train.log``) every N
    steps, and at the first and last (default: about 20 lines over ``steps``)."""
    tensorboard: bool = False
    """Also write the metrics as TensorBoard event files under ``OUT/tensorboard`` (needs ``tensorboard``)."""

    def __post_init__(self) -> None:
        _check(self)

    @property
    def lr_floor(self) -> float:
        """The learning rate at the end of the decay."""
        return self.min_lr if self.min_lr is not None else self.lr / 10

    @property
    def decay_end(self) -> int:
        """The step the cosine decay ends at."""
        return self.decay_steps if self.decay_steps is not None else self.steps

    @property
    def log_interval(self) -> int:
        """Steps between progress lines: :attr:`log_every`, or about ``steps / 20``."""
        return self.log_every if self.log_every is not None else max(1, math.ceil(self.steps / 20))

    @property
    def nonfinite_patterns(self) -> tuple[str, ...]:
        """:attr:`allow_nonfinite_weights` as a tuple of patterns."""
        return tuple(p.strip() for p in self.allow_nonfinite_weights.split(",") if p.strip())


KEYS = tuple(f.name for f in dataclasses.fields(TrainConfig))
_REQUIRED = ("model", "data", "out")
_CHOICES = {
    "schedule": (*TRAINING_SCHEDULES, "auto"), "precision": ("fp32", "bf16", "fp16"),
    "recompute": ("auto", "on", "off"), "data_dtype": ("uint16", "uint32", "int32", "int64"),
    "zero": ZERO_OPTIONS, "layout": ("manual", "auto"),
}
# The keys that say how the job's processes and the batch divide: what --layout auto searches.
LAYOUT_KEYS = ("dp", "pp", "tp", "schedule", "micro_batch_size", "zero")


def resolve(file_values: Mapping[str, Any], flags: Mapping[str, Any]) -> TrainConfig:
    """The run's settings: the defaults, then a TOML file's values, then the flags given (not ``None``).

    Raises:
        TrainConfigError: an unknown key (with the closest known one), a required key missing, a
            value of the wrong type or out of range.
    """
    values: dict[str, Any] = {}
    for source, given in (("the config file", file_values), ("the flags", flags)):
        for raw, value in given.items():
            key = raw.replace("-", "_")
            if key not in KEYS:
                close = difflib.get_close_matches(key, KEYS, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; the keys are {', '.join(KEYS)}"
                raise TrainConfigError(f"unknown setting {raw!r} in {source}{hint}")
            if value is not None:
                values[key] = value
    missing = [k for k in _REQUIRED if k not in values]
    if missing:
        raise TrainConfigError(
            f"missing {', '.join(missing)}: give --{' --'.join(k.replace('_', '-') for k in missing)} "
            "or set them in the --config file"
        )
    return TrainConfig(**{k: _typed(k, v) for k, v in values.items()})


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A ``run.toml``'s keys (flat, at the top level).

    Raises:
        TrainConfigError: the file is missing or not valid TOML, or holds a table.
        MissingDependencyError: Python 3.10 without ``tomli``.
    """
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # type: ignore[import-not-found, no-redef, unused-ignore]
        except ImportError as e:
            raise MissingDependencyError("reading --config on Python 3.10 needs tomli: pip install tomli") from e
    p = Path(path)
    if not p.is_file():
        raise TrainConfigError(f"config file {p} does not exist")
    try:
        data: dict[str, Any] = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise TrainConfigError(f"{p} is not valid TOML: {e}") from None
    tables = [k for k, v in data.items() if isinstance(v, dict)]
    if tables:
        raise TrainConfigError(f"{p}: put the keys at the top level, not in tables ({', '.join(tables)})")
    return data


def to_toml(cfg: TrainConfig) -> str:
    """The settings as TOML, one ``key = value`` per line (unset optional keys left out)."""
    lines = []
    for key in KEYS:
        value = getattr(cfg, key)
        if value is None:
            continue
        if isinstance(value, str):
            text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        elif isinstance(value, bool):
            text = "true" if value else "false"
        else:
            text = repr(value)
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


# -- checks ------------------------------------------------------------------------------------


def check_tp_options(cfg: TrainConfig) -> None:
    """Refuse ``--tp`` above 1 with an option the runtime does not run under tensor parallelism yet.

    Raises:
        TrainConfigError: ``--zero fsdp`` with ``--tp`` > 1 (the fix named).
    """
    tp = cfg.tp or 1
    if tp > 1 and cfg.zero == "fsdp":
        raise TrainConfigError(
            f"--zero fsdp with --tp {tp}: FSDP2 over tensor-parallel stages (2-D sharding) is not wired yet; "
            "use --zero zero1 or none with --tp, or --tp 1 with --zero fsdp"
        )


def _field_types() -> dict[str, str]:
    return {f.name: str(f.type) for f in dataclasses.fields(TrainConfig)}


def _typed(key: str, value: Any) -> Any:
    """``value`` as the key's type (a TOML int for a float key is fine; a string for an int is not)."""
    kind = _field_types()[key]
    if kind.startswith("bool"):
        if not isinstance(value, bool):
            raise TrainConfigError(f"{key} must be true or false, got {value!r}")
    elif kind.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TrainConfigError(f"{key} must be an integer, got {value!r}")
    elif kind.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TrainConfigError(f"{key} must be a number, got {value!r}")
        value = float(value)
    elif not isinstance(value, str):
        raise TrainConfigError(f"{key} must be a string, got {value!r}")
    return value


def _check(cfg: TrainConfig) -> None:
    for key in ("steps", "seq_len", "global_batch", "keep", "eval_batches"):
        if getattr(cfg, key) < 1:
            raise TrainConfigError(f"{key} must be at least 1, got {getattr(cfg, key)}")
    for key in ("pp", "dp", "tp", "decay_steps", "log_every", "micro_batch_size"):
        if getattr(cfg, key) is not None and getattr(cfg, key) < 1:
            raise TrainConfigError(f"{key} must be at least 1, got {getattr(cfg, key)}")
    for key in ("warmup", "checkpoint_every", "eval_every", "seed"):
        if getattr(cfg, key) < 0:
            raise TrainConfigError(f"{key} must be 0 or more, got {getattr(cfg, key)}")
    for key in ("lr", "max_norm"):
        if getattr(cfg, key) <= 0:
            raise TrainConfigError(f"{key} must be positive, got {getattr(cfg, key)}")
    if cfg.weight_decay < 0 or (cfg.min_lr is not None and not 0 <= cfg.min_lr <= cfg.lr):
        raise TrainConfigError(
            f"weight_decay must be >= 0 and min_lr between 0 and lr ({cfg.lr}), got weight_decay "
            f"{cfg.weight_decay}, min_lr {cfg.min_lr}"
        )
    if cfg.check_finite and cfg.allow_nonfinite_loss:
        raise TrainConfigError(
            "--check-finite and --allow-nonfinite-loss contradict each other (one stops at a NaN loss, "
            "the other trains on past it): give one of them"
        )
    if cfg.memory_reserve is not None:
        try:
            parse_reserve(cfg.memory_reserve)
        except ClusterError as e:
            raise TrainConfigError(f"memory_reserve: {e}") from None
    for key, allowed in _CHOICES.items():
        if getattr(cfg, key) is not None and getattr(cfg, key) not in allowed:
            raise TrainConfigError(f"{key} must be one of {', '.join(allowed)}, got {getattr(cfg, key)!r}")
    _check_modes(cfg)


def _check_modes(cfg: TrainConfig) -> None:
    """``--layout auto``, ``--plan`` and ``--calibrate`` with each other and the device."""
    if cfg.plan is not None and cfg.layout == "auto":
        raise TrainConfigError(
            f"--plan {cfg.plan} and --layout auto both decide the layout: give --plan to train that plan, or "
            "--layout auto to let the planner search one"
        )
    if cfg.calibrate is not None and cfg.layout != "auto":
        raise TrainConfigError(
            f"--calibrate {cfg.calibrate} prices the layouts --layout auto searches: add --layout auto, or drop "
            "--calibrate" + (" (a --plan was priced when it was made)" if cfg.plan else "")
        )
    if cfg.calibrate is not None and cfg.device != "auto":
        raise TrainConfigError(
            f"--calibrate {cfg.calibrate} and --device {cfg.device} both say what the devices are: give one"
        )
