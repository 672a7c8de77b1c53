"""The trainer's option objects (how it runs, how weights start, data parallelism) and its shortcuts.

Legend: ``S`` stages, ``p`` ranks, ``v`` stages per rank, ``m`` micro-batches, ``dp`` replicas.

``PipelineTrainer`` takes three frozen dataclasses instead of a long keyword list, the way
FSDP2 takes a ``MixedPrecisionPolicy`` and torchtitan groups its job config into sections:

* :class:`Execution`: the schedule and how it runs (transport, devices, recording, checks);
* :class:`Init`: where the weights come from (initialisation of a meta model, a checkpoint);
* :class:`DataParallel`: replicas of the pipeline under torch.distributed;
* :class:`TensorParallel`: each stage's layers split over a tensor-parallel group.

The keywords the trainer took before (``schedule=``, ``microbatches=``, ``weights=``...) stay
accepted for one release as shortcuts, each mapped to its object and field by :data:`SHORTCUTS`;
they do not warn. :func:`resolve_options` turns what the trainer was given into the three
objects, refusing unknown keywords (:class:`~runtime.errors.OptionKeywordError`) and a
shortcut given beside its object (:class:`~runtime.errors.TrainerOptionError`).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from partitioner.cost.exchange import DEFAULT_BUCKET_BYTES
from partitioner.plan.layout import Layout
from runtime.errors import OptionKeywordError, TrainerOptionError
from runtime.state.materialize import InitFn
from runtime.state.weights import Weights
from runtime.transport.placement import PlacementError

__all__ = [
    "Execution", "Init", "DataParallel", "TensorParallel", "TrainerOptions", "SHORTCUTS", "resolve_options",
    "apply_layout",
]

log = logging.getLogger(__name__)

Devices = Sequence[str | torch.device] | str | torch.device | None


@dataclass(frozen=True, kw_only=True)
class Execution:
    """Which schedule runs the plan, and how: transport, devices, recording and checks.

    Example:
        >>> Execution(schedule="zbh1", microbatches=8)
        Execution(schedule='zbh1', microbatches=8, chunks_per_rank=None, transport='auto', devices=None, \
timeout=300.0, record=False, fuse_wgrad=True, check_finite=False)
    """

    schedule: str | None = None
    """``'gpipe'``, ``'1f1b'``, ``'zbh1'`` (one stage per rank), ``'interleaved'`` (``v`` stages
    per rank, stage ``s`` on rank ``s % p``) or ``'zbv'`` (2 stages per rank in a V: rank ``r``
    holds ``r`` and ``2p - 1 - r``); ``None``: the plan's. The plan's ``S`` stages run on
    ``p = S / v`` ranks."""

    microbatches: int | None = None
    """``m``; ``None``: the plan's. An int >= 1 (checked when the trainer is built); batches must divide evenly by
    ``m``, so ``m`` is at most the batch's rows (checked at the first step), and the schedule
    may hold at most ``partitioner.schedule.generators.MAX_ACTIONS`` actions (checked when the
    trainer is built)."""

    chunks_per_rank: int | None = None
    """``v`` for ``'interleaved'`` (default 2); must be 2 (or ``None``) for ``'zbv'`` and 1 (or
    ``None``) for the others."""

    transport: str = "auto"
    """``'auto'`` (``'dist'`` when launched by torchrun, else ``'local'``), ``'local'`` (all ranks
    in this process, one thread per rank running all its stages), ``'sequential'`` (all ranks in
    this process, one thread: for debugging and as a baseline) or ``'dist'`` (one process per rank
    over torch.distributed)."""

    devices: Devices = None
    """With the in-process transports, a device per stage (default: all ``cpu``); the stages of
    one rank run in one thread and must share a device. With ``'dist'``, this rank's device
    (default ``cuda:LOCAL_RANK`` with NCCL, else cpu). A list is kept as a tuple."""

    timeout: float = 300.0
    """Seconds any wait for a peer may take before failing loudly."""

    record: bool = False
    """Keep when each action ran (``trainer.last_records``), for ``timeline()`` and ``save_trace()``."""

    fuse_wgrad: bool = True
    """Let large linear layers add weight gradients into ``.grad`` in place
    (``runtime.execute.wgrad_fusion``; under split backward ``I`` records that GEMM and ``W`` runs it).
    Hooks on those parameters then do not fire: pass ``False`` if you rely on them."""

    check_finite: bool = False
    """Raise ``LossError`` as soon as a micro-batch's loss is NaN or infinite, before any
    optimizer step (one device sync per micro-batch). Off: a NaN loss is returned by ``step``
    like any other, and the step is taken."""

    def __post_init__(self) -> None:
        if isinstance(self.devices, list):  # frozen means hashable: no list inside
            object.__setattr__(self, "devices", tuple(self.devices))


@dataclass(frozen=True, kw_only=True)
class Init:
    """Where this process's stage weights come from: the model's, initialised, or a checkpoint.

    Example:
        >>> Init(weights="ckpt/model.safetensors").seed
        0
    """

    init_fn: InitFn | None = None
    """For a model built on ``meta`` (``runtime.empty_weights()``): initialises the tensors this
    process's stages hold, ``init_fn(name, module)`` per module of the original model that owns
    some (default: the Hugging Face model's ``_init_weights``, else the module's
    ``reset_parameters()``). Only this process's stages are allocated, on their devices; see
    ``runtime.state.materialize``."""

    seed: int = 0
    """Base seed of that initialisation; values depend on it and the module names only, not on
    the plan or the rank (``runtime.state.materialize.initialize`` gives a real model the same weights)."""

    weights: str | os.PathLike[str] | Weights | None = None
    """A checkpoint to load this process's stages from (a path, or
    ``runtime.state.weights.Weights(path, prefix=..., cast=...)``); see ``PipelineTrainer.load_weights``.
    With a meta model, only tensors the checkpoint does not hold are initialised."""


@dataclass(frozen=True, kw_only=True)
class DataParallel:
    """Replicas of the pipeline under torch.distributed (``runtime.parallel.data_parallel``).

    Not ``torch.nn.DataParallel``: the job runs ``dp * p`` processes, each replica trains on its
    share of the global batch (``trainer.local_batch``) and gradients are averaged before every
    step, so every replica takes the step the whole batch gives.

    Example:
        >>> DataParallel(size=2, shard_optimizer=True).overlap_grad_reduce
        True
        >>> DataParallel(size=2, engine="fsdp", reshard_after_forward=False).engine
        'fsdp'
    """

    size: int | None = None
    """``dp``, the replicas (world size ``dp * p``); ``None``: 1, or the mesh's."""

    mesh: Any = None
    """Instead, a ``DeviceMesh`` with dimensions ``("dp", "pp")`` to place the replicas."""

    overlap_grad_reduce: bool = True
    """Start each stage's gradient all-reduce right after its last backward action, overlapping
    the pipeline's drain on the ranks behind; ``False`` reduces once the whole pipeline has run."""

    grad_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """The size of the flat buckets gradients are all-reduced in."""

    shard_optimizer: bool = False
    """With ``size > 1``, ZeRO-style sharding (``runtime.parallel.zero``): each parameter is owned by one
    replica, which alone keeps its optimizer state and, after the reduction, its gradient; the
    optimizer factory is called with this process's share; the owners broadcast the new values
    after each step."""

    engine: str = "replicate"
    """How the replicas share a stage: ``'replicate'`` (every replica holds the whole stage;
    gradients all-reduced in buckets overlapping the drain, ``runtime.parallel.data_parallel``;
    with ``shard_optimizer``, ZeRO-1) or ``'fsdp'`` (torch's FSDP2, ``fully_shard`` over the
    ``"dp"`` dimension, ``runtime.parallel.fsdp``: parameters, gradients and optimizer state
    divided by ``dp``; the bucket and overlap fields do not apply)."""

    reshard_after_forward: bool = True
    """With ``engine='fsdp'``: free a stage's gathered parameters after each forward and gather
    them again for its backward (ZeRO-3), or keep them gathered from the first forward to the
    stage's last backward of the step (``False``, ZeRO-2-like: fewer all-gathers, whole weights
    held through the step)."""

    def __post_init__(self) -> None:
        if self.engine not in ("replicate", "fsdp"):
            raise TrainerOptionError(
                f"DataParallel(engine={self.engine!r}): the engines are 'replicate' (the default) and 'fsdp'"
            )
        if self.engine == "fsdp" and self.shard_optimizer:
            raise TrainerOptionError(
                "DataParallel(engine='fsdp', shard_optimizer=True): FSDP shards the optimizer state already "
                "(with the parameters and gradients); drop shard_optimizer, or use engine='replicate' for ZeRO-1"
            )


@dataclass(frozen=True, kw_only=True)
class TensorParallel:
    """Each stage's layers split over ``tp`` ranks in Megatron-LM's column/row pairs
    (``runtime.parallel.tensor``; docs/tensor-parallel.md).

    The job runs ``dp * p * tp`` processes laid out ``("dp", "pp", "tp")``, tp innermost: world
    rank ``(d * p + r) * tp + t``. The ``tp`` ranks of a stage run the same micro-batches on the
    same whole activations, each with its shard of the planned weights; rank ``t`` of a stage
    sends to rank ``t`` of the next.

    Example:
        >>> TensorParallel(size=2).size
        2
        >>> TensorParallel(size=2, plan={"layers.*.mlp.up_proj": "colwise"}).patterns()
        {'layers.*.mlp.up_proj': 'colwise'}
        >>> TensorParallel(size=2, vocab=True).vocab
        True
    """

    size: int = 1
    """``tp``, the ranks each stage is split over (1: no tensor parallelism)."""

    plan: Mapping[str, str] | tuple[tuple[str, str], ...] | None = None
    """Module pattern -> ``'colwise'`` | ``'rowwise'`` | ``'packed_colwise'``
    (``runtime.parallel.tensor.plan_for``); ``None``: the model's Hugging Face
    ``config.base_model_tp_plan``, or pipecut's own for its model type (GPT-2). Kept as a tuple of pairs."""

    vocab: bool | None = None
    """Split the token embedding and the LM head over the vocabulary too (``runtime.parallel.vocab``):
    each tp rank holds ``V / tp`` of their rows, the last stage's logits stay sharded over the classes
    and ``loss_fn`` runs under torch's ``loss_parallel`` (``F.cross_entropy`` on the sharded logits).
    Found through the model's ``get_input_embeddings()`` / ``get_output_embeddings()``. ``None`` (the
    default): on where the model's own plan (``plan=None``) splits nothing but the token embedding
    (transformers' ``embedding_rowwise``: DiffLlama, GPT-OSS, LFM2, ...;
    ``runtime.parallel.tensor_stages.vocab_only_plan``), off otherwise. Off (and at ``size=1``):
    both stay whole on every tp rank."""

    def __post_init__(self) -> None:
        if type(self.size) is not int or self.size < 1:
            raise TrainerOptionError(f"TensorParallel(size={self.size!r}): the size must be an int >= 1 (tp ranks "
                                     "per stage), e.g. TensorParallel(size=2)")
        if self.vocab is not None and type(self.vocab) is not bool:
            raise TrainerOptionError(f"TensorParallel(vocab={self.vocab!r}): vocab is True (embedding and LM head "
                                     "split over the vocabulary), False (kept whole) or None (as the model's plan "
                                     "says)")
        if isinstance(self.plan, Mapping):  # frozen means hashable: no dict inside
            object.__setattr__(self, "plan", tuple(self.plan.items()))

    def patterns(self) -> dict[str, str] | None:
        """The plan as a dict (``None``: the model's config's)."""
        return None if self.plan is None else dict(self.plan)

    def splits_vocab(self, config: Any) -> bool:
        """Whether the vocabulary is split for a model of ``config``: ``vocab`` where it is given, else
        whether the model's own plan splits nothing but the token embedding (see ``vocab``).

        Example:
            >>> from types import SimpleNamespace
            >>> only = SimpleNamespace(base_model_tp_plan={"embed_tokens": "embedding_rowwise"})
            >>> TensorParallel(size=2).splits_vocab(only), TensorParallel(size=2, vocab=False).splits_vocab(only)
            (True, False)
        """
        if self.vocab is not None:
            return self.vocab
        from runtime.parallel.tensor_stages import vocab_only_plan  # the parallel package imports torch.distributed
        return self.plan is None and vocab_only_plan(config)


@dataclass(frozen=True)
class TrainerOptions:
    """The option objects a trainer runs with, every field resolved."""

    execution: Execution
    init: Init
    data_parallel: DataParallel
    tensor_parallel: TensorParallel = TensorParallel()


# The trainer's parameter for each option object, and the object's class.
_SECTIONS: dict[str, type[Execution] | type[Init] | type[DataParallel] | type[TensorParallel]] = {
    "execution": Execution, "init": Init, "data_parallel": DataParallel, "tensor_parallel": TensorParallel,
}

# Old keyword -> (trainer parameter, field). Kept for one release, without a warning (the test
# suite and user scripts spell them; a DeprecationWarning would flood both); then removed.
SHORTCUTS: dict[str, tuple[str, str]] = {
    "schedule": ("execution", "schedule"),
    "microbatches": ("execution", "microbatches"),
    "chunks_per_rank": ("execution", "chunks_per_rank"),
    "transport": ("execution", "transport"),
    "devices": ("execution", "devices"),
    "timeout": ("execution", "timeout"),
    "record": ("execution", "record"),
    "fuse_wgrad": ("execution", "fuse_wgrad"),
    "check_finite": ("execution", "check_finite"),
    "init_fn": ("init", "init_fn"),
    "seed": ("init", "seed"),
    "weights": ("init", "weights"),
    "data_parallel": ("data_parallel", "size"),  # also taken as an int by the data_parallel= parameter
    "mesh": ("data_parallel", "mesh"),
    "overlap_grad_reduce": ("data_parallel", "overlap_grad_reduce"),
    "grad_bucket_bytes": ("data_parallel", "grad_bucket_bytes"),
    "shard_optimizer": ("data_parallel", "shard_optimizer"),
}
# DataParallel's later fields (engine, reshard_after_forward) have no shortcut: pass the object.

# PipelineTrainer's own keyword parameters, for suggestions (tests check them against its signature).
TRAINER_KEYWORDS = ("optimizer", "lr_scheduler", "precision", "recompute", *_SECTIONS)


def resolve_options(
    execution: Execution | None = None,
    init: Init | None = None,
    data_parallel: DataParallel | int | None = None,
    tensor_parallel: TensorParallel | int | None = None,
    **shortcuts: Any,
) -> TrainerOptions:
    """The option objects a trainer was given, with its shortcut keywords put in their fields.

    Args:
        execution, init: the objects, or ``None`` for their defaults.
        data_parallel: a :class:`DataParallel`, or an int: the shortcut for
            ``DataParallel(size=n)`` (the old ``data_parallel=n``).
        tensor_parallel: a :class:`TensorParallel`, or an int: short for ``TensorParallel(size=n)``.
        **shortcuts: old keywords (:data:`SHORTCUTS`), each put in its object's field.

    Returns:
        The resolved :class:`TrainerOptions`.

    Raises:
        OptionKeywordError: a keyword is neither a trainer parameter nor a shortcut (the message
            suggests the closest name, and says where a field of an object belongs).
        TrainerOptionError: a shortcut was given together with the object it belongs to (the
            object alone says the whole section; the message shows how to put the value there).

    Example:
        >>> opts = resolve_options(schedule="zbh1", data_parallel=2, seed=3)
        >>> opts.execution.schedule, opts.data_parallel.size, opts.init.seed
        ('zbh1', 2, 3)
        >>> resolve_options(Execution(schedule="gpipe")).execution == Execution(schedule="gpipe")
        True
    """
    if isinstance(tensor_parallel, int):
        tensor_parallel = TensorParallel(size=tensor_parallel)
    given: dict[str, Any] = {"execution": execution, "init": init, "data_parallel": data_parallel,
                             "tensor_parallel": tensor_parallel}
    if data_parallel is not None and not isinstance(data_parallel, DataParallel):
        shortcuts = {"data_parallel": data_parallel, **shortcuts}
        given["data_parallel"] = None
    fields: dict[str, dict[str, Any]] = {section: {} for section in _SECTIONS}
    for key, value in shortcuts.items():
        if key not in SHORTCUTS:
            raise OptionKeywordError(_unknown(key))
        section, name = SHORTCUTS[key]
        if given[section] is not None:
            kind = _SECTIONS[section].__name__
            raise TrainerOptionError(
                f"{key}={value!r} is a shortcut for {section}={kind}({name}=...), and {section}= was given "
                f"too: set it there, e.g. {section}=dataclasses.replace({section}, {name}={value!r})"
            )
        fields[section][name] = value
    built: dict[str, Any] = {}
    for section, cls in _SECTIONS.items():
        obj = given[section] if given[section] is not None else cls(**fields[section])
        if not isinstance(obj, cls):
            raise TrainerOptionError(
                f"{section}= takes a runtime.{cls.__name__}, got {type(obj).__name__} {obj!r}: "
                f"pass {section}={cls.__name__}(...)"
            )
        built[section] = obj
    return TrainerOptions(**built)


def _unknown(key: str) -> str:
    """The message for a keyword nobody takes: the closest names, or the object it is a field of."""
    text = f"PipelineTrainer() got an unexpected keyword argument {key!r}"
    for section, cls in _SECTIONS.items():
        if key in {f.name for f in dataclasses.fields(cls)}:
            return f"{text}: it is a field of {cls.__name__}, pass {section}={cls.__name__}({key}=...)"
    close = difflib.get_close_matches(key, list(dict.fromkeys([*TRAINER_KEYWORDS, *SHORTCUTS])), n=3)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else "."
    old = ", ".join(k for k in SHORTCUTS if k not in TRAINER_KEYWORDS)
    return (f"{text}{hint} It takes the keywords {', '.join(TRAINER_KEYWORDS)}, and for one release the "
            f"shortcuts {old} (runtime.options.SHORTCUTS says where each goes)")



def apply_layout(options: TrainerOptions, layout: Layout | None, mode: str) -> TrainerOptions:
    """The options with what the plan's layout decides filled in where the caller left it open.

    A plan from ``partitioner.plan_layout`` records the replicas (``layout.dp``) and the
    sharding over them (``layout.zero``: ``'zero1'`` is ``shard_optimizer=True``, ``'fsdp'``
    is ``engine='fsdp'`` with ``reshard_after_forward=True``); the schedule, micro-batches and
    recomputation are the plan's own fields, which the trainer reads anyway. A ``DataParallel``
    with a size or a mesh wins over the layout (a different size or sharding is logged as a
    warning: the plan was priced for another); with neither, the layout's are used. Its tensor
    parallelism (``layout.tp``) likewise: a ``TensorParallel`` left at size 1 takes the layout's
    under ``'dist'`` (in one process, which cannot split a stage, a warning says tp 1 runs); a size
    above 1 wins, with a warning when it differs.

    Raises:
        PlacementError: the layout has replicas and the trainer runs in one process.

    Example:
        >>> from partitioner.plan.layout import Layout
        >>> lay = Layout(2, 2, 2, "1f1b", 4, 4, 32, "zero1", 1.0, 1.0, 0.0, 0.0, 0.1, 1.0, 2.0, 0.0, 0)
        >>> opts = apply_layout(resolve_options(), lay, "dist").data_parallel
        >>> opts.size, opts.shard_optimizer
        (2, True)
        >>> opts = apply_layout(resolve_options(), dataclasses.replace(lay, zero="fsdp"), "dist").data_parallel
        >>> opts.engine, opts.reshard_after_forward, opts.shard_optimizer
        ('fsdp', True, False)
        >>> apply_layout(resolve_options(), dataclasses.replace(lay, tp=2), "dist").tensor_parallel.size
        2
    """
    if layout is None:
        return options
    dp = options.data_parallel
    if dp.size is None and dp.mesh is None:
        if layout.dp > 1 and mode != "dist":
            raise PlacementError(
                f"the plan's layout ({layout.label()}) runs {layout.dp} replicas of a {layout.pp}-rank "
                f"pipeline: launch {layout.devices} processes (torchrun --nproc-per-node {layout.devices}); "
                f"to run one replica here, pass data_parallel=1 (and microbatches={layout.microbatches * layout.dp} "
                "for the same step)"
            )
        if layout.zero == "fsdp" and dp.engine == "replicate" and not dp.shard_optimizer:
            dp = dataclasses.replace(dp, size=layout.dp, engine="fsdp", reshard_after_forward=True)
        else:
            zero1 = layout.zero == "zero1" and dp.engine != "fsdp"  # FSDP shards the optimizer state anyway
            dp = dataclasses.replace(dp, size=layout.dp, shard_optimizer=dp.shard_optimizer or zero1)
    elif dp.size is not None and dp.size != layout.dp:
        log.warning("running %d replicas; the plan's layout was priced for %d (%s)", dp.size, layout.dp, layout.label())
    running = "fsdp" if dp.engine == "fsdp" else "zero1" if dp.shard_optimizer else "none"
    if layout.dp > 1 and (dp.size or 0) > 1 and running != layout.zero:
        log.warning("sharding over the replicas as %r; the plan's layout was priced for %r (%s): each rank's "
                    "memory differs from the plan's", running, layout.zero, layout.label())
    tp = options.tensor_parallel
    if tp.size == 1 and layout.tp > 1 and mode == "dist":
        tp = dataclasses.replace(tp, size=layout.tp)
    elif tp.size != layout.tp:
        log.warning("running tp %d; the plan's layout was priced for tp %d (%s)%s", tp.size, layout.tp,
                    layout.label(), "" if mode == "dist" else ": one process does not split a stage")
    return dataclasses.replace(options, data_parallel=dp, tensor_parallel=tp)
