"""Cut a traced GraphModule into one module per stage, keeping the original parameter names.

Legend: ``p`` stages, ``s`` a stage index. A *value* is the output of one fx node (or a graph
input); values consumed by a later stage cross to it directly (a skip connection from stage 0 to
stage 3 goes straight to stage 3, not through 1 and 2).

We write our own splitter rather than using ``torch.fx.passes.split_module`` because the latter
renames qualified attributes (``h.0.attn.weight`` becomes ``h_0_attn_weight``), and pipecut promises
that every stage's ``state_dict`` keys are the original model's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import torch
import torch.fx as fx
from torch import nn

from partitioner.errors import InputCountError, PartitionError, StageIndexError
from partitioner.tracing.fxutil import compute_nodes, flat_outputs, named_tensors, owner_of, wire_form
from partitioner.tracing.globalstate import preserved

# How a value travels between stages (``wire_form``): kind, shape, dtype.
WireForm = tuple[str, tuple[int, ...], str]

__all__ = ["ValueSpec", "StageIO", "StagedModel", "split_graph", "decode_value"]

log = logging.getLogger(__name__)

GRAPH_INPUT = -1


@dataclass(frozen=True)
class ValueSpec:
    """A value crossing between stages, as it travels: always a tensor on the wire.

    Attributes:
        name: the fx node name of the value (a graph input's placeholder name for inputs).
        producer: the stage computing it, or ``-1`` for a graph input.
        consumers: the stages reading it, ascending; ``p`` is not used: the last stage re-emits
            graph outputs itself.
        kind: ``'tensor'``, or the Python type it is encoded from: ``'int'``, ``'float'``,
            ``'bool'``, ``'ints'`` (a shape); non-tensors travel as 0-d/1-d tensors.
        shape: the shape on the wire for the traced example (one micro-batch).
        dtype: the dtype on the wire, as a string like ``'torch.float32'``.
    """

    name: str
    producer: int
    consumers: tuple[int, ...]
    kind: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * _dtype_size(self.dtype)


@dataclass(frozen=True)
class StageIO:
    """What one stage receives and sends, in the order of its module's arguments and results.

    Attributes:
        stage: the stage index.
        inputs: the values its forward takes, in argument order.
        outputs: the values its forward returns, in result order. For the last stage these are
            exactly the model's flattened outputs.
    """

    stage: int
    inputs: tuple[ValueSpec, ...]
    outputs: tuple[ValueSpec, ...]


@dataclass
class StagedModel(Sequence[fx.GraphModule]):
    """The stage modules of a plan with their wiring; calling it runs the stages in order.

    It is also the read-only sequence of its stage modules: ``len``, iteration, ``reversed``,
    ``in`` and ``.index`` work, ``staged[s]`` is stage ``s``'s module (negative ``s`` counts from
    the last stage), and a slice gives a plain ``list`` of modules: a run of stages is not a
    runnable model by itself (its inputs come from earlier stages), so it is not a
    ``StagedModel``.

    Attributes:
        stages: one ``fx.GraphModule`` per stage; parameter names are the original model's.
        io: per stage, what it receives and sends.
        input_names: the model's flattened input names, in call order.
        shared_params: canonical parameter name -> the stages holding it (only names held by
            more than one stage; their gradients must be summed across those stages).

    Example:
        >>> import torch
        >>> from torch import nn, fx
        >>> m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> gm = fx.symbolic_trace(m)
        >>> stage_of = {"_0": 0, "_1": 0, "_2": 1}
        >>> staged = split_graph(gm, stage_of, 2)
        >>> x = torch.randn(3, 4)
        >>> torch.equal(staged(x)[0], m(x))
        True
        >>> len(staged), staged[-1] is staged[1], staged[0] in staged
        (2, True, True)
        >>> [sum(p.numel() for p in stage.parameters()) for stage in staged]
        [20, 10]
        >>> staged[:1] == [staged[0]], staged.index(staged[1])
        (True, 1)
        >>> staged[2]
        Traceback (most recent call last):
        ...
        partitioner.errors.StageIndexError: stage index 2 is out of range: this model has 2 stages (0..1, or -2..-1 from the end)
    """  # noqa: E501 - the error message above is one line, as the doctest compares it

    stages: list[fx.GraphModule]
    io: list[StageIO]
    input_names: tuple[str, ...]
    shared_params: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.stages)

    def __iter__(self) -> Iterator[fx.GraphModule]:
        return iter(self.stages)

    @overload
    def __getitem__(self, index: int) -> fx.GraphModule: ...

    @overload
    def __getitem__(self, index: slice) -> list[fx.GraphModule]: ...

    def __getitem__(self, index: int | slice) -> fx.GraphModule | list[fx.GraphModule]:
        """Stage ``index``'s module, or a ``list`` of the modules of a slice of stages.

        Raises:
            StageIndexError: ``index`` is outside ``-p..p-1`` for ``p`` stages (an ``IndexError``).
        """
        try:
            return self.stages[index]
        except IndexError:
            p = len(self.stages)
            raise StageIndexError(
                f"stage index {index} is out of range: this model has {p} stages "
                f"(0..{p - 1}, or -{p}..-1 from the end)"
            ) from None

    def __call__(self, *inputs: Any) -> tuple[Any, ...]:
        """Run all stages one after another on full inputs; returns the flat model outputs."""
        if len(inputs) != len(self.input_names):
            raise InputCountError(
                f"the model takes {len(self.input_names)} inputs {list(self.input_names)}, "
                f"got {len(inputs)}"
            )
        env: dict[str, Any] = dict(zip(self.input_names, inputs))
        out: tuple[Any, ...] = ()
        for stage, io in zip(self.stages, self.io):
            out = stage(*(env[v.name] for v in io.inputs))
            env.update((v.name, t) for v, t in zip(io.outputs, out))
        return tuple(decode_value(v, t) for v, t in zip(self.io[-1].outputs, out))


def split_graph(
    gm: fx.GraphModule,
    stage_of: Mapping[str, int],
    num_stages: int,
    *,
    param_aliases: Mapping[str, Sequence[str]] | None = None,
    persistent_buffers: set[str] | None = None,
    model_state: Mapping[str, torch.Tensor] | None = None,
) -> StagedModel:
    """Split ``gm`` into ``num_stages`` GraphModules.

    Args:
        gm: a traced GraphModule whose nodes carry ``meta['val']`` (shapes) where available.
        stage_of: stage of every compute node (``call_function``/``call_method``/``call_module``)
            by node name. ``get_attr`` nodes are copied into every stage that reads them;
            placeholders are fed to the stages that read them.
        num_stages: ``p``; every stage must receive at least one compute node.
        param_aliases: graph attribute name -> every name the same tensor has in the original
            model (tied weights); each stage holding the tensor registers all of its names, so
            the stages' state_dicts together cover the model's.
        persistent_buffers: names of buffers that belong in a state_dict; other buffers are
            registered as non-persistent. ``None`` keeps every buffer persistent.
        model_state: the original model's ``state_dict(keep_vars=True)``. Entries no stage
            reads (a buffer or parameter the forward never uses) are given to the stage that
            holds their module's nearest relative (stage 0 if none), so that the stages'
            state_dicts together still cover the model's.

    Returns:
        a ``StagedModel``.

    Raises:
        PartitionError: a node is missing from ``stage_of``, a stage is empty, or data would flow
            backwards (a node reads a value of a later stage).
    """
    with preserved(what="split_graph()"):
        return _split(gm, stage_of, num_stages, param_aliases, persistent_buffers, model_state)


def _split(
    gm: fx.GraphModule,
    stage_of: Mapping[str, int],
    num_stages: int,
    param_aliases: Mapping[str, Sequence[str]] | None,
    persistent_buffers: set[str] | None,
    model_state: Mapping[str, torch.Tensor] | None,
) -> StagedModel:
    p = num_stages
    nodes = list(gm.graph.nodes)
    compute, outputs = compute_nodes(gm), flat_outputs(gm)
    placeholders = [n for n in nodes if n.op == "placeholder"]

    missing = [n.name for n in compute if n.name not in stage_of]
    if missing:
        raise PartitionError(
            f"{len(missing)} compute nodes have no stage, e.g. {missing[:5]}; "
            "the assignment must cover every call_function/call_method/call_module node"
        )
    stage: dict[fx.Node, int] = {n: stage_of[n.name] for n in compute}
    bad = {s for s in stage.values() if not 0 <= s < p}
    if bad:
        raise PartitionError(f"stage indices {sorted(bad)} are outside 0..{p - 1}")
    empty = sorted(set(range(p)) - set(stage.values()))
    if empty:
        raise PartitionError(
            f"stages {empty} hold no compute node; ask for fewer stages or move nodes into them"
        )
    for n in compute:
        for a in n.all_input_nodes:
            if a in stage and stage[a] > stage[n]:
                raise PartitionError(
                    f"node {n.name!r} (stage {stage[n]}) reads {a.name!r} from the later "
                    f"stage {stage[a]}; data must flow forward. Reassign one of the two nodes."
                )

    # Which stages read each value (placeholders and compute nodes; get_attr is copied, not sent).
    readers: dict[fx.Node, set[int]] = {n: set() for n in (*placeholders, *compute)}
    for n in compute:
        for a in n.all_input_nodes:
            if a in readers and (a.op == "placeholder" or stage[a] != stage[n]):
                readers[a].add(stage[n])
    for o in outputs:
        if isinstance(o, fx.Node) and o in readers and (o.op == "placeholder" or stage[o] != p - 1):
            readers[o].add(p - 1)

    forms = _wire_forms(readers, outputs)
    specs: dict[fx.Node, ValueSpec] = {}
    for n, rs in readers.items():
        if rs:
            prod = GRAPH_INPUT if n.op == "placeholder" else stage[n]
            specs[n] = _value_spec(n, prod, tuple(sorted(rs)), forms[n])

    stages: list[fx.GraphModule] = []
    ios: list[StageIO] = []
    for s in range(p):
        own = [n for n in compute if stage[n] == s]
        ins = [specs[n] for n in (*placeholders, *compute) if n in specs and s in specs[n].consumers]
        if s < p - 1:
            outs = [specs[n] for n in own if n in specs]
        else:
            outs = [_output_spec(o, specs, p, forms) for o in outputs]
        graph = _stage_graph(gm, own, ins, outs, {v.name: v for v in specs.values()})
        module = fx.GraphModule(gm, graph, class_name=f"Stage{s}")
        _fix_buffers(module, persistent_buffers)
        stages.append(module)
        ios.append(StageIO(s, tuple(ins), tuple(outs)))
    # Each stage registers every name of the tied tensors it holds (its own tensors, read at once).
    for module, have in zip(stages, list(map(named_tensors, stages))):
        _install_aliases(module, param_aliases or {}, have)

    if model_state:
        _install_unread(stages, model_state)
    shared = _shared_params(stages)
    if shared:
        log.info("parameters shared across stages: %s", shared)
    return StagedModel(stages, ios, tuple(n.name for n in placeholders), shared)


def decode_value(spec: ValueSpec, wire: Any) -> Any:
    """Turn a value received on the wire back into what the graph expects (int, shape...)."""
    if spec.kind == "tensor" or not isinstance(wire, torch.Tensor):
        return wire
    if spec.kind == "ints":
        return tuple(int(v) for v in wire.tolist())
    return {"int": int, "float": float, "bool": bool}[spec.kind](wire.item())


def _stage_graph(
    gm: fx.GraphModule,
    own: list[fx.Node],
    ins: list[ValueSpec],
    outs: list[ValueSpec],
    spec_by_name: dict[str, ValueSpec],
) -> fx.Graph:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    by_name = {n.name: n for n in gm.graph.nodes}
    for v in ins:
        ph = graph.placeholder(v.name)
        ph.meta = dict(by_name[v.name].meta)
        env[by_name[v.name]] = _decode_node(graph, ph, v)

    def lookup(a: fx.Node) -> fx.Node:
        if a not in env:
            if a.op != "get_attr":
                raise PartitionError(f"value {a.name!r} is not available in this stage")
            env[a] = graph.get_attr(str(a.target))
            env[a].meta = dict(a.meta)
        return env[a]

    for n in own:
        for a in n.all_input_nodes:
            lookup(a)
        env[n] = graph.node_copy(n, lookup)
    results = [_encode_node(graph, env[by_name[v.name]], v) for v in outs]
    graph.output(tuple(results))
    graph.lint()
    return graph


def _decode_node(graph: fx.Graph, ph: fx.Node, v: ValueSpec) -> fx.Node:
    if v.kind == "tensor":
        return ph
    if v.kind == "ints":
        return graph.call_function(_tensor_to_ints, (ph,))
    return graph.call_function(_SCALAR_DECODERS[v.kind], (ph,))


def _encode_node(graph: fx.Graph, node: fx.Node, v: ValueSpec) -> fx.Node:
    if v.kind == "tensor":
        return node
    dtype = torch.float64 if v.kind == "float" else torch.int64
    return graph.call_function(torch.tensor, (node,), {"dtype": dtype})


def _tensor_to_ints(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(v) for v in t.tolist())


def _to_int(t: torch.Tensor) -> int:
    return int(t.item())


def _to_float(t: torch.Tensor) -> float:
    return float(t.item())


def _to_bool(t: torch.Tensor) -> bool:
    return bool(t.item())


_SCALAR_DECODERS = {"int": _to_int, "float": _to_float, "bool": _to_bool}


def _output_spec(
    o: Any, specs: dict[fx.Node, ValueSpec], p: int, forms: Mapping[fx.Node, WireForm | None]
) -> ValueSpec:
    if isinstance(o, fx.Node):
        base = specs.get(o) or _value_spec(o, p - 1, (), forms[o])
        return ValueSpec(base.name, base.producer, base.consumers, base.kind, base.shape, base.dtype)
    raise PartitionError(
        f"the model returns a constant ({o!r}) rather than a computed value; "
        "return only tensors from the model being partitioned"
    )


def _wire_forms(readers: Mapping[fx.Node, set[int]], outputs: Sequence[Any]) -> dict[fx.Node, WireForm | None]:
    """``wire_form`` of each value read by another stage and of each output the last stage does not
    send on: these alone, as reading a shape can specialise a symbolic size, and back to back
    (``map``), one visit to partitioner.tracing rather than one between each spec made here."""
    crossing = [n for n, rs in readers.items() if rs]
    crossing += [o for o in outputs if isinstance(o, fx.Node) and not readers.get(o)]
    return dict(zip(crossing, map(wire_form, crossing)))


def _value_spec(n: fx.Node, producer: int, consumers: tuple[int, ...], form: WireForm | None) -> ValueSpec:
    """``n``'s spec, from ``form``: ``wire_form(n)``."""
    if form is None:
        val = n.meta.get("val")
        raise PartitionError(
            f"value {n.name!r} of type {type(val).__name__} would cross a stage boundary; only "
            "tensors, scalars and shapes can. Keep the nodes producing and reading it in one stage "
            "(granularity='module') or return tensors from that module."
        )
    kind, shape, dtype = form
    return ValueSpec(n.name, producer, consumers, kind, shape, dtype)


def _fix_buffers(module: nn.Module, persistent: set[str] | None) -> None:
    if persistent is None:
        return
    for name, _ in list(module.named_buffers()):
        if name not in persistent:
            owner, leaf = owner_of(module, name)
            owner._non_persistent_buffers_set.add(leaf)


def _install_aliases(
    module: nn.Module, aliases: Mapping[str, Sequence[str]], have: Mapping[str, torch.Tensor]
) -> None:
    """Register on ``module`` every other name of the tensors in ``have`` (``named_tensors(module)``)."""
    for name, names in aliases.items():
        if name not in have:
            continue
        for alias in names:
            if alias == name or alias in have:
                continue
            _install(module, alias, have[name])


def _install(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Register ``tensor`` on ``module`` under the dotted ``name``, making empty parents as needed."""
    *prefix, leaf = name.split(".")
    owner = module
    for item in prefix:
        nxt = getattr(owner, item, None)
        if nxt is None:
            nxt = nn.Module()
            setattr(owner, item, nxt)
        owner = nxt
    if isinstance(tensor, nn.Parameter):
        setattr(owner, leaf, tensor)
    else:
        owner.register_buffer(leaf, tensor)


def _install_unread(stages: Sequence[nn.Module], state: Mapping[str, torch.Tensor]) -> None:
    """Give each model tensor no stage holds to the stage holding its nearest relative by name."""
    held = [set(named_tensors(m)) for m in stages]
    everywhere = set().union(*held)
    for name, tensor in state.items():
        if name in everywhere:
            continue
        parts = name.split(".")[:-1]
        home = 0
        for k in range(len(parts), 0, -1):  # the longest module path some stage holds tensors under
            prefix = ".".join(parts[:k]) + "."
            hits = [s for s, names in enumerate(held) if any(n.startswith(prefix) for n in names)]
            if hits:
                home = hits[0]
                break
        _install(stages[home], name, tensor)
        log.info("%s is read by no stage; stage %d holds it for the state_dict", name, home)


def _shared_params(stages: list[fx.GraphModule]) -> dict[str, tuple[int, ...]]:
    holders: dict[int, tuple[str, list[int]]] = {}
    for s, m in enumerate(stages):
        for name, prm in m.named_parameters():
            key = id(prm)
            if key not in holders:
                holders[key] = (name, [])
            holders[key][1].append(s)
    return {name: tuple(ss) for name, ss in holders.values() if len(ss) > 1}


def _dtype_size(dtype: str) -> int:
    name = dtype.replace("torch.", "")
    try:
        size: int = getattr(torch, name).itemsize
        return size
    except AttributeError:
        return 4
