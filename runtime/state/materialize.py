"""Give a rank real tensors for its stages only, from a model built on ``meta``.

Legend: ``s`` a stage index. A *meta* tensor has a shape and dtype but no memory.

The path for models too big for one device: build the model under :func:`empty_weights`
(parameters on ``meta``, buffers real), plan it, and let each rank's trainer call
:func:`materialize` for the stages it runs. For every meta tensor those stages hold, it
allocates an empty tensor on the rank's device and installs it, under every name it has, in the
stage modules and in the original model; then it initialises the modules that own those
tensors. Tensors of other ranks' stages stay on ``meta``: a rank never allocates them.

Initialisation, per owning module, in this order of preference: the user's
``init_fn(name, module)``; the Hugging Face model's own ``_init_weights(module)`` (which also
recomputes rotary ``inv_freq`` and ``position_ids``); the module's ``reset_parameters()``. Each
module draws from a generator seeded with ``seed`` and its name, so the values do not depend on
the plan, the rank or the order: :func:`initialize` gives an unpartitioned model the very same
weights. Every materialised floating-point tensor is filled with NaN first, so one that no
initialiser wrote is found and named (an integer one with its dtype's minimum).

Buffers a model computes in ``__init__`` and does not save (rotary ``inv_freq``, causal masks,
``position_ids``) cannot be recovered from ``meta``: :func:`empty_weights` keeps them real while
the model is built, which is why it, not ``with torch.device("meta")``, is the way to build.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from partitioner.errors import PipecutError

__all__ = ["empty_weights", "materialize", "materialize_stages", "initialize", "MaterializeError", "InitFn",
           "release_whole_copies", "released_device", "released_names", "refuse_released"]

# Set on the meta parameter that :func:`release_whole_copies` leaves where a whole tensor was: the
# device the tensor was on.
_RELEASED = "_pipecut_released_to_fsdp"

log = logging.getLogger(__name__)

InitFn = Callable[[str, nn.Module], None]


class MaterializeError(PipecutError, RuntimeError):
    """A stage's tensors cannot be made real: a tensor no initialiser writes, or a buffer lost on meta."""


@contextmanager
def empty_weights() -> Iterator[None]:
    """Build a model with its parameters on ``meta`` and its buffers real.

    Inside the block every parameter a module registers is moved to ``meta`` at once (its
    initialisation then runs on meta, for free), while buffers keep the values ``__init__``
    computed: rotary frequencies, causal masks, position ids. Those are small and are not in
    checkpoints, so they could not be recovered later. ``nn.Module.register_parameter`` is
    patched for the duration of the block (process-wide; restored on exit).

    Example:
        >>> with empty_weights():
        ...     lin = nn.Linear(4096, 4096)
        ...     lin.register_buffer("scale", torch.arange(3.0), persistent=False)
        >>> lin.weight.is_meta, lin.scale.tolist()
        (True, [0.0, 1.0, 2.0])
    """
    original = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None and not param.is_meta:
            kind = type(param)
            self._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


@dataclass
class MaterializeReport:
    """What :func:`materialize` did.

    Attributes:
        tensors: names of the tensors made real (one name per tensor).
        bytes: bytes allocated.
        initialised: per module name, the initialiser used (``'init_fn'``, ``'hf'``,
            ``'reset_parameters'``), or ``'checkpoint'`` when ``will_load`` covers all its tensors.
    """

    tensors: list[str] = field(default_factory=list)
    bytes: int = 0
    initialised: dict[str, str] = field(default_factory=dict)


def materialize(
    model: nn.Module | None,
    stages: Mapping[int, nn.Module],
    device: torch.device | str,
    *,
    init_fn: InitFn | None = None,
    seed: int = 0,
    will_load: Collection[str] = (),
) -> MaterializeReport:
    """Make the meta tensors of ``stages`` real on ``device`` and initialise them.

    Args:
        model: the original model the stages were cut from (the tensors are installed in it
            too, under every alias, so it stays the model being trained); ``None`` when only
            the stage modules exist (then only ``init_fn`` can initialise).
        stages: this rank's stage modules, by stage index (their tensors carry the original
            model's names).
        device: where the tensors go.
        init_fn: ``init_fn(name, module)`` initialises the tensors owned directly by the
            original model's module ``name``; default: the Hugging Face ``_init_weights`` or the
            module's ``reset_parameters()``.
        seed: base seed; each module's generator is seeded from it and the module's name.
        will_load: names a checkpoint will fill next: not an error if no initialiser wrote them,
            and a module whose materialised tensors are all among them is not initialised.

    Returns:
        A :class:`MaterializeReport`.

    Raises:
        MaterializeError: a tensor that no initialiser wrote (named, with its module's class).

    Example:
        >>> with empty_weights():
        ...     net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> stage1 = nn.Module(); stage1.add_module("2", net[2])  # a stage holding net.2 only
        >>> report = materialize(net, {1: stage1}, "cpu")
        >>> report.tensors, net[0].weight.is_meta, net[2].weight.is_meta
        (['2.weight', '2.bias'], True, False)
    """
    device = torch.device(device)
    report = MaterializeReport()
    made: dict[int, torch.Tensor] = {}  # id(meta tensor) -> its real replacement
    names: dict[int, list[str]] = {}
    keep: list[torch.Tensor] = []  # the meta tensors, alive so that their ids stay unique
    for s in sorted(stages):
        for name, t in _named_tensors(stages[s]):
            if t.is_meta:
                names.setdefault(id(t), []).append(name)
                if id(t) not in made:
                    made[id(t)] = _empty_like(t, device)
                    keep.append(t)
    if not made:
        return report
    for key, new in made.items():
        report.tensors.append(names[key][0])
        report.bytes += new.numel() * new.element_size()
    # Found before anything is replaced: a stage may hold the model's own submodules (fx).
    in_model = _hits(model, made) if model is not None else []
    for s in sorted(stages):
        for name, new in _hits(stages[s], made):
            _set(stages[s], name, new)
    fresh = {id(t) for t in made.values()}
    owners: dict[str, nn.Module] = {}
    if model is not None:
        for name, new in in_model:
            _set(model, name, new)
            mod_name = name.rpartition(".")[0]
            owners.setdefault(mod_name, model.get_submodule(mod_name) if mod_name else model)
    elif init_fn is None:
        raise MaterializeError(
            f"{len(made)} tensors of stages {sorted(stages)} are on meta (e.g. {report.tensors[:3]}) and "
            "there is no model to initialise them with: bind the plan to the model, or pass init_fn"
        )
    else:
        for s in sorted(stages):
            for mod_name, mod in stages[s].named_modules():
                if any(id(t) in fresh for t in _own_tensors(mod)):
                    owners.setdefault(mod_name, mod)
    later = set(will_load)
    # A module whose own tensors a checkpoint fills next needs no initialisation (that is most
    # of a big model: random init of billions of weights to be overwritten is wasted time).
    loaded = {name for name, mod in owners.items()
              if all(f"{name}.{k}".lstrip(".") in later for k, t in _own_items(mod) if id(t) in fresh)}
    _init_modules(model, {n: m for n, m in owners.items() if n not in loaded}, init_fn, seed, device, report)
    report.initialised.update(dict.fromkeys(loaded, "checkpoint"))
    known = {name for name, _ in _named_tensors(model)} if model is not None else set()
    _check_written({k: t for k, t in made.items() if not later & set(names[k])}, names, owners, known)
    del keep
    log.info("materialised %d tensors (%.1f MiB) on %s", len(made), report.bytes / 2**20, device)
    return report


def initialize(model: nn.Module, *, init_fn: InitFn | None = None, seed: int = 0) -> None:
    """Initialise every module of a real ``model`` as :func:`materialize` does its stages.

    The same seed gives the same values as a materialised, partitioned copy of the model,
    whatever the plan: the reference for tests, and a way to start from identical weights.
    """
    owners = {name: mod for name, mod in model.named_modules() if any(True for _ in _own_tensors(mod))}
    device = next((t.device for _, t in _named_tensors(model)), torch.device("cpu"))
    _init_modules(model, owners, init_fn, seed, device, MaterializeReport())


def materialize_stages(
    model: nn.Module, own: Mapping[int, nn.Module], devices: Mapping[int, torch.device], *,
    init_fn: InitFn | None, seed: int, will_load: Collection[str], rank: int = 0,
) -> bool:
    """Give this process's stages real tensors where the model was built on meta (only theirs),
    grouped by device; then check none is left on meta. Returns whether anything was made.

    Raises:
        MaterializeError: a stage still holds a meta tensor that no module of the model owns.
    """
    made = any(t.is_meta for module in own.values() for t in _own_stage_tensors(module))
    if made:
        by_device: dict[torch.device, dict[int, nn.Module]] = {}
        for s, module in own.items():
            by_device.setdefault(devices[s], {})[s] = module
        for device, stages in by_device.items():
            report = materialize(model, stages, device, init_fn=init_fn, seed=seed, will_load=will_load)
            log.info("rank %d: stages %s materialised on %s: %d tensors, %.1f MiB", rank,
                     sorted(stages), device, len(report.tensors), report.bytes / 2**20)
    for s, module in own.items():
        meta = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
        if meta:
            raise MaterializeError(
                f"stage {s} still has tensors on the meta device (e.g. {meta[:3]}) after materialising; "
                "a tensor no module of the model holds cannot be initialised: pass init_fn, or build "
                "the model under runtime.empty_weights()"
            )
    return made


def _own_stage_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def release_whole_copies(roots: Sequence[nn.Module], whole: Collection[nn.Parameter]) -> int:
    """Put on ``meta`` every parameter of ``roots`` that is one of ``whole``: the whole tensors a
    stage held before FSDP copied them into its shards. Returns the bytes released.

    Left where they were, they would keep a whole stage alive beside its shards (``roots``: the
    planned model and its traced graph, which share the stage's tensors) and go stale as the
    shards train. Each becomes a meta parameter of the same shape, dtype and ``requires_grad``
    (one per tensor, so ties stay ties), marked with the device it was on: a later trainer refuses
    to initialise it afresh (:func:`released_names`), and a fake run of the traced graph (shapes,
    autocast dtypes) makes it a fake tensor there (:func:`released_device`). Buffers are left:
    FSDP does not shard them.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> release_whole_copies([net], [net.weight])
        16
        >>> net.weight.is_meta, net.bias.is_meta
        (True, False)
    """
    mine = {id(p) for p in whole}
    made: dict[int, nn.Parameter] = {}
    released = 0
    for root in roots:
        for module in root.modules():
            for key, q in list(module._parameters.items()):
                if q is None or id(q) not in mine or q.is_meta:
                    continue
                if id(q) not in made:
                    released += q.untyped_storage().nbytes()
                    stand_in = nn.Parameter(torch.empty_like(q, device="meta"), requires_grad=q.requires_grad)
                    setattr(stand_in, _RELEASED, q.device)
                    made[id(q)] = stand_in
                module._parameters[key] = made[id(q)]
    return released


def released_names(module: nn.Module) -> list[str]:
    """The parameters of ``module`` that :func:`release_whole_copies` put on meta.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> _ = release_whole_copies([net], [net.bias])
        >>> released_names(net)
        ['bias']
    """
    return [n for n, p in module.named_parameters(remove_duplicate=False) if released_device(p) is not None]


def refuse_released(stages: Mapping[int, nn.Module]) -> None:
    """Raise if a stage holds weights an FSDP trainer took (:func:`release_whole_copies`): made
    again here, they would silently start from fresh values, not from that trainer's."""
    for s, module in sorted(stages.items()):
        names = released_names(module)
        if names:
            raise MaterializeError(
                f"stage {s}'s weights {names[:3]} were handed to an earlier trainer with engine='fsdp', which "
                "keeps only its shards (the model holds meta tensors in their place). Save that trainer's "
                "weights (trainer.save(...) or trainer.export_safetensors(...)) and build this one with "
                "Init(weights=...), or partition a freshly built model"
            )


def released_device(t: torch.Tensor) -> torch.device | None:
    """The device of the whole tensor ``t`` stands in for (:func:`release_whole_copies`), else ``None``.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> _ = release_whole_copies([net], [net.weight])
        >>> released_device(net.weight), released_device(net.bias)
        (device(type='cpu'), None)
    """
    return getattr(t, _RELEASED, None)


# -- internals --------------------------------------------------------------------------------


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _own_items(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from ((k, t) for k, t in module._parameters.items() if t is not None)
    yield from ((k, t) for k, t in module._buffers.items() if t is not None)


def _own_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    return (t for _, t in _own_items(module))


def _empty_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    new = torch.empty(t.shape, dtype=t.dtype, device=device)
    # A sentinel, so a tensor no initialiser writes is found: NaN, or an integer dtype's minimum.
    if new.is_floating_point() or new.is_complex():
        new.fill_(float("nan"))
    elif new.dtype != torch.bool:
        new.fill_(torch.iinfo(new.dtype).min)
    if isinstance(t, nn.Parameter):
        return type(t)(new, requires_grad=t.requires_grad)
    return new


def _hits(root: nn.Module, made: Mapping[int, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Every name under which ``root`` holds a tensor ``made`` replaces, with the replacement."""
    return [(name, made[id(t)]) for name, t in _named_tensors(root) if id(t) in made]


def _set(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace the parameter or buffer ``name`` of ``root`` (keeping a buffer's persistence)."""
    mod_name, _, leaf = name.rpartition(".")
    owner = root.get_submodule(mod_name) if mod_name else root
    if leaf in owner._parameters:
        owner._parameters[leaf] = tensor  # type: ignore[assignment]
    else:
        owner._buffers[leaf] = tensor


def _init_modules(
    model: nn.Module | None, owners: Mapping[str, nn.Module], init_fn: InitFn | None, seed: int,
    device: torch.device, report: MaterializeReport,
) -> None:
    hf_owner = _hf_initialisers(model) if model is not None else {}
    devices = [device] if device.type == "cuda" else []
    for name in sorted(owners):
        module = owners[name]
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(_module_seed(seed, name))
            if init_fn is not None:
                init_fn(name, module)
                how = "init_fn"
            elif name in hf_owner or _hf_parent(hf_owner, name) is not None:
                parent = _hf_parent(hf_owner, name)
                assert parent is not None
                parent._init_weights(module)  # type: ignore[operator]
                how = "hf"
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()  # type: ignore[operator]
                how = "reset_parameters"
            else:
                how = "none"
        report.initialised[name] = how


def _hf_initialisers(model: nn.Module) -> dict[str, nn.Module]:
    """Module name -> the Hugging Face ``PreTrainedModel`` (with ``_init_weights``) it is."""
    return {name: mod for name, mod in model.named_modules()
            if callable(getattr(mod, "_init_weights", None)) and hasattr(mod, "config")}


def _hf_parent(hf: Mapping[str, nn.Module], name: str) -> nn.Module | None:
    """The innermost Hugging Face model containing module ``name`` (itself included)."""
    best: tuple[int, nn.Module] | None = None
    for prefix, mod in hf.items():
        if prefix == "" or name == prefix or name.startswith(prefix + "."):
            depth = len(prefix)
            if best is None or depth > best[0]:
                best = (depth, mod)
    return None if best is None else best[1]


def _module_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def _check_written(
    made: Mapping[int, torch.Tensor], names: Mapping[int, list[str]], owners: Mapping[str, nn.Module],
    known: Collection[str],
) -> None:
    unwritten = []
    for key, t in made.items():
        if t.is_floating_point() or t.is_complex():
            bad = bool(torch.isnan(t).all()) if t.numel() else False
        elif t.dtype == torch.bool:
            bad = False
        else:
            bad = bool((t == torch.iinfo(t.dtype).min).all()) if t.numel() else False
        if bad:
            name = names[key][0]
            # A tensor the model does not hold: the tracer computed it from the model's tensors.
            unwritten.append(name if not known or name in known else f"{name} (a constant the trace computed "
                             "from tensors of the model, here on meta)")
    if unwritten:
        classes = {n: type(owners[n.rpartition(".")[0]]).__name__ for n in unwritten if n.rpartition(".")[0] in owners}
        raise MaterializeError(
            f"{len(unwritten)} tensors built on meta were not initialised: {unwritten[:6]} "
            f"(modules {sorted(set(classes.values()))[:6]} have no reset_parameters() and no Hugging "
            "Face _init_weights covers them). Pass init_fn=lambda name, module: ... to initialise "
            "them, or load them from a checkpoint; a buffer that __init__ computes and checkpoints "
            "do not hold (a rotary table, a mask) comes back only if the model is built under "
            "runtime.empty_weights(), which keeps buffers real"
        )
