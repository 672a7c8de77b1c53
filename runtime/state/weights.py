"""Loading pretrained weights per pipeline stage: a rank copies only its stages' tensors out of a
checkpoint, after checking every name, shape and dtype against the checkpoint's headers.

A *name* is the model's fully qualified name of a tensor (``model.state_dict()``'s key, which is
what stage modules use), a *key* the checkpoint's; ``s`` is a stage. Names become keys through a
:class:`PrefixMap` (``CausalLMLogits(model)`` names ``model.model.layers.0...``, the Hugging Face
checkpoint ``model.layers.0...``), given or detected, and through tied names (``aliases``), since
a checkpoint may store a tied tensor under any one of its names.

Memory: the caller allocates the destinations (on their devices); a load adds one checkpoint
tensor at a time on the host (safetensors and DCP read one tensor; a torch file is mapped).
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
import os
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from runtime.state.hf_conversion import ConvertedSource, hf_conversion
from runtime.state.weight_errors import (
    AmbiguousPrefixError,
    MissingWeightsError,
    NonFiniteWeightsError,
    PartialLoadError,
    UnexpectedWeightsError,
    WeightDtypeError,
    WeightProblem,
    WeightsDestinationError,
    WeightsError,
    WeightShapeError,
    listing,
    names_listing,
)
from runtime.state.weight_sources import Source, TensorInfo, local_part, open_source

__all__ = [
    "LoadReport", "PrefixMap", "TensorInfo", "Weights", "checkpoint_index", "detect_prefix", "load_weights",
    "stage_tensors",
]

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
# name -> every name of its tensor: a mapping, or the (name, names) pairs of ``plan.param_aliases``.
Aliases = Mapping[str, Sequence[str]] | Iterable[tuple[str, Sequence[str]]]


@dataclass(frozen=True)
class PrefixMap:
    """How the model's names and the checkpoint's keys differ: ``model + rest`` is ``checkpoint + rest``.

    ``PrefixMap("model.")`` loads the checkpoint key ``lm_head.weight`` into the name
    ``model.lm_head.weight`` (a wrapped model); ``PrefixMap(checkpoint="model.")`` the reverse.

    Example:
        >>> m = PrefixMap("model.")
        >>> m.to_key("model.lm_head.weight"), m.to_name("lm_head.weight"), m.to_key("other")
        ('lm_head.weight', 'model.lm_head.weight', None)
    """

    model: str = ""
    checkpoint: str = ""

    def to_key(self, name: str) -> str | None:
        """The checkpoint key of model name ``name``; ``None`` if it lacks the model prefix."""
        return self.checkpoint + name[len(self.model):] if name.startswith(self.model) else None

    def to_name(self, key: str) -> str | None:
        """The model name of checkpoint key ``key``; ``None`` if it lacks the checkpoint prefix."""
        return self.model + key[len(self.checkpoint):] if key.startswith(self.checkpoint) else None

    def __str__(self) -> str:
        if not self.model and not self.checkpoint:
            return "model names = checkpoint keys"
        if not self.checkpoint:
            return f"model names = {self.model!r} + checkpoint key"
        if not self.model:
            return f"checkpoint keys = {self.checkpoint!r} + model name"
        return f"model {self.model!r} + rest = checkpoint {self.checkpoint!r} + rest"


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_weights` did.

    Attributes:
        source: the checkpoint as given; ``kind`` its layout.
        names: the destinations filled, by model name.
        bytes_read: bytes of checkpoint data read (tied names read once).
        seconds: wall time, checks included.
        files: the files opened (headers included), in order.
        prefix: the name mapping used; ``detected`` whether it was found rather than given.
        ignored: checkpoint keys no model name maps to, skipped under ``strict=False``.
        cast: names whose dtype was converted under ``cast=True``.
        converted: checkpoint keys transformers' conversion mapping renamed or merged
            (:mod:`runtime.state.hf_conversion`; 0 when none applied).
    """

    source: str
    kind: str
    names: tuple[str, ...]
    bytes_read: int
    seconds: float
    files: tuple[str, ...]
    prefix: PrefixMap
    detected: bool = False
    ignored: tuple[str, ...] = ()
    cast: tuple[str, ...] = ()
    converted: int = 0

    def __str__(self) -> str:
        extra = f"; {len(self.ignored)} unexpected keys ignored" if self.ignored else ""
        extra += f"; {len(self.cast)} converted to the destination dtype" if self.cast else ""
        extra += f"; {self.converted} keys renamed or merged as from_pretrained does" if self.converted else ""
        how = "detected" if self.detected else "given"
        return (
            f"loaded {len(self.names)} tensors ({_size(self.bytes_read)}) from {len(self.files)} file(s) of "
            f"{self.source} ({self.kind}) in {self.seconds:.2f} s; {self.prefix} ({how}){extra}"
        )


def checkpoint_index(source: PathLike) -> dict[str, TensorInfo]:
    """Every tensor key of a checkpoint with its shape, dtype and file, from headers alone.

    Sharded safetensors checkpoints open every shard's header (no data); use it for tests and
    tooling, not per rank.

    Args:
        source: a ``.safetensors`` file, a ``model.safetensors.index.json``, a directory holding
            either or a torch.distributed.checkpoint, or a ``torch.save`` file.

    Raises:
        WeightsSourceError: the source cannot be read.

    Example:
        >>> import tempfile, safetensors.torch
        >>> path = tempfile.mkdtemp() + "/model.safetensors"
        >>> safetensors.torch.save_file({"w": torch.zeros(2, 3)}, path)
        >>> info = checkpoint_index(path)["w"]
        >>> info.shape, info.dtype, info.nbytes
        ((2, 3), torch.float32, 24)
    """
    with open_source(source) as src:
        return src.info(src.keys())


def stage_tensors(stages: Mapping[int, torch.nn.Module]) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The tensors a checkpoint holds for these stages, by every name (their ``state_dict``
    entries; a weight copied to several stages of one process: the lowest stage's copy), and
    each name's stage."""
    into: dict[str, torch.Tensor] = {}
    stage_of: dict[str, int] = {}
    for s in sorted(stages):
        for name, t in stages[s].state_dict(keep_vars=True).items():
            into.setdefault(name, t)
            stage_of.setdefault(name, s)
    return into, stage_of


@dataclass(frozen=True)
class Weights:
    """A checkpoint to load a trainer's stages from, with :func:`load_weights`'s options.

    ``PipelineTrainer(plan, ..., weights=Weights("ckpt/", cast=True))``; a plain path means the
    defaults.
    """

    source: PathLike
    prefix: str | PrefixMap | None = None
    cast: bool = False
    strict: bool = True
    allow_nonfinite: tuple[str, ...] = ()


def load_weights(
    source: PathLike,
    into: Mapping[str, torch.Tensor],
    *,
    names: Collection[str],
    aliases: Aliases | None = None,
    stage_of: Mapping[str, int] | None = None,
    prefix: str | PrefixMap | None = None,
    cast: bool = False,
    strict: bool = True,
    model: torch.nn.Module | None = None,
    allow_nonfinite: Collection[str] = (),
) -> LoadReport:
    """Copy a checkpoint's tensors into this rank's destinations, in place, reading only those.

    Every destination is checked first: its key must exist (under the prefix mapping, under any
    of its tied names), with the destination's shape and dtype; and every checkpoint key must map
    to some name of the whole model. Only then is data read, one tensor at a time, under
    ``torch.no_grad``. Every rank decides the same mapping and the same unexpected keys, since
    both follow from ``names`` (the whole model's) and the checkpoint's index or headers.

    Args:
        source: a ``.safetensors`` file, a ``model.safetensors.index.json``, a directory holding
            either or a torch.distributed.checkpoint (``.metadata``), or a ``torch.save`` file.
        into: model name -> destination tensor, allocated on its device (not ``meta``); e.g. a
            rank's ``{n: t for stage in my_stages for n, t in stage.state_dict().items()}``.
        names: every name of the whole model (all ranks' stages), for the unexpected-key check
            and prefix detection.
        aliases: name -> every name of the same tensor (tied weights); a mapping, or
            ``plan.param_aliases`` as it is.
        stage_of: name -> stage, for messages.
        prefix: how names and keys differ: a string (model names = prefix + key), a
            :class:`PrefixMap`, or ``None`` to detect it (:func:`detect_prefix`).
        cast: convert checkpoint dtypes to the destinations'; else a difference is an error.
        strict: refuse checkpoint keys no model name maps to; ``False`` skips them (they are in
            the report). Missing keys are always an error: a weight left uninitialised trains garbage.
        model: the whole model (on ``meta`` is fine). A Hugging Face model's checkpoint keys are
            then mapped to its names as ``from_pretrained`` maps them, with transformers' own
            conversion list (legacy names, experts stored one by one into the fused tensor):
            :mod:`runtime.state.hf_conversion`.
        allow_nonfinite: model names (``fnmatch`` patterns) that may hold NaN or infinity; every
            other floating tensor is checked as it loads.

    Returns:
        What was loaded, from which files, how many bytes, how long; also logged at INFO.

    Raises:
        WeightsDestinationError: a destination is on ``meta``, not a tensor, or not in ``names``.
        AmbiguousPrefixError: ``prefix=None`` and several mappings match equally many names.
        MissingWeightsError: a destination's key is not in the checkpoint (close keys listed).
        UnexpectedWeightsError: a checkpoint key maps to no name of the model (``strict``).
        WeightShapeError: shapes differ.
        WeightDtypeError: dtypes differ and ``cast=False``.
        NonFiniteWeightsError: a loaded tensor holds NaN or infinity (names and files listed; the
            destinations were written).
        WeightsSourceError: the checkpoint, a shard or the index cannot be read.
        UnsafeFileError: a torch.distributed.checkpoint's ``.metadata`` would import a class or
            function such a checkpoint never holds (nothing of it ran).
        PartialLoadError: reading failed midway; the message says which destinations are filled.

    Example:
        >>> import tempfile, safetensors.torch
        >>> path = tempfile.mkdtemp() + "/model.safetensors"
        >>> safetensors.torch.save_file({"0.weight": torch.ones(2, 2), "1.weight": torch.ones(2, 2)}, path)
        >>> mine = {"model.1.weight": torch.zeros(2, 2)}    # this rank holds stage 1 only
        >>> report = load_weights(path, mine, names=["model.0.weight", "model.1.weight"])
        >>> report.names, str(report.prefix), mine["model.1.weight"].sum().item()
        (('model.1.weight',), "model names = 'model.' + checkpoint key", 4.0)
    """
    start = time.perf_counter()
    stage_of = stage_of or {}
    groups = _groups(names, aliases or {})
    _check_destinations(into, groups, stage_of, str(source))
    conversion = hf_conversion(model) if model is not None else None
    with open_source(source) as opened:
        src: Source = ConvertedSource(opened, conversion) if conversion is not None and conversion.converts else opened
        keys = set(src.keys())
        detected = prefix is None
        mapping = (
            _detect(groups, keys, str(source)) if prefix is None
            else PrefixMap(prefix) if isinstance(prefix, str) else prefix
        )
        plan, ignored, converted = _check(src, into, groups, keys, mapping, stage_of, cast, strict)
        loaded: list[str] = []
        key_names: dict[str, list[str]] = {}
        for name, key in plan.items():
            key_names.setdefault(key, []).append(name)
        by_key = {key: [into[n] for n in ns] for key, ns in key_names.items()}
        nonfinite: list[WeightProblem] = []

        def done(key: str) -> None:
            loaded.extend(key_names[key])
            first = local_part(by_key[key][0])[0]  # a shard: the part this rank read
            if first.is_floating_point() and not any(fnmatch.fnmatchcase(n, p) for n in key_names[key]
                                                     for p in allow_nonfinite):
                bad = _nonfinite(first)
                if bad:
                    nonfinite.append(WeightProblem(key_names[key][0], key, stage_of.get(key_names[key][0]),
                                                   src.file_of(key), "finite values",
                                                   f"{bad} of {first.numel()} NaN or infinite"))

        try:
            with torch.no_grad():
                nbytes = src.read(by_key, done)
        except Exception as e:
            filled = set(loaded)
            pending = [n for n in plan if n not in filled]
            raise PartialLoadError(
                f"reading {src.describe()} failed after {len(loaded)} of {len(plan)} destinations "
                f"were filled: {type(e).__name__}: {e}\n  filled: {names_listing(loaded) or 'none'}\n"
                f"  not filled (old or partly new values): {names_listing(pending)}\n"
                "Fix the file (disk, permissions, a truncated download) and call load_weights again: "
                "it overwrites every destination, so a second run completes the load.",
                source=str(source), loaded=loaded, pending=pending,
            ) from e
        if nonfinite:
            raise NonFiniteWeightsError(
                f"{len(nonfinite)} weight(s) of {src.describe()} hold NaN or infinity:\n{listing(nonfinite)}\n"
                "Fix: the checkpoint is damaged or was saved from a diverged run: load an earlier or "
                "re-downloaded one. If the model stores such values on purpose (a mask of -inf), name those "
                "tensors in allow_nonfinite= (Weights(path, allow_nonfinite=('*.attn.masked_bias',)); "
                "pipecut train --allow-nonfinite-weights NAME).",
                source=str(source), problems=nonfinite,
            )
        report = LoadReport(
            source=str(source), kind=src.kind, names=tuple(loaded), bytes_read=nbytes,
            seconds=time.perf_counter() - start, files=tuple(src.touched), prefix=mapping,
            detected=detected, ignored=tuple(ignored), cast=tuple(converted),
            converted=src.renamed if isinstance(src, ConvertedSource) else 0,
        )
    logger.info("%s", report)
    return report


def detect_prefix(
    names: Collection[str],
    keys: Collection[str],
    *,
    aliases: Aliases | None = None,
    source: str = "",
) -> PrefixMap:
    """The prefix to add to or strip from checkpoint keys that makes the most model names match.

    Candidates are the identity and every dotted prefix whose removal from a name gives a key
    (``PrefixMap(model=p)``) or from a key gives a name (``PrefixMap(checkpoint=p)``). A name
    counts as matched when any of its tied names does. Only ``names`` and ``keys`` decide, so
    every rank of a job picks the same mapping.

    Args:
        names: every name of the whole model.
        keys: the checkpoint's keys (``checkpoint_index(source).keys()``).
        aliases: name -> every name of the same tensor (tied weights), as in :func:`load_weights`.
        source: the checkpoint, for messages.

    Returns:
        The best mapping; the identity when nothing matches (the missing-key error then shows
        close keys).

    Raises:
        AmbiguousPrefixError: several mappings match the same, highest, number of names.

    Example:
        >>> detect_prefix(["model.model.embed.weight"], ["model.embed.weight"])
        PrefixMap(model='model.', checkpoint='')
        >>> detect_prefix(["embed.weight"], ["model.embed.weight"])
        PrefixMap(model='', checkpoint='model.')
    """
    return _detect(_groups(names, aliases or {}), keys, source)


def _detect(groups: Mapping[str, tuple[str, ...]], keys: Collection[str], source: str) -> PrefixMap:
    keyset, nameset = set(keys), set(groups)
    matches: dict[str, set[PrefixMap]] = {}
    for name in groups:
        for p in _dotted_prefixes(name, with_empty=True):
            if name[len(p):] in keyset:
                matches.setdefault(name, set()).add(PrefixMap(model=p))
    for key in keyset:
        for p in _dotted_prefixes(key, with_empty=False):
            if key[len(p):] in nameset:
                matches.setdefault(key[len(p):], set()).add(PrefixMap(checkpoint=p))
    score: dict[PrefixMap, int] = {}
    for group in groups.values():
        for m in set().union(*(matches.get(g, set()) for g in group)):
            score[m] = score.get(m, 0) + 1
    if not score:
        return PrefixMap()
    best = max(score.values())
    tied = sorted((m for m, n in score.items() if n == best), key=lambda m: (m.model, m.checkpoint))
    if len(tied) > 1:
        options = "; ".join(f"prefix={_repr_prefix(m)} ({m})" for m in tied[:5])
        raise AmbiguousPrefixError(
            f"cannot tell how the model's names map to the keys of {source or 'the checkpoint'}: "
            f"{len(tied)} mappings each match {best} of {len(groups)} names: {options}. "
            "Pass the right one to load_weights(prefix=...) (prefix='' for names as they are)",
            source=source, candidates=[(m, best) for m in tied],
        )
    return tied[0]


# --- checks --------------------------------------------------------------------------------------


def _groups(names: Collection[str], aliases: Aliases) -> dict[str, tuple[str, ...]]:
    """Every model name -> all names of its tensor, itself first."""
    together: dict[str, list[str]] = {n: [n] for n in names}
    for name, group in aliases.items() if isinstance(aliases, Mapping) else aliases:
        members = [name, *group]
        merged: list[str] = []
        for m in members:
            for other in together.get(m, [m]):
                if other not in merged:
                    merged.append(other)
        for m in merged:
            together[m] = merged
    return {n: (n, *(g for g in group if g != n)) for n, group in together.items()}


def _check_destinations(
    into: Mapping[str, torch.Tensor], groups: Mapping[str, tuple[str, ...]], stage_of: Mapping[str, int],
    source: str,
) -> None:
    def problem(name: str) -> WeightProblem:
        return WeightProblem(name, name, stage_of.get(name))

    bad = [n for n, t in into.items() if not isinstance(t, torch.Tensor)]
    if bad:
        raise WeightsDestinationError(
            f"destinations must be tensors; not tensors: {names_listing(bad)}. Pass name -> tensor, "
            "e.g. dict(stage_module.state_dict())",
            source=source, problems=[problem(n) for n in bad],
        )
    meta = [n for n, t in into.items() if t.device.type == "meta"]
    if meta:
        raise WeightsDestinationError(
            f"{len(meta)} destinations are on the meta device, which holds no data: "
            f"{names_listing(meta)}. Allocate the stage on its device first, e.g. "
            "stage.to_empty(device='cuda:0'), then load into stage.state_dict()",
            source=source, problems=[problem(n) for n in meta],
        )
    unknown = [n for n in into if n not in groups]
    if unknown:
        raise WeightsDestinationError(
            f"destinations not among the model's names: {names_listing(unknown)}. names= must list "
            "every name of the whole model (all stages): list(model.state_dict()) of the "
            "unpartitioned model (on meta is fine); the destinations must use those original names",
            source=source, problems=[problem(n) for n in unknown],
        )


def _check(
    src: Source, into: Mapping[str, torch.Tensor], groups: Mapping[str, tuple[str, ...]], keys: set[str],
    mapping: PrefixMap, stage_of: Mapping[str, int], cast: bool, strict: bool,
) -> tuple[dict[str, str], list[str], list[str]]:
    """Name -> key for every destination, after checking names, shapes and dtypes; raises the
    first kind of problem found (missing, unexpected, shape, dtype), noting the others."""
    where = src.describe()
    plan: dict[str, str] = {}
    missing: list[WeightProblem] = []
    for name in into:
        found = [k for k in (mapping.to_key(g) for g in groups[name]) if k is not None and k in keys]
        if found:
            plan[name] = found[0]
        else:
            wanted = mapping.to_key(name) or name
            close = tuple(difflib.get_close_matches(wanted, keys, n=3, cutoff=0.6)) if len(missing) < 32 else ()
            missing.append(WeightProblem(name, wanted, stage_of.get(name), None, close=close))
    unexpected = sorted(k for k in keys if (n := mapping.to_name(k)) is None or n not in groups)
    unexpected_problems = [WeightProblem(None, k, None, src.file_of(k)) for k in unexpected]
    infos = src.info(sorted(set(plan.values()), key=lambda k: (src.file_of(k), k)))
    shapes: list[WeightProblem] = []
    dtypes: list[WeightProblem] = []
    converted: list[str] = []
    for name, key in plan.items():
        dest, info = into[name], infos[key]
        file = ", ".join(info.files)
        if tuple(dest.shape) != info.shape:
            shapes.append(WeightProblem(name, key, stage_of.get(name), file,
                                        f"shape {tuple(dest.shape)}", f"shape {info.shape}"))
        if dest.dtype != info.dtype:
            if cast and isinstance(info.dtype, torch.dtype):
                converted.append(name)
            else:
                dtypes.append(WeightProblem(name, key, stage_of.get(name), file, str(dest.dtype), str(info.dtype)))
    problems = {
        "missing": missing, "unexpected": unexpected_problems if strict else [], "shape": shapes, "dtype": dtypes,
    }
    counts = {kind: len(ps) for kind, ps in problems.items() if ps}
    if counts:
        first = next(iter(counts))
        label = {"missing": "missing keys", "unexpected": "unexpected keys", "shape": "shape mismatches",
                 "dtype": "dtype mismatches"}
        others = ", ".join(f"{n} {label[k]}" for k, n in counts.items() if k != first)
        also = f"\nAlso found: {others} (fix the above first)." if others else ""
        raise _error(first, problems[first], where, mapping, also, str(src.path))
    if unexpected:
        logger.info("ignoring %d checkpoint keys no model name maps to (strict=False): %s",
                    len(unexpected), names_listing(unexpected))
    return plan, unexpected, converted


def _error(
    kind: str, problems: list[WeightProblem], where: str, mapping: PrefixMap, also: str, source: str,
) -> WeightsError:
    n = len(problems)
    error: type[WeightsError]
    if kind == "missing":
        error = MissingWeightsError
        text = (
            f"{n} of this rank's weights are missing from {where}; name mapping: {mapping}:\n{listing(problems)}\n"
            "Fix: load the checkpoint made for this model (same config: layer count, names); if the "
            "names differ by a prefix pass prefix= (e.g. prefix='model.' for CausalLMLogits(model) and a "
            "Hugging Face checkpoint); for tied weights stored under another name pass "
            "aliases=plan.param_aliases; drop from `into` what you initialise yourself. From the command "
            "line (pipecut train --model FOLDER), the folder's weights do not match its config.json and "
            "transformers knows no conversion for them: check they belong to that config, or load the folder "
            "with transformers' AutoModelForCausalLM.from_pretrained and save_pretrained it into a new folder "
            "to train from."
        )
    elif kind == "unexpected":
        error = UnexpectedWeightsError
        text = (
            f"{n} keys of {where} map to no name of the model; name mapping: {mapping}:\n{listing(problems)}\n"
            "Fix: if they are buffers the model recomputes or does not save (rotary_emb.inv_freq, "
            "attention masks, position ids) or state of something else (optimizer), pass strict=False "
            "to skip them; otherwise the checkpoint is of another model (compare configs), names= lacks "
            "some of the model's names, or the names need prefix=."
        )
    elif kind == "shape":
        error = WeightShapeError
        text = (
            f"{n} weight(s) have another shape in {where}:\n{listing(problems)}\n"
            "Fix: build the model from the checkpoint's config (sizes such as hidden size, vocabulary, "
            "heads or intermediate size differ), or load the checkpoint of this configuration."
        )
    else:
        dtypes = sorted({p.found for p in problems})
        unknown = [d for d in dtypes if not d.startswith("torch.")]
        unknown_note = f" torch has no dtype for {', '.join(unknown)}, so those cannot be converted." if unknown else ""
        error = WeightDtypeError
        text = (
            f"{n} weight(s) have another dtype in {where}:\n{listing(problems)}\n"
            f"Fix: pass cast=True to convert while copying, or build the model in the checkpoint's dtype "
            f"({', '.join(dtypes)}; e.g. model.to(dtype) before partitioning).{unknown_note}"
        )
    return error(text + also, source=source, problems=problems)


# Elements per piece when NaN and infinities are counted: temporaries of ~9 bytes each (the mask, its
# int64 sum), so ~0.6 MiB whatever the tensor's size.
_NONFINITE_PIECE = 1 << 16


def _nonfinite(t: torch.Tensor) -> int:
    """How many elements of floating ``t`` are NaN or infinite, in a few bytes beside ``t``.

    A finite sum means every element is finite (a NaN or an infinity makes the sum NaN or
    infinite), and the sum allocates only its result: the check costs one pass and no copy. Only
    when the sum is not finite (a bad value, or finite values summing past the dtype's range) are
    elements counted, piece by piece: ``(~isfinite(t)).sum()`` over the whole tensor would hold a
    bool mask and its int64 copy, 9 bytes per element (2.25 x a float32 tensor, 4.5 x a bf16 one),
    while a load promises one checkpoint tensor at a time on the host.

    Example:
        >>> _nonfinite(torch.tensor([1.0, float("nan"), float("inf")]))
        2
    """
    if bool(torch.isfinite(t.sum())):
        return 0
    flat = t.reshape(-1)  # a view: destinations are contiguous (a copy otherwise, still correct)
    return sum(int((~torch.isfinite(piece)).sum()) for piece in flat.split(_NONFINITE_PIECE))


def _dotted_prefixes(name: str, *, with_empty: bool) -> list[str]:
    """``'a.b.c'`` -> ``['', 'a.', 'a.b.']``: the prefixes that end at a dot."""
    parts = name.split(".")
    out = [".".join(parts[:i]) + "." for i in range(1, len(parts))]
    return ["", *out] if with_empty else out


def _repr_prefix(m: PrefixMap) -> str:
    return repr(m.model) if not m.checkpoint else f"PrefixMap(model={m.model!r}, checkpoint={m.checkpoint!r})"


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
