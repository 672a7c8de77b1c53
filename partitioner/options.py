"""The planner's option objects (capture, costing, the cut, the layout space) and its old keywords' table.

Legend: ``p`` stages, ``m`` micro-batches, ``b`` rows per micro-batch, ``dp`` replicas.

``partition``, ``plan_layout`` and ``LayoutSearch`` take a few frozen dataclasses instead of a long
keyword list, as ``PipelineTrainer`` takes ``Execution``, ``Init`` and ``DataParallel``:

* :class:`Capture`: how the model is captured as a graph, and into which units it may be cut;
* :class:`Costing`: how the graph is priced (precision, recomputation, training state, profiling), and
  :class:`Inference` in its ``inference`` field: a plan priced for generation instead of training;
* :class:`Cut`: ``partition``'s pipeline (schedule, micro-batches) and how its cut is chosen;
* :class:`LayoutSpace`: the layouts ``plan_layout`` searches, and how hard.

Each object checks its own fields once, when it is made. The keywords the planner took before
(``microbatches=``, ``precision=``, ``split_points=``...) stay accepted for one release, each mapped
to its object and field by :data:`SHORTCUTS`, without a warning; :func:`resolve_options` puts them
there, refusing an unknown keyword (:class:`~partitioner.errors.PlannerKeywordError`) and a keyword
given beside the object that holds its field (:class:`~partitioner.errors.PartitionOptionError`).
"""

from __future__ import annotations

import dataclasses
import difflib
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from partitioner.cost.exchange import DEFAULT_BUCKET_BYTES
from partitioner.cost.precision import PRECISIONS, check_precision
from partitioner.cost.recompute import check_option
from partitioner.errors import PartitionOptionError, PlannerKeywordError, SplitPointError
from partitioner.plan.layout import DEFAULT_ZERO, ZERO_OPTIONS
from partitioner.schedule.registry import TRAINING_SCHEDULES
from partitioner.tracing.hf import block_depth, is_hf_model
from partitioner.tracing.trace import Method as TraceMethod

__all__ = [
    "Capture", "Costing", "Cut", "Inference", "LayoutSpace", "PlannerOptions", "METHODS", "SHORTCUTS", "ENTRY_POINTS",
    "resolve_options",
]

METHODS = ("exact", "equal_count", "balanced_params", "equal_size", "manual")


def _tuple(value: Any) -> Any:
    """A list kept as a tuple: a frozen object holds nothing mutable (a string stays a string)."""
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True, kw_only=True)
class Capture:
    """How the model is captured as a graph, and the units a cut may fall between.

    Example:
        >>> Capture(granularity="module", module_depth=2, leaf_modules=["h.*"])
        Capture(method='auto', granularity='module', module_depth=2, leaf_modules=('h.*',), example_kwargs=None, \
example_is='microbatch')
    """

    method: TraceMethod = "auto"
    """``'auto'``, ``'fx'`` or ``'export'`` (``'auto'`` is export for a Hugging Face model); checked by
    ``partitioner.trace`` (``TraceOptionError``). The old keyword is ``trace_method=``."""

    granularity: str | None = None
    """``'node'`` cuts anywhere; ``'module'`` only between layers. ``None``: ``'module'`` at the
    depth of the transformer blocks for a Hugging Face model (its ``_no_split_modules``, e.g. each
    of ``model.layers``: a block is never cut), else ``'node'`` (:meth:`for_model`)."""

    module_depth: int | None = None
    """With ``granularity='module'``, the module depth of a layer (``None``: found from the model)."""

    leaf_modules: Sequence[type | str] = ()
    """Module classes or names that tracing keeps whole (a list is kept as a tuple)."""

    example_kwargs: Mapping[str, Any] | None = field(default=None, compare=False)
    """Keyword inputs for tracing (``attention_mask``, ``labels``, ``pixel_values``...): graph
    inputs after the positional ones, named by their keys; the trainer takes them the same way
    (``trainer.step({...}, y)``). Not compared by ``==`` (a tensor has no single truth value)."""

    example_is: str = "microbatch"
    """``'microbatch'`` (the example is one micro-batch) or ``'batch'`` (the whole batch of ``m``
    micro-batches along dimension 0; ``partition`` only, with an int ``Cut.microbatches``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "leaf_modules", _tuple(self.leaf_modules))
        if self.example_is not in ("microbatch", "batch"):
            raise PartitionOptionError(f"example_is must be 'microbatch' or 'batch', got {self.example_is!r}")

    def for_model(self, model: nn.Module) -> Capture:
        """This capture with ``granularity`` decided for ``model`` where it was left ``None``.

        Example:
            >>> Capture().for_model(nn.Linear(2, 2)).granularity
            'node'
        """
        if self.granularity is not None:
            return self
        depth = block_depth(model) if is_hf_model(model) else None  # a Hugging Face model's blocks stay whole
        if depth:
            return dataclasses.replace(self, granularity="module", module_depth=self.module_depth or depth)
        return dataclasses.replace(self, granularity="node")


@dataclass(frozen=True, kw_only=True)
class Inference:
    """A plan for generation: what each stage holds and runs when it decodes ``batch`` sequences of up
    to ``max_len`` positions (``runtime.generate``), instead of training.

    Given as ``Costing(inference=Inference(...))``: it changes how the graph is priced, not how the
    model is captured or which algorithm cuts it. Each stage then holds its weights (no gradients,
    no optimizer state), the keys and values of its own layers for ``batch x max_len`` positions,
    and the working memory of one forward of the prompts (the example inputs are one prompt: its
    positions are the prefill's); the cut minimises the slowest stage's decode step (one position
    per sequence). docs/generate.md, "What the planner counts", has the formula.

    Example:
        >>> Inference(batch=8, max_len=2048).dtype is None
        True
        >>> Costing(inference=Inference(batch=8, max_len=2048, dtype="bf16")).inference.dtype
        'bf16'
    """

    batch: int
    """Sequences decoded together: every stage holds a key/value cache for each of them (all the
    groups in flight together)."""

    max_len: int
    """Positions each sequence reaches, prompt and new tokens together: the cache is priced full."""

    dtype: str | None = None
    """What the weights and the cache are held in: ``'fp32'``, ``'bf16'`` or ``'fp16'`` (a model
    loaded with ``dtype=torch.bfloat16``); ``None``: the model's own parameters' dtype."""

    def __post_init__(self) -> None:
        for name in ("batch", "max_len"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:  # a bool is not a count
                raise PartitionOptionError(
                    f"Inference.{name} must be a positive int, got {value!r}: pass the "
                    f"{'sequences decoded together' if name == 'batch' else 'positions a sequence reaches'}, "
                    f"e.g. Inference(batch=8, max_len=2048)"
                )
        if self.dtype is not None and self.dtype not in PRECISIONS:
            raise PartitionOptionError(
                f"Inference.dtype must be one of {', '.join(PRECISIONS)} or None (the model's own), got {self.dtype!r}"
            )


@dataclass(frozen=True, kw_only=True)
class Costing:
    """How the captured graph is priced: the precision it trains in, recomputation, the training
    state per parameter, measured or roofline times, the gradient buckets.

    Example:
        >>> Costing(precision="bf16", recompute=True).state_bytes_per_param
        16.0
    """

    precision: str = "fp32"
    """The mixed-precision policy the plan is costed for (and trains with by default): ``'fp32'``,
    ``'bf16'`` or ``'fp16'`` (autocast, fp32 master weights; ``partitioner.cost.precision``):
    low-precision matmuls at the 16-bit peak, activations saved and sent in half the bytes,
    training state unchanged."""

    recompute: bool | str = "auto"
    """Activation recomputation per stage (``runtime.execute.recompute``; the plan records it in
    ``StagePlan.recompute`` and the trainer follows it). ``'auto'``: only when memory binds, i.e. no
    cut fits the devices with every micro-batch's activations held: cut for recomputing stages and
    turn it on for the stages that do not fit without it (every candidate of ``'auto'`` schedules
    or micro-batches, and every layout searched, is priced that way); a plan that fits is
    unchanged. ``True``: every stage recomputes; ``False``: none."""

    state_bytes_per_param: float = 16.0
    """Bytes of weights + gradients + optimizer state per parameter element (16: fp32 Adam)."""

    profile: bool = False
    """Measure each node's time on ``profile_device`` instead of the roofline."""

    profile_device: str | torch.device | None = None
    """The device for ``profile=True`` (default: CUDA if available, else CPU)."""

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """The gradient buckets ``plan_layout`` prices the replicas' exchange in (the runtime's
    default); ``partition`` plans one pipeline, with no exchange to price."""

    inference: Inference | None = None
    """Price the plan for generation (:class:`Inference`: weights, key/value cache and decode steps)
    instead of training; ``None`` (the default) prices training. ``partition`` only: the layout
    search prices training layouts. ``recompute`` and ``state_bytes_per_param`` are not read then."""

    def __post_init__(self) -> None:
        check_precision(self.precision)
        if self.inference is not None and not isinstance(self.inference, Inference):
            raise PartitionOptionError(
                f"Costing.inference takes a partitioner.Inference or None, got {type(self.inference).__name__} "
                f"{reprlib.repr(self.inference)}: pass inference=Inference(batch=..., max_len=...)"
            )
        object.__setattr__(self, "recompute", check_option(self.recompute))


@dataclass(frozen=True, kw_only=True)
class Cut:
    """``partition``'s pipeline (its schedule and micro-batches: what each stage holds in memory)
    and how the cut is chosen.

    Example:
        >>> Cut(schedule="zbh1", microbatches=4).method
        'exact'
        >>> Cut(split_points=["h.4"]).method  # split points are a manual cut
        'manual'
    """

    schedule: str = "1f1b"
    """``'1f1b'``, ``'gpipe'``, ``'zbh1'``, ``'interleaved'`` or ``'zbv'`` (the last two place two
    stages per device); it decides how many micro-batches each stage holds. ``'auto'`` prices every
    schedule with the simulator and keeps the fastest that fits (``plan.candidates``, ``plan.choice``)."""

    microbatches: int | str = 8
    """``m``, micro-batches per optimizer step (sets activation memory in flight), or ``'auto'`` to
    try ``p, 2p, 4p, 8p``."""

    method: str = "exact"
    """``'exact'`` (optimal contiguous cut), or a baseline: ``'equal_count'``, ``'balanced_params'``,
    ``'equal_size'``; ``'manual'`` with ``split_points``."""

    refine: bool = True
    """After a contiguous cut, move boundary nodes between neighbouring stages while the bottleneck
    falls (helps DAGs whose best cut is not contiguous in one order)."""

    split_points: Sequence[str] | None = None
    """Module names where new stages begin (implies ``method='manual'``): a full name or any
    unambiguous end of one at a dot (``'h.4'`` for ``'transformer.h.4'``). A list is kept as a tuple."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "split_points", _tuple(self.split_points))
        if self.split_points is not None:
            object.__setattr__(self, "method", "manual")
        if self.method not in METHODS:
            raise PartitionOptionError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.method == "manual" and self.split_points is None:
            raise SplitPointError("method='manual' needs split_points=[module names where stages begin]")
        if self.schedule != "auto" and self.schedule not in TRAINING_SCHEDULES:
            raise PartitionOptionError(
                f"unknown schedule {self.schedule!r}; choose one of {', '.join(TRAINING_SCHEDULES)} or 'auto'"
            )
        if self.microbatches != "auto" and (type(self.microbatches) is not int or self.microbatches < 1):
            raise PartitionOptionError(  # a bool is not a count
                f"microbatches must be a positive int or 'auto', got {self.microbatches!r}: pass the "
                "micro-batches per step, e.g. microbatches=8, or 'auto' to let the planner choose"
            )

    @property
    def auto(self) -> bool:
        """Whether candidates are priced (``'auto'`` schedule or micro-batches) instead of one cut made."""
        return self.schedule == "auto" or self.microbatches == "auto"


@dataclass(frozen=True, kw_only=True)
class LayoutSpace:
    """The layouts ``plan_layout`` searches (every ``dp x pp`` of the cluster, within these) and how hard.

    Example:
        >>> LayoutSpace(zero=["none", "zero1", "fsdp"], top=3).zero
        ('none', 'zero1', 'fsdp')
    """

    schedules: Sequence[str] | None = None
    """The schedules to try (default: every training schedule)."""

    microbatch_sizes: Sequence[int] | None = None
    """The rows per micro-batch ``b`` to try (default: every divisor of ``B / dp``)."""

    zero: Sequence[str] = DEFAULT_ZERO
    """The shardings to try: ``'none'``, ``'zero1'`` (optimizer state), ``'fsdp'`` (weights, gradients
    and optimizer state: FSDP2); the last two with ``dp > 1`` only. Default ``('none', 'zero1')``:
    FSDP's time price is optimistic on CPU processes and not yet checked on GPUs, so it is tried
    only when asked for (``zero=ZERO_OPTIONS``)."""

    dp_sizes: Sequence[int] | None = None
    """The replica counts to try (default: every divisor of the devices that divides ``B``);
    ``(1,)`` plans one pipeline over every device."""

    pp_sizes: Sequence[int] | None = None
    """The pipeline rank counts to try (default: every one the devices, replicas and tp sizes leave)."""

    tp_sizes: Sequence[int] | None = None
    """The tensor-parallel sizes to try: devices per pipeline rank, a group inside one node
    (``partitioner.tensor.sizes``). ``None`` (the default): every divisor of the devices' node size
    that divides the model's attention and key/value heads (from its Hugging Face config) and the
    sizes its sharded layers split; tp 1 alone for a model without a config or devices without a
    node size (the ``cpu`` preset, a measured host). ``(1,)``: no tensor parallelism. Sizes given
    are checked against the nodes, the model's heads where known and the graph."""

    top: int = 5
    """How many layouts are ranked exactly (the rest are pruned by a lower bound)."""

    prune: bool = True
    """``False`` prices every layout whose state fits (the brute force; slow at scale)."""

    def __post_init__(self) -> None:
        unknown = [s for s in self.schedules or () if s not in TRAINING_SCHEDULES]
        if unknown:
            raise PartitionOptionError(f"unknown schedules {unknown}; choose among {', '.join(TRAINING_SCHEDULES)}")
        sizes = self.microbatch_sizes
        bad = [b for b in sizes or () if type(b) is not int or b < 1]
        if bad or (sizes is not None and not sizes):
            raise PartitionOptionError(f"microbatch_sizes must be positive ints, got {sizes!r}")
        if not self.zero or any(z not in ZERO_OPTIONS for z in self.zero):
            raise PartitionOptionError(f"zero must list some of {', '.join(ZERO_OPTIONS)}, got {list(self.zero)!r}")
        if type(self.top) is not int or self.top < 1:
            raise PartitionOptionError(f"top must be a positive int, got {self.top!r}")
        tps = self.tp_sizes
        if tps is not None and (not tps or any(type(t) is not int or t < 1 for t in tps)):
            raise PartitionOptionError(f"tp_sizes must be positive ints (e.g. (1, 2, 4, 8)), got {tps!r}")
        for name in ("dp_sizes", "pp_sizes"):
            sizes = getattr(self, name)
            if sizes is not None and (not sizes or any(type(n) is not int or n < 1 for n in sizes)):
                raise PartitionOptionError(f"{name} must be positive ints, got {sizes!r}")
        for name in ("schedules", "microbatch_sizes", "zero", "dp_sizes", "pp_sizes", "tp_sizes"):
            object.__setattr__(self, name, _tuple(getattr(self, name)))


@dataclass(frozen=True)
class PlannerOptions:
    """The option objects a planner entry point runs with, every field resolved (defaults for
    those it does not take)."""

    cut: Cut
    capture: Capture
    costing: Costing
    space: LayoutSpace


# The entry points' parameter for each option object, and the object's class.
_SECTIONS: dict[str, type[Cut] | type[Capture] | type[Costing] | type[LayoutSpace]] = {
    "cut": Cut, "capture": Capture, "costing": Costing, "space": LayoutSpace,
}

# Each entry point's keyword parameters (tests check them against its signature); those named in
# _SECTIONS take an option object, and the old keywords of those objects' fields are accepted.
ENTRY_POINTS: dict[str, tuple[str, ...]] = {
    "partition": ("num_stages", "cluster", "cut", "capture", "costing"),
    "plan_layout": ("cluster", "global_batch", "space", "capture", "costing"),
    "LayoutSearch": ("cluster", "global_batch", "capture", "costing"),
    "LayoutSearch.run": ("space",),
    "LayoutSearch.space": ("space",),
}

# Old keyword -> (parameter, field). Kept for one release, without a warning (the test suite and
# user scripts spell them; a DeprecationWarning would flood both); then removed.
SHORTCUTS: dict[str, tuple[str, str]] = {
    "schedule": ("cut", "schedule"),
    "microbatches": ("cut", "microbatches"),
    "method": ("cut", "method"),
    "refine": ("cut", "refine"),
    "split_points": ("cut", "split_points"),
    "trace_method": ("capture", "method"),
    "granularity": ("capture", "granularity"),
    "module_depth": ("capture", "module_depth"),
    "leaf_modules": ("capture", "leaf_modules"),
    "example_kwargs": ("capture", "example_kwargs"),
    "example_is": ("capture", "example_is"),
    "precision": ("costing", "precision"),
    "recompute": ("costing", "recompute"),
    "state_bytes_per_param": ("costing", "state_bytes_per_param"),
    "profile": ("costing", "profile"),
    "profile_device": ("costing", "profile_device"),
    "bucket_bytes": ("costing", "bucket_bytes"),
    "schedules": ("space", "schedules"),
    "microbatch_sizes": ("space", "microbatch_sizes"),
    "zero": ("space", "zero"),
    "dp_sizes": ("space", "dp_sizes"),
    "top": ("space", "top"),
    "prune": ("space", "prune"),
}


def resolve_options(where: str, objects: Mapping[str, Any], legacy: Mapping[str, Any]) -> PlannerOptions:
    """The option objects an entry point was given, with its old keywords put in their fields.

    Args:
        where: the entry point (a key of :data:`ENTRY_POINTS`), for the messages and for which
            objects it takes.
        objects: the entry point's option parameters by name (``{"cut": cut, ...}``), ``None``
            for the defaults.
        legacy: the old keywords it was given (:data:`SHORTCUTS`).

    Returns:
        The resolved :class:`PlannerOptions`: the objects given, else made from the old keywords
        (each checked once, as it is made), else the defaults.

    Raises:
        PlannerKeywordError: a keyword is neither a parameter of ``where`` nor an old keyword of
            an object it takes (the message suggests the closest name, or says which entry point
            takes it).
        PartitionOptionError: an old keyword was given together with the object it belongs to
            (the object alone says the whole section; the message shows how to put the value
            there), or an object is not of its type.

    Example:
        >>> opts = resolve_options("partition", {"cut": None}, {"microbatches": 4, "precision": "bf16"})
        >>> opts.cut.microbatches, opts.costing.precision, opts.capture == Capture()
        (4, 'bf16', True)
    """
    takes = [s for s in ENTRY_POINTS[where] if s in _SECTIONS]
    fields: dict[str, dict[str, Any]] = {section: {} for section in _SECTIONS}
    for key, value in legacy.items():
        if key not in SHORTCUTS or SHORTCUTS[key][0] not in takes:
            raise PlannerKeywordError(_unknown(where, key))
        section, name = SHORTCUTS[key]
        if objects.get(section) is not None:
            kind = _SECTIONS[section].__name__
            raise PartitionOptionError(
                f"{where}(): {key}={reprlib.repr(value)} is the old keyword for {section}={kind}({name}=...), and "
                f"{section}= was given too: set it there, e.g. {section}=dataclasses.replace({section}, {name}=...)"
            )
        fields[section][name] = value
    built: dict[str, Any] = {}
    for section, cls in _SECTIONS.items():
        obj = objects.get(section)
        if obj is None:
            obj = cls(**fields[section])
        elif not isinstance(obj, cls):
            raise PartitionOptionError(
                f"{where}(): {section}= takes a partitioner.{cls.__name__}, got {type(obj).__name__} "
                f"{reprlib.repr(obj)}: pass {section}={cls.__name__}(...)"
            )
        built[section] = obj
    return PlannerOptions(**built)


def _unknown(where: str, key: str) -> str:
    """The message for a keyword ``where`` does not take: who takes it, or the closest names."""
    text = f"{where}() got an unexpected keyword argument {key!r}"
    takes = ENTRY_POINTS[where]
    if key in SHORTCUTS:  # an old keyword of an object this entry point does not take
        section, _ = SHORTCUTS[key]
        others = [w for w, params in ENTRY_POINTS.items() if section in params]
        return (f"{text}: it sets {_SECTIONS[section].__name__}, which {where}() does not take "
                f"({' and '.join(f'{w}()' for w in others)} do)")
    for section in takes:
        if section in _SECTIONS and key in {f.name for f in dataclasses.fields(_SECTIONS[section])}:
            cls = _SECTIONS[section].__name__
            return f"{text}: it is a field of {cls}, pass {section}={cls}({key}=...)"
    old = [k for k, (section, _) in SHORTCUTS.items() if section in takes]
    close = difflib.get_close_matches(key, [*takes, *old], n=3)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else "."
    return (f"{text}{hint} It takes the keywords {', '.join(takes)}, and for one release the old keywords "
            f"{', '.join(old)} (partitioner.options.SHORTCUTS says where each goes)")
