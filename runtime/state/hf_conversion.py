"""A Hugging Face checkpoint seen through transformers' own conversion mapping: the model's names
as keys, each made from the checkpoint tensors ``from_pretrained`` would make it from.

transformers 5 loads many checkpoints whose keys are not the live model's names: legacy names
(GPT-NeoX's ``embed_out`` is ``lm_head``), experts stored one by one that the model keeps fused
(Mixtral's ``block_sparse_moe.experts.3.w1.weight`` goes into ``mlp.experts.gate_up_proj``),
a base model's checkpoint loaded into a ``...ForCausalLM``. It does so with a list of renamings
and converters per model (``transformers.conversion_mapping.get_model_conversion_mapping``),
matched on the checkpoint's keys. :class:`ConvertedSource` applies that same list -- transformers'
own objects and matching, not a copy of them -- to the keys alone: each model name becomes one
key of a :class:`~runtime.state.weight_sources.Source`, whose shape and dtype come from running
the converter on ``meta`` tensors of the source tensors' header shapes. So every check of
:func:`~runtime.state.weights.load_weights` (missing, unexpected, shape, dtype) runs before any
data is read, and a rank reads only the source tensors behind its own stages' names (for a
fused expert tensor, that layer's experts and nothing else).

Memory while loading: a renamed tensor is copied straight into its destination, as before. A
converted one is made whole on the host from its sources, then copied: one group's sources plus
its converted tensors at a time. Experts merged by ``MergeModulelist`` (then ``Concatenate``),
the case of every mixture-of-experts family, skip that: each expert's tensor is copied into its
slice of the destination as it is read, so the host holds one source tensor at a time.

``transformers`` is not imported here: a model is a Hugging Face one when ``transformers`` is
already imported and the model (or a submodule) is its ``PreTrainedModel``. transformers 4.x
has no conversion mapping; there the checkpoint's keys are the names.
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from runtime.state.weight_errors import WeightsSourceError
from runtime.state.weight_sources import Done, Source, TensorInfo, copy_part, local_part

__all__ = ["ConvertedSource", "KeyConversion", "hf_conversion"]

log = logging.getLogger(__name__)


@dataclass
class _Group:
    """Checkpoint keys that make model tensors together (transformers' ``param_name_to_load`` entry).

    ``converter``: a fresh copy of the transformers ``WeightConverter`` whose patterns matched
    (a key that is only renamed forms no group). ``sources``: ``(key, pattern)`` in
    transformers' order (natural sort of the keys: expert 2 before expert 10).
    """

    first: str
    converter: Any
    sources: list[tuple[str, str]] = field(default_factory=list)
    targets: dict[str, TensorInfo] = field(default_factory=dict)
    source_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # from the dry run
    shaped: bool = False  # whether ``targets`` hold the dry run's shapes and dtypes


@dataclass(frozen=True)
class KeyConversion:
    """A Hugging Face model's conversion list, and where the model sits in the module tree.

    Attributes:
        model: the ``PreTrainedModel`` (on ``meta`` is fine: only its names, shapes and config are read).
        prefix: its module path in the model given to :func:`hf_conversion`, with a dot (``''``
            for the model itself, ``'model.'`` under ``CausalLMLogits``). Model names are
            ``prefix`` + the Hugging Face model's names; the prefix is left to
            :func:`~runtime.state.weights.load_weights`'s prefix mapping.
        transforms: transformers' renamings and converters for it, in order.
    """

    model: Any
    prefix: str
    transforms: tuple[Any, ...]

    @property
    def converts(self) -> bool:
        """Whether any transform can change a key (else keys are names as they are)."""
        return bool(self.transforms)


def hf_conversion(model: nn.Module) -> KeyConversion | None:
    """The conversion ``from_pretrained`` would apply to checkpoints of ``model``, or ``None``.

    ``None`` when ``model`` holds no Hugging Face ``PreTrainedModel``, or when the installed
    transformers has no conversion mapping (4.x, where checkpoints carry the names as they are).

    Example:
        >>> hf_conversion(nn.Linear(2, 2)) is None
        True
    """
    transformers = sys.modules.get("transformers")
    if transformers is None:  # not imported: the model cannot be one of its classes
        return None
    pretrained = getattr(transformers, "PreTrainedModel", None)
    if pretrained is None:
        return None
    found = next(((name, m) for name, m in model.named_modules() if isinstance(m, pretrained)), None)
    if found is None:
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers 4.x
        return None
    name, hf = found
    return KeyConversion(hf, f"{name}." if name else "", tuple(get_model_conversion_mapping(hf)))


class ConvertedSource(Source):
    """``inner`` with the model's names as keys, each made from the checkpoint tensors transformers'
    conversion maps to it. Keys no name comes from keep their checkpoint spelling (unexpected keys).

    Use as ``with open_source(path) as src: src = ConvertedSource(src, conversion)``; closing is the inner source's.
    """

    def __init__(self, inner: Source, conversion: KeyConversion) -> None:
        super().__init__(inner.path)
        self.inner = inner
        self.kind = inner.kind
        self.conversion = conversion
        self.touched = inner.touched  # the same list: files opened through either
        self._groups, self._plain, self._unmatched = _plan(conversion, inner.keys())
        self._key_group = {t: g for g in self._groups for t in g.targets}

    @property
    def renamed(self) -> int:
        """How many checkpoint keys reach the model under another name, or through a converter."""
        return sum(len(g.sources) for g in self._groups) + sum(1 for n, k in self._plain.items() if n != k)

    def keys(self) -> Sequence[str]:
        return [*self._plain, *self._key_group, *self._unmatched]

    def source_keys(self, key: str) -> list[str]:
        """The checkpoint keys ``key`` is made from."""
        if key in self._plain:
            return [self._plain[key]]
        if key in self._key_group:
            return [k for k, _ in self._key_group[key].sources]
        return [key]

    def file_of(self, key: str) -> str:
        files = dict.fromkeys(self.inner.file_of(k) for k in self.source_keys(key))
        return ", ".join(files)

    def info(self, keys: Iterable[str]) -> dict[str, TensorInfo]:
        keys = list(keys)
        plain = {k: self._plain.get(k, k) for k in keys if k not in self._key_group}
        inner = self.inner.info(plain.values()) if plain else {}
        out = {k: inner[src] for k, src in plain.items()}
        for group in {id(g): g for g in (self._key_group[k] for k in keys if k in self._key_group)}.values():
            self._dry_run(group)
        out.update({k: self._key_group[k].targets[k] for k in keys if k in self._key_group})
        return out

    def read(self, plan: Mapping[str, Sequence[torch.Tensor]], done: Done) -> int:
        by_source = {self._plain.get(k, k): dests for k, dests in plan.items() if k not in self._key_group}
        name_of = {self._plain.get(k, k): k for k in plan if k not in self._key_group}
        nbytes = self.inner.read(by_source, lambda src: done(name_of[src])) if by_source else 0
        groups = {id(g): g for g in (self._key_group[k] for k in plan if k in self._key_group)}
        for group in groups.values():
            wanted = {t: plan[t] for t in group.targets if t in plan}
            nbytes += self._read_group(group, wanted, done)
        return nbytes

    def describe(self) -> str:
        return self.inner.describe()

    # --- converter groups ------------------------------------------------------------------------

    def _dry_run(self, group: _Group) -> None:
        """Fill ``group.targets``' shapes and dtypes by converting ``meta`` tensors of the sources' shapes."""
        if group.shaped:
            return
        infos = self.inner.info([k for k, _ in group.sources])

        def meta(key: str) -> torch.Tensor:
            info = infos[key]
            if not isinstance(info.dtype, torch.dtype):
                raise WeightsSourceError(
                    f"{key!r} in {info.files[0]} has dtype {info.dtype}, which torch cannot hold, and it must be "
                    f"converted into {group.first!r}; convert the checkpoint to a torch dtype first",
                    source=str(self.path),
                )
            return torch.empty(info.shape, dtype=info.dtype, device="meta")

        out = self._convert(group, meta)
        if set(out) != set(group.targets):
            raise WeightsSourceError(
                f"transformers' converter for {group.first!r} ({group.converter}) makes {sorted(out)}, not the names "
                f"its patterns give ({sorted(group.targets)}); pipecut cannot load this checkpoint per stage: load it "
                "with from_pretrained and save it again with save_pretrained(..., ) into names the model has",
                source=str(self.path),
            )
        files = tuple(dict.fromkeys(f for k, _ in group.sources for f in infos[k].files))
        group.targets = {t: TensorInfo(tuple(v.shape), v.dtype, files) for t, v in out.items()}
        group.source_shapes = {k: infos[k].shape for k, _ in group.sources}
        group.shaped = True

    def _convert(self, group: _Group, read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the group's converter on its sources as ``read`` gives them (meta or real)."""
        converter = copy.deepcopy(group.converter)
        for key, pattern in group.sources:
            converter.add_tensor(group.first, key, pattern, _bound(read, key))
        hf = self.conversion.model
        out = converter.convert(group.first, model=hf, config=hf.config)
        return {t: (v[0] if isinstance(v, list) else v) for t, v in out.items()}

    def _read_group(self, group: _Group, wanted: Mapping[str, Sequence[torch.Tensor]], done: Done) -> int:
        # A converted tensor is made from whole sources: a shard (a DTensor) takes its part of a
        # whole buffer once the group is converted, and only then is the target done.
        shards: list[tuple[torch.Tensor, torch.Tensor]] = []
        into: dict[str, list[torch.Tensor]] = {}
        for target, dests in wanted.items():
            for dest in dests:
                if local_part(dest)[1] is not None:
                    shards.append((dest, torch.empty(dest.shape, dtype=dest.dtype)))
                    dest = shards[-1][1]
                into.setdefault(target, []).append(dest)
        nbytes = self._read_whole(group, into)
        for dest, whole in shards:
            copy_part(dest, whole)
        for target in wanted:
            done(target)
        return nbytes

    def _read_whole(self, group: _Group, wanted: Mapping[str, Sequence[torch.Tensor]]) -> int:
        nbytes = 0
        slices = _merged_slices(group, wanted)
        if slices is not None:  # experts merged: each source straight into its slice of the destination
            for key, views in slices.items():
                tensor = self.inner.get(key)
                nbytes += tensor.numel() * tensor.element_size()
                for view in views:
                    view.copy_(tensor)
                del tensor
            return nbytes

        def read(key: str) -> torch.Tensor:
            nonlocal nbytes
            tensor = self.inner.get(key)
            nbytes += tensor.numel() * tensor.element_size()
            return tensor

        out = self._convert(group, read)
        for target, dests in wanted.items():
            for dest in dests:
                dest.copy_(out[target])
        return nbytes


def _bound(read: Callable[[str], torch.Tensor], key: str) -> Callable[[], torch.Tensor]:
    """``lambda: read(key)``, bound now (transformers calls each collected callable once, in order)."""
    return lambda: read(key)


def _merged_slices(group: _Group, wanted: Mapping[str, Sequence[torch.Tensor]]) -> dict[str, list[torch.Tensor]] | None:
    """For a converter that is ``MergeModulelist(d0)`` or ``MergeModulelist(d0), Concatenate(d1)``
    into one target: each source key -> its slices of the destinations; else ``None``.

    Pattern ``j``'s experts, stacked along ``d0``, occupy the ``j``-th block along ``d1`` of
    the target (blocks in the converter's pattern order, each as wide as that pattern's tensors);
    expert ``i`` is index ``i`` along ``d0`` of its block.
    """
    conv = group.converter
    if not group.shaped:
        return None
    ops = [type(op).__name__ for op in getattr(conv, "operations", [])]
    if ops not in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]) or len(group.targets) != 1:
        return None
    if getattr(conv, "quantization_operation", None) is not None or not wanted:
        return None
    d0 = conv.operations[0].dim
    d1 = conv.operations[1].dim if len(ops) == 2 else None
    (target,) = group.targets
    dests = wanted.get(target, [])
    by_pattern: dict[str, list[str]] = {}
    for key, pattern in group.sources:
        by_pattern.setdefault(pattern, []).append(key)
    patterns = [p for p in conv.source_patterns if p in by_pattern]
    if d1 is None and len(patterns) != 1:
        return None
    out: dict[str, list[torch.Tensor]] = {k: [] for k, _ in group.sources}
    for dest in dests:
        offset = 0
        for pattern in patterns:
            keys = by_pattern[pattern]
            block = dest
            if d1 is not None:
                # Pattern j's experts stacked along d0: its sources' shape with the expert count
                # put in at d0; Concatenate's d1 counts in that stacked shape.
                stacked = list(group.source_shapes[keys[0]])
                stacked.insert(d0, len(keys))
                width = stacked[d1]
                block = dest.narrow(d1, offset, width)
                offset += width
            if block.shape[d0] != len(keys):
                return None
            for i, key in enumerate(keys):
                out[key].append(block.select(d0, i))
    return out


def _plan(
    conv: KeyConversion, keys: Sequence[str]
) -> tuple[list[_Group], dict[str, str], list[str]]:
    """transformers' key matching (``convert_and_load_state_dict_in_model``'s first loop) on keys alone.

    Returns the converter groups, the plain ones (model name -> checkpoint key) and the keys that
    reach no name of the model (left as they are, for the unexpected-key check).
    """
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    hf = conv.model
    names = dict.fromkeys(hf.state_dict(keep_vars=True), True)
    renamings = [t for t in conv.transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in conv.transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = hf.base_model_prefix
    groups: dict[str, _Group] = {}
    plain: dict[str, str] = {}
    unmatched: list[str] = []
    for key in sorted(keys, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, names)
        if renamed not in names and key in names:  # a name as it is, which a renaming would spoil
            renamed, pattern = rename_source_key(key, [], [], prefix, names)
        if renamed not in names:
            unmatched.append(key)
        elif pattern is not None:
            group = groups.setdefault(renamed, _Group(renamed, copy.deepcopy(by_pattern[pattern])))
            group.sources.append((key, pattern))
        elif renamed in plain:
            log.info("checkpoint keys %r and %r both map to %r; reading the first, as transformers does",
                     plain[renamed], key, renamed)
            unmatched.append(key)
        else:
            plain[renamed] = key
    # Targets: the first name, until the dry run (on demand: only for the groups a rank reads) gives all.
    out = list(groups.values())
    for group in out:
        group.targets = {group.first: TensorInfo((), "", ())}
        extra = _other_targets(group)
        for t in extra:
            group.targets.setdefault(t, TensorInfo((), "", ()))
    return out, plain, unmatched


def _other_targets(group: _Group) -> list[str]:
    """The names a one-to-many converter makes besides its first (``qkv`` -> ``q``, ``k``, ``v``)."""
    patterns = list(getattr(group.converter, "target_patterns", []))
    if len(patterns) < 2 or patterns[0] not in group.first:
        return []
    return [group.first.replace(patterns[0], p, 1) for p in patterns[1:]]


def checkpoint_names(
    tensors: Mapping[str, torch.Tensor], model: nn.Module, *, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """``tensors`` (the Hugging Face model's names, ``prefix`` already removed) under the keys
    ``save_pretrained`` would write for ``model``: transformers' conversion reversed
    (``revert_weight_conversion``), so that the folder loads in transformers 5 and, for families
    that existed then, has the key layout of 4.x (experts one by one, legacy names).

    Tensors a reversed converter makes (experts split out of a fused tensor) are copies of their
    own, since safetensors stores no two tensors sharing memory: the host holds those copies
    beside the fused tensors until they are written. Without a conversion (not a Hugging Face
    model, transformers 4.x, another ``prefix`` than the model's place), ``tensors`` as they are.

    Example:
        >>> w = torch.ones(2)
        >>> checkpoint_names({"w": w}, nn.Linear(2, 2))["w"] is w
        True
    """
    conv = hf_conversion(model)
    if conv is None or not conv.converts or conv.prefix != prefix:
        return dict(tensors)
    from transformers.core_model_loading import revert_weight_conversion

    out: dict[str, torch.Tensor] = revert_weight_conversion(conv.model, dict(tensors))
    for key, t in out.items():
        whole = t.is_contiguous() and t.storage_offset() == 0 and \
            t.untyped_storage().nbytes() == t.numel() * t.element_size()
        if not whole:  # a view into a fused tensor: a tensor of its own for safetensors
            out[key] = t.clone(memory_format=torch.contiguous_format)
    return out
