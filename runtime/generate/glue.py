"""A decoder's top-level arithmetic, read off the traced graph: what its own ``forward`` does between its parts.

Legend: ``B`` sequences, ``T`` new positions this call, ``H`` hidden size, ``V`` vocabulary.

A stage calls the model's modules one by one (:mod:`runtime.generate.parts`). What the model's
top-level ``forward`` does *between* them is not a module: Gemma multiplies the token embeddings
by ``sqrt(H)``, Granite by ``embedding_multiplier``, GPT-2 adds its position embedding, Cohere
multiplies the logits by ``logit_scale``, Granite divides them by ``logits_scaling``, Gemma 2
soft-caps them. Those are ops of the traced graph that no part's module owns: the *glue*.

:func:`derive_glue` finds, in the plan's traced graph (the model's own forward, traced whole),
the node that is the first layer's hidden-state input, the node that is the last layer's output,
the final norm's output and the logits, and :class:`Piece` evaluates the graph between two such
nodes on new tensors: a node a part owns is that part's module called on the part's own input
(the model's module, on this stage's real tensors); a node no part owns is replayed from the
graph (its aten op, with its constants); anything else (a layer's value, a model input other
than the token ids) cannot be computed at one step of generation, and is refused with the node
named. The graph is traced with dynamic batch and sequence sizes, so its ops replay on a decode
step's ``(B, 1)`` as on the example. Nothing about a family is listed here: a family's
multipliers are in its graph, or the generator refuses it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from partitioner.plan.plan import Plan
from partitioner.tracing.trace import module_call_index, node_module_path
from runtime.generate.errors import GenerateModelError
from runtime.generate.parts import DecoderParts

__all__ = ["Glue", "Piece", "derive_glue"]

# Input names of pre-side parts called on something other than the hidden states.
TOKENS = "tokens"
POSITIONS = "positions"


def _owner(path: str, names: Sequence[str]) -> str | None:
    return next((n for n in names if path == n or path.startswith(n + ".")), None)


@dataclass
class Piece:
    """The traced graph from some bound nodes to ``target``, evaluated on new tensors.

    Attributes:
        target: the node whose value the piece returns.
        bound: the nodes given as inputs, by name (``'hidden'``).
        modules: per part that this piece calls, the node that is its output.
        inputs: per part, its input node, or :data:`TOKENS` / :data:`POSITIONS` for the parts fed
            with the token ids or the position ids (the token embedding, a learned position
            embedding).
        sizes: the size reads of the token ids' batch and sequence dims (dim by node): at a call
            they are the sizes of what the piece is given (the token ids, or the hidden states,
            whose first two dims are the same batch and positions).
        positions: the node holding the position ids the model's forward made itself from an
            ``arange`` over the sequence (CTRL indexes its sinusoid table with them): at a call
            it is the step's position ids (B, T), as the model's forward takes them when given.
        ops: the glue ops this piece replays (no part owns them), in graph order: what the
            model's forward does between its parts, e.g. ``['mul(embedding, 3.0)']``.
    """

    target: fx.Node
    bound: dict[str, fx.Node]
    modules: dict[str, fx.Node] = field(default_factory=dict)
    inputs: dict[str, fx.Node | str] = field(default_factory=dict)
    ops: list[str] = field(default_factory=list)
    sizes: dict[fx.Node, int] = field(default_factory=dict)
    positions: fx.Node | None = None

    def __call__(self, parts: DecoderParts, gm: fx.GraphModule, values: Mapping[str, Any]) -> torch.Tensor:
        """The target's value, with ``values`` for the bound nodes (and ``'tokens'``, ``'positions'``)."""
        known: dict[fx.Node, Any] = {node: values[name] for name, node in self.bound.items()}
        ref = values["tokens"] if "tokens" in values else values["hidden"]
        known.update((node, ref.shape[dim]) for node, dim in self.sizes.items())
        if self.positions is not None:
            known[self.positions] = values[POSITIONS]
        by_output = {node: name for name, node in self.modules.items()}

        def value(node: fx.Node) -> Any:
            if node in known:
                return known[node]
            part = by_output.get(node)
            if part is not None:
                source = self.inputs[part]
                arg = values[source] if isinstance(source, str) else value(source)
                module = parts.module(part)
                out = _positions_call(module, arg) if source == POSITIONS else module(arg)
            elif node.op == "get_attr":
                out = _attr(gm, str(node.target))
            else:
                fn: Callable[..., Any] = node.target  # type: ignore[assignment]
                args = fx.node.map_arg(node.args, value)
                kwargs = fx.node.map_arg(node.kwargs, value)
                out = fn(*args, **kwargs)
            known[node] = out
            return out

        result: torch.Tensor = value(self.target)
        return result


@dataclass
class Glue:
    """The model's top-level arithmetic around its parts, as three :class:`Piece` s.

    Attributes:
        embed: token ids (and position ids) -> the first layer's hidden input (B, T, H).
        norm: the last layer's output -> the final norm's output (B, T, H).
        head: the final norm's output (its last position, B, 1, H) -> the logits (B, 1, V).
        gm: the traced graph module (for the constants the glue reads).
        head_name: the LM head's module name.
        norm_name: the final norm's module name (``None`` without one).
        unrotated: the layers that read none of the rotary's output in the trace: the model's
            forward gave them none, or they ignore it.
        none_ok: per layer of ``unrotated``, whether it runs given ``position_embeddings=None``
            (found at its first call: :func:`runtime.generate.parts.run_layer`).
    """

    embed: Piece
    norm: Piece
    head: Piece
    gm: fx.GraphModule
    head_name: str = ""
    norm_name: str | None = None
    unrotated: frozenset[str] = frozenset()
    none_ok: dict[str, bool] = field(default_factory=dict)

    @property
    def post(self) -> tuple[str, ...]:
        """The base model's other children the head piece calls (OPT's ``project_out``)."""
        return tuple(name for name in self.head.modules if name != self.head_name)

    @property
    def tail(self) -> tuple[str, ...]:
        """The base model's other children the norm piece calls before the final norm (HY-V4's ``hc_head``)."""
        return tuple(name for name in self.norm.modules if name != self.norm_name)

    @property
    def pre(self) -> tuple[str, ...]:
        """The embedding-side modules the embedding piece calls."""
        return tuple(self.embed.modules)

    def ops(self) -> dict[str, list[str]]:
        """The replayed glue ops of each piece, for logs and errors."""
        return {"embed": self.embed.ops, "norm": self.norm.ops, "head": self.head.ops}


def derive_glue(plan: Plan, parts: DecoderParts) -> Glue:
    """Read the glue around ``parts`` off ``plan``'s traced graph.

    Raises:
        GenerateModelError: the graph's data path between two parts depends on something a
            generation step cannot compute (a layer's intermediate value, a model input other
            than the token ids, a part's value other than its output); the message names the node.

    Example:
        >>> import torch, transformers
        >>> from partitioner import partition
        >>> from runtime.generate.parts import decoder_parts
        >>> cfg = transformers.GraniteConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=32, embedding_multiplier=3.0, logits_scaling=4.0)
        >>> model = transformers.GraniteForCausalLM(cfg).eval()
        >>> glue = derive_glue(partition(model, (torch.zeros(1, 8, dtype=torch.long),), 2), decoder_parts(model))
        >>> glue.ops()
        {'embed': ['mul(embedding, 3.0)'], 'norm': [], 'head': ['div(linear, 4.0)']}
    """
    gm = plan.traced.gm
    graph = gm.graph
    names = [*parts.pre, *parts.layers, *([parts.norm] if parts.norm else []), parts.head]
    if parts.rotary is not None:
        names.append(parts.rotary)
    owner: dict[fx.Node, str | None] = {}
    for node in graph.nodes:
        owner[node] = None if node.op in ("placeholder", "output") else _owner(node_module_path(node), names)
    outputs, inputs, earlier = _part_ends(graph, owner, parts)
    family = parts.family
    first, last = parts.layers[0], parts.layers[-1]
    embed_out = outputs.get(parts.embed)
    if embed_out is None:
        raise GenerateModelError(f"{family}: the traced graph has no output of the token embedding {parts.embed}")
    hidden = _made_from(embed_out)  # every node computed from the token embedding's output
    exits = {layer: _exit(graph, owner, layer, hidden, parts.carries, family) for layer in parts.layers}
    h0 = _entry(graph, owner, first, exits[first], hidden, family)
    h_last = exits[last]
    for before, after in zip(parts.layers, parts.layers[1:]):  # the layers run back to back
        out, into = exits[before], _entry(graph, owner, after, exits[after], hidden, family)
        if out is not into:
            raise GenerateModelError(
                f"{family}: between {before} and {after} the model's forward computes {into.name} ({into.target}) "
                f"from {before}'s output {out.name}; the generator hands each layer's output to the next as it is"
            )
    logits = _logits(graph, parts, family)
    # Without a final norm (GPT-1, TrOCR) the norm piece hands the last layer's output on as it is,
    # and whatever the forward does before the head is the head piece's glue.
    norm_out = outputs.get(parts.norm) if parts.norm else h_last
    if norm_out is None:
        raise GenerateModelError(f"{family}: the traced graph has no output of the final norm {parts.norm}")
    pre = set(parts.pre)
    # The final norm may run on the embeddings too (NanoChat's, before the first layer): an earlier call.
    embed = _piece(h0, {}, owner, outputs, inputs, pre | ({parts.norm} if parts.norm else set()), family,
                   "the embedding side", made_positions=True, earlier=earlier)
    # Between the last layer and the final norm a forward may call another child of the base model
    # (HY-V4's hc_head): the norm piece calls it, on the norm's stage.
    norm = _piece(norm_out, {"hidden": h_last}, owner, outputs, inputs,
                  {parts.norm, *parts.others} if parts.norm else set(), family, f"between {last} and the logits")
    # After the final norm the head may be preceded by another child of the base model (OPT's
    # project_out): the head piece calls it, and the generator puts it on the head's stage.
    head = _piece(logits, {"hidden": norm_out}, owner, outputs, inputs, {parts.head, *parts.others}, family,
                  f"between {parts.norm or last} and the logits")
    return Glue(embed=embed, norm=norm, head=head, gm=gm, head_name=parts.head, norm_name=parts.norm,
                unrotated=_unrotated(graph, owner, parts, hidden))


def _made_from(root: fx.Node) -> set[fx.Node]:
    # ``root`` and every node computed from it (those for which _descends(node, root) holds), in one walk.
    todo, seen = [root], set()
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(node.users)
    return seen


def _unrotated(graph: fx.Graph, owner: Mapping[fx.Node, str | None], parts: DecoderParts,
               hidden: set[fx.Node]) -> frozenset[str]:
    # The layers that read nothing of the rotary's output: the model's forward gave them none
    # (LaraMini's global layers use no positional encoding: position_embeddings=None).
    if parts.rotary is None:
        return frozenset()
    # What the rotary's output reaches before it meets the hidden states (a cast a layer makes of it
    # may be shared with the layers after it, as in Llama 4); past the hidden states everything after
    # would count, so the walk stops at the first node that mixes them in (``hidden``).
    reach = [n for n in graph.nodes if owner[n] == parts.rotary and n.op != "get_attr"
             and any(owner[u] != parts.rotary for u in n.users)]
    seen: set[fx.Node] = set()
    while reach:
        node = reach.pop()
        if node not in seen:
            seen.add(node)
            if node not in hidden:
                reach.extend(node.users)
    read = {owner[n] for n in seen}
    unread = frozenset(layer for layer in parts.layers if layer not in read)
    # No layer reading it: the forward's rotary is another module (Granite-SWA's one per theta in
    # rotary_embs), not one some layers go without; the self-check holds the layers to the model.
    return unread if len(unread) < len(parts.layers) else frozenset()


def _positions_call(module: nn.Module, position_ids: torch.Tensor) -> Any:
    # A learned position embedding takes the position ids first (GPT-2's wpe, an nn.Embedding),
    # or by name after the inputs it would make them from (BioGPT's and OPT's take the attention
    # mask first): then by name, with those inputs left None.
    params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    if not params or params[0].name == "position_ids" or all(p.name != "position_ids" for p in params):
        return module(position_ids)
    before = [None for p in params[:[p.name for p in params].index("position_ids")]
              if p.default is inspect.Parameter.empty]
    return module(*before, position_ids=position_ids)


def _part_ends(graph: fx.Graph, owner: Mapping[fx.Node, str | None], parts: DecoderParts,
               ) -> tuple[dict[str, fx.Node], dict[str, fx.Node | str], dict[fx.Node, tuple[str, fx.Node]]]:
    # Per part: its output (the node it owns that a node outside it reads) and its input (the
    # tensor from outside its nodes that is not one of its weights), of its last call; the token
    # embedding's input is the token ids, a position embedding's the position ids (both from the
    # model's inputs). A part called more than once also has its earlier calls' outputs, each with
    # its own input (the third value: output -> (part, input)).
    ends: dict[tuple[str, int], list[fx.Node | None]] = {}
    for node in graph.nodes:
        part = owner[node]
        if part is None or node.op == "get_attr":
            continue
        end = ends.setdefault((part, module_call_index(node, part)), [None, None])
        if any(owner[user] != part for user in node.users):
            end[0] = node  # the last such node in graph order
        for arg in node.all_input_nodes:
            if owner[arg] != part and arg.op != "get_attr" and _is_tensor(arg) and end[1] is None:
                end[1] = arg
    outputs: dict[str, fx.Node] = {}
    inputs: dict[str, fx.Node | str] = {}
    earlier: dict[fx.Node, tuple[str, fx.Node]] = {}
    last = dict(sorted(ends))  # by part: its last call
    for (part, call), (out, source) in ends.items():
        if call == last[part]:
            if out is not None:
                outputs[part] = out
            if source is not None:
                inputs[part] = source
        elif out is not None and source is not None:
            earlier[out] = (part, source)
    for part in parts.pre:
        given = inputs.get(part)
        if part == parts.embed:
            inputs[part] = TOKENS
        elif given is not None and not isinstance(given, str) and not _descends(given, outputs.get(parts.embed)):
            inputs[part] = POSITIONS
    return outputs, inputs, earlier


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _descends(node: fx.Node, root: fx.Node | None) -> bool:
    if root is None:
        return False
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is root:
            return True
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return False


def _shape(node: fx.Node) -> str:
    val = node.meta.get("val")
    return str(tuple(val.shape)) if isinstance(val, torch.Tensor) else ""


def _entry(graph: fx.Graph, owner: Mapping[fx.Node, str | None], layer: str, layer_out: fx.Node,
           hidden: set[fx.Node], family: str) -> fx.Node:
    # A layer's hidden-state input: the tensor from outside it, of the shape of its output, made
    # from the embeddings (the mask and the rotary's cos/sin are of other shapes or sources; OPT
    # projects its embeddings to the hidden size first).
    want = _shape(layer_out)
    found = []
    for node in graph.nodes:
        if owner[node] != layer:
            continue
        for arg in node.all_input_nodes:
            if owner[arg] != layer and arg not in found and _shape(arg) == want and arg in hidden:
                found.append(arg)
    entry: fx.Node
    if len(found) != 1:
        raise GenerateModelError(
            f"{family}: expected one hidden-state input of {layer} of its output's shape {want} made from the token "
            f"embedding, found {[n.name for n in found]}; the generator cannot tell which tensor a stage hands on"
        )
    entry = found[0]
    return entry


def _exit(graph: fx.Graph, owner: Mapping[fx.Node, str | None], layer: str, hidden: set[fx.Node],
          carries: Sequence[str], family: str) -> fx.Node:
    # What a layer hands on is made from the hidden states: a value it computes from the position
    # embeddings alone, which the trace lets later layers share (Llama 4's position_embeddings.to()
    # in its first layer), is not -- each layer the generator calls computes its own.
    found: list[fx.Node] = [n for n in graph.nodes if owner[n] == layer and n.op != "get_attr"
                            and any(owner[u] != layer for u in n.users) and _is_tensor(n)
                            and n in hidden]
    if carries and 1 < len(found) <= 1 + len(carries):
        # A layer handing on values beside its hidden states (its forward's prev_... parameters take
        # them): the hidden states are what it computes last, the residual sum its forward returns.
        found = found[-1:]
    if len(found) != 1:
        raise GenerateModelError(
            f"{family}: layer {layer} hands on {len(found)} tensors ({[n.name for n in found]}); the "
            "generator runs layers that return their hidden states only"
        )
    out: fx.Node = found[0]
    return out


def _logits(graph: fx.Graph, parts: DecoderParts, family: str) -> fx.Node:
    vocab = getattr(parts.module(parts.head), "out_features", None) or parts.config.vocab_size
    out = next(n for n in graph.nodes if n.op == "output")
    flat: list[fx.Node] = []
    fx.node.map_arg(out.args, lambda n: flat.append(n) or n)  # type: ignore[func-returns-value]
    found = [n for n in flat if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].ndim == 3
             and n.meta["val"].shape[-1] == vocab]
    if not found:
        raise GenerateModelError(
            f"{family}: none of the traced forward's outputs ({[n.name for n in flat]}) is (B, T, {vocab}) "
            "logits; the generator needs a causal LM that returns its logits"
        )
    return found[0]


def _piece(target: fx.Node, bound: dict[str, fx.Node], owner: Mapping[fx.Node, str | None],
           outputs: Mapping[str, fx.Node], inputs: Mapping[str, fx.Node | str], callable_parts: set[str],
           family: str, where: str, made_positions: bool = False,
           earlier: Mapping[fx.Node, tuple[str, fx.Node]] | None = None) -> Piece:
    # Walk back from the target: stop at bound nodes; a callable part's output is that part
    # (walk on from its input); glue is replayed; a constant subgraph is replayed too. A part
    # called earlier in the forward too (``earlier``) is that call's part, with that call's input.
    piece = Piece(target=target, bound=bound)
    stops = set(bound.values())
    by_output = {node: part for part, node in outputs.items() if part in callable_parts}
    call_inputs: dict[fx.Node, fx.Node | str] = {}
    for node, (part, source) in (earlier or {}).items():
        if part in callable_parts:
            by_output[node], call_inputs[node] = part, source
    seen: set[fx.Node] = set()
    order: list[fx.Node] = []

    def visit(node: fx.Node) -> None:
        if node in seen or node in stops:
            return
        seen.add(node)
        part = by_output.get(node)
        if part is not None:
            if part in piece.modules and piece.modules[part] is not node:
                raise GenerateModelError(f"{family}: {where}, the model's forward calls {part} twice; the generator "
                                         "calls a part once between two others")
            piece.modules[part] = node
            source = call_inputs.get(node, inputs.get(part))
            if source is None:
                raise GenerateModelError(f"{family}: {part} has no input in the traced graph ({where})")
            piece.inputs[part] = source
            if not isinstance(source, str):
                visit(source)
            return
        if owner[node] is not None and node.op != "get_attr":
            raise GenerateModelError(
                f"{family}: {where}, the model's forward reads {node.name} ({node.target}), a value inside "
                f"{owner[node]} that is not that part's output; the generator calls each part as a whole, so it "
                "cannot compute this"
            )
        read, dim = (node.args[0], node.args[1]) if len(node.args) == 2 else (None, None)
        if node.target is torch.ops.aten.sym_size.int and isinstance(read, fx.Node) \
                and read.op == "placeholder" and isinstance(dim, int) and dim in (0, 1):
            piece.sizes[node] = dim
            return
        if node.op == "placeholder":
            raise GenerateModelError(
                f"{family}: {where}, the model's forward reads its input {node.target!r} directly ({node.name}); "
                "the generator feeds the model token ids and positions only, so it cannot compute this"
            )
        for arg in node.all_input_nodes:
            visit(arg)
        order.append(node)

    visit(target)
    if made_positions:  # the embedding side: the positions it is given stand for those the forward made
        piece.positions = _made_positions(order)
    for node in order:  # graph order: inputs first
        if node.op == "call_function" and _on_path(node, stops, piece.modules.values()) and not _whole(node):
            args = ", ".join(_name(a) for a in node.args)
            piece.ops.append(f"{getattr(node.target, '__name__', node.target)}({args})".replace(".default", "")
                             .replace(".Tensor", "").replace(".Scalar", ""))
    return piece


_ARANGES = (torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step)
_VIEWS = (torch.ops.aten.unsqueeze.default, torch.ops.aten.view.default, torch.ops.aten.expand.default,
          torch.ops.aten.reshape.default, torch.ops.aten._to_copy.default)


def _made_positions(order: Sequence[fx.Node]) -> fx.Node | None:
    # The position ids a forward makes when it is given none: an arange over the sequence (or a
    # slice of a buffer holding one), then
    # only views of it (unsqueeze(0), expand) -- the last of those views, which the model would
    # have taken as its position_ids input.
    inside = set(order)
    made = next((n for n in order if n.target in _ARANGES or _buffer_slice(n)), None)
    if made is None:
        return None
    while True:
        views = [u for u in made.users if u in inside and u.target in _VIEWS]
        if len(views) != 1 or len(made.users) != 1:
            return made
        made = views[0]


def _buffer_slice(node: fx.Node) -> bool:
    # BERT's way: a slice of the model's registered ``position_ids`` buffer (an arange made at build).
    if node.target is not torch.ops.aten.slice.Tensor or not node.args:
        return False
    source = node.args[0]
    return (isinstance(source, fx.Node) and source.op == "get_attr" and isinstance(source.target, str)
            and source.target.endswith("position_ids"))


def _whole(node: fx.Node) -> bool:
    # A slice of a whole dim (``x[:, 0:]``, how logits_to_keep=0 reads): replayed, not worth listing.
    args = node.args
    return bool(node.target is torch.ops.aten.slice.Tensor and 4 <= len(args) <= 5 and args[2] == 0
                and isinstance(args[3], int) and args[3] >= 2**62)


def _on_path(node: fx.Node, stops: set[fx.Node], outs: Any) -> bool:
    # A replayed op that touches the hidden states or logits (not a shape read, not a constant).
    roots = stops | set(outs)
    return any(_descends(node, r) for r in roots) and _is_tensor(node)


def _name(arg: Any) -> str:
    if isinstance(arg, fx.Node):
        return arg.name.rstrip("_0123456789") or arg.name
    return repr(arg)


def _attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for key in target.split("."):
        obj = getattr(obj, key)
    return obj
