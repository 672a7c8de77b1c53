"""Tensor parallelism inside a stage: Megatron's column/row pairs written into the stage's graph.

Legend: ``tp`` ranks of the tensor-parallel group, ``r`` this rank in it, ``d`` the dimension
of an activation that is split over ``tp`` (its *sharded dim*); shapes ``(B, T, C)``.

A stage module is a ``torch.fx`` graph of ``aten`` ops that reads its weights through
``get_attr`` (``runtime.parallel.blocks`` explains why), so torch's parallel styles, which wrap
an ``nn.Linear``'s forward, have nothing to attach to. :func:`parallelize_stage` rewrites the
graph instead, as Megatron-LM writes its layers: each ``aten.linear`` whose weight the plan calls
``colwise`` keeps rows ``r / tp`` of it (its output is this rank's heads or hidden units) behind
an identity whose backward all-reduces the input's gradient; each ``rowwise`` one keeps columns
``r / tp`` and all-reduces its output (bias added after). Between the two the graph runs on
local tensors, so the shape ops that name a head count (Llama's grouped-query ``expand`` and
``reshape``) are rewritten to the local count: the sharded dim is followed op by op through the
global shapes the trace recorded, and an op whose rule is not known, or that would mix shards
(a stage output, a slice across heads), is refused with its node named. One all-reduce per
attention and one per MLP forward, as many backward: the design, measured, is in
docs/tensor-parallel.md (DTensor's own propagation of the same graph does not finish a forward
on CPU in minutes: it decomposes the CPU attention kernel op by op).

Sharded weights become ``DTensor`` parameters (``Shard(0)`` or ``Shard(1)`` on the group's 1-D
mesh), each rank holding its shard only; the graph reads them through ``to_local``, so their
gradients are ``DTensor`` shards too. Every other parameter stays a whole tensor: every op that
reads one (norms, embeddings, a row-parallel bias) sees activations that are identical on every
rank (whole stage inputs, all-reduced row outputs), and the gradient reaching it is whole too
(the column inputs' backward all-reduce runs before it), so its gradient is bitwise the same on
every rank without a reduction.

Example:
    >>> plan_for({"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"},
    ...          ["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight",
    ...           "model.layers.0.mlp.down_proj.bias", "model.norm.weight"])
    {'model.layers.0.mlp.up_proj.weight': 'colwise', 'model.layers.0.mlp.down_proj.weight': 'rowwise', \
'model.layers.0.mlp.down_proj.bias': 'rowwise'}
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from runtime.parallel.tensor_collectives import (
    TensorParallelGather,
    TensorParallelHeads,
    TensorParallelIn,
    TensorParallelOut,
    TensorParallelSplit,
)
from runtime.parallel.tensor_rules import (
    ELEMENTWISE,
    TensorParallelError,
    _gradient_source,
    _head_count,
    _packed_parts,
    op_name,
    propagate,
    shape_of,
)

__all__ = [
    "DERIVED_PLANS", "STYLES", "WHOLE_STYLES", "whole_entries",
    "TensorParallelError", "TensorParallelLayout", "config_patterns", "parallelize_stage",
    "plan_for", "plan_from_config",
]

log = logging.getLogger(__name__)

STYLES = ("colwise", "rowwise", "packed_colwise", "colwise_gather_output", "rowwise_split_input")
# Styles of transformers' tp plans that shard nothing here, kept whole with the reason logged:
# a whole weight read by split activations has its gradient all-reduced over tp by construction
# (see _Rewriter.rewrite), which is what ``replicated_with_grad_allreduce`` asks for; the token
# embedding is split over the vocabulary by TensorParallel(vocab=True) instead; experts stay whole.
WHOLE_STYLES = {
    "replicated_with_grad_allreduce": "whole on every rank; its gradient is all-reduced over tp where split "
                                      "activations read it (pipecut does this for every whole weight)",
    "embedding_rowwise": "whole on every rank, unless the plan splits nothing else (then it is run as "
                         "TensorParallel(vocab=True), which splits the embedding over the vocabulary)",
    "moe_tp_experts": "whole on every rank (experts are not split; the attention is)",
    "replicate": "whole on every rank (transformers' own word for it: every rank keeps the full parameter)",
}
_COLUMN = ("colwise", "packed_colwise", "colwise_gather_output")

# Hugging Face configs without a ``base_model_tp_plan`` whose layers pipecut splits all the same,
# by ``config.model_type``. GPT-2's ``Conv1D`` layers run ``addmm`` on ``(in, out)`` weights, and
# ``c_attn`` packs q, k and v side by side in one: each rank keeps its heads' slice of each.
# OPT-style layers (q, k, v and out projections, fc1 and fc2: OPT, BioGPT), StableLM's
# Llama-style ones, GPT-Neo's and CTRL's are split as Megatron splits them. (GPT-NeoX's plan on
# GPT-NeoX-Japanese, Persimmon and BLOOM is refused by the op rules: a view folding the split heads
# into the batch dim, a select on them; they are left without a plan, refused from config.json.)
_OPT_LAYER = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
              "self_attn.out_proj": "rowwise", "fc1": "colwise", "fc2": "rowwise"}
_LLAMA_LAYER = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                "mlp.down_proj": "rowwise"}
DERIVED_PLANS: dict[str, dict[str, str]] = {
    "gpt2": {"h.*.attn.c_attn": "packed_colwise", "h.*.attn.c_proj": "rowwise",
             "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"},
    "opt": {f"decoder.layers.*.{k}": v for k, v in _OPT_LAYER.items()},
    "biogpt": {f"layers.*.{k}": v for k, v in _OPT_LAYER.items()},
    "stablelm": {f"layers.*.{k}": v for k, v in _LLAMA_LAYER.items()},
    "gpt_neo": {"h.*.attn.attention.q_proj": "colwise", "h.*.attn.attention.k_proj": "colwise",
                "h.*.attn.attention.v_proj": "colwise", "h.*.attn.attention.out_proj": "rowwise",
                "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"},
    "ctrl": {"h.*.multi_head_attention.Wq": "colwise", "h.*.multi_head_attention.Wk": "colwise",
             "h.*.multi_head_attention.Wv": "colwise", "h.*.multi_head_attention.dense": "rowwise",
             "h.*.ffn.0": "colwise", "h.*.ffn.2": "rowwise"},
}


@dataclass(frozen=True)
class TensorParallelLayout:
    """What :func:`parallelize_stage` did to a stage.

    Attributes:
        tp: ranks in the group.
        sharded: sharded parameter name -> the dim split over ``tp`` (0 rows, 1 columns).
        forward_all_reduces: all-reduces one forward of the stage runs (one per row-parallel layer).
        backward_all_reduces: all-reduces one backward runs (one per input of column-parallel layers).
        packed: sharded parameter name -> the parts it packs (``packed_colwise`` layers only).
        kept_whole: planned ``colwise`` weights left whole on every rank: they project to fewer
            heads than ``tp`` (grouped-query attention's k and v); each rank takes its queries'
            heads of their output at the attention (one more all-reduce backward for each).
    """

    tp: int
    sharded: Mapping[str, int]
    forward_all_reduces: int
    backward_all_reduces: int
    packed: Mapping[str, int] = field(default_factory=dict)
    kept_whole: tuple[str, ...] = ()


def plan_for(patterns: Mapping[str, str], names: Iterable[str]) -> dict[str, str]:
    """Map a Hugging Face style tp plan onto a stage's parameter names.

    A pattern names a module relative to the base model (``layers.*.self_attn.q_proj``, ``*``
    one path segment); it matches a parameter whose owner's path is the pattern or ends with
    ``.`` + the pattern (``model.layers.3.self_attn.q_proj.weight`` in a ``...ForCausalLM``).

    Args:
        patterns: module pattern -> style (``config.base_model_tp_plan``, or a user's plan).
        names: the stage's parameter names.

    Returns:
        Parameter name -> its style (one of :data:`STYLES`), for the parameters a pattern matches.

    Raises:
        TensorParallelError: a pattern matching one of ``names`` has a style this module does
            not implement (``mla_kv_a_proj``, ``local_params``...): the message lists the weights
            it matches. Styles of :data:`WHOLE_STYLES` (and every entry under a ``moe_tp_experts``
            one) shard nothing: their weights stay whole.
    """
    whole = whole_entries(patterns)
    if whole:
        log.debug("tp plan entries kept whole: %s", {p: patterns[p] for p in sorted(whole)})
    compiled = [(re.compile(r"(?:^|.*\.)" + re.escape(p).replace(r"\*", r"[^.]+") + r"$"), p, s)
                for p, s in patterns.items() if p not in whole]
    out: dict[str, str] = {}
    names = list(names)
    for name in names:
        owner = name.rpartition(".")[0]
        for rx, pattern, style in compiled:
            if not rx.match(owner):
                continue
            if style not in STYLES:
                raise _unknown_style(pattern, style, [n for n in names if rx.match(n.rpartition(".")[0])])
            out[name] = style
            break
    return out


def whole_entries(patterns: Mapping[str, str]) -> set[str]:
    """The entries of a tp plan that shard nothing: those of :data:`WHOLE_STYLES`, and every entry
    under a ``moe_tp_experts`` one (a MoE block's fused ``gate_up``/``down`` stay whole with it).

    Example:
        >>> sorted(whole_entries({"layers.*.mlp.experts": "moe_tp_experts", "layers.*.mlp.experts.down_proj":
        ...                       "rowwise", "layers.*.self_attn.o_proj": "rowwise"}))
        ['layers.*.mlp.experts', 'layers.*.mlp.experts.down_proj']
    """
    experts = [p for p, s in patterns.items() if s == "moe_tp_experts"]
    return {p for p, s in patterns.items() if s in WHOLE_STYLES or any(p.startswith(e + ".") for e in experts)}


def _unknown_style(pattern: str, style: str, matched: Sequence[str]) -> TensorParallelError:
    shown = ", ".join(repr(n) for n in matched[:4]) + (f" and {len(matched) - 4} more" if len(matched) > 4 else "")
    moe = "moe" in style or "expert" in pattern
    what = "expert (MoE) weights" if moe else "weights"
    why = ("each expert's matrices would have to be split, or the experts spread over the ranks (expert "
           "parallelism), neither of which pipecut does yet" if moe else "a style pipecut does not shard yet")
    return TensorParallelError(
        f"tp plan entry {pattern!r}: {style!r} matches {len(matched)} {what}: {shown}; {why} (styles pipecut "
        f"shards: {', '.join(STYLES)}): pass TensorParallel(plan=...) without the entry {pattern!r} to keep those "
        "weights whole on every tp rank (the other layers are still split), or run this model with tp=1"
    )


def config_patterns(config: Any, owner: str = "") -> dict[str, str]:
    """The tp plan's patterns for a Hugging Face config: its ``base_model_tp_plan``, else pipecut's
    own for its ``model_type`` (:data:`DERIVED_PLANS`: GPT-2).

    Args:
        config: the model's config (``None``: a model without one).
        owner: what to call the model in the error (default: the config's class).

    Raises:
        TensorParallelError: neither exists; the message shows the plan to pass instead.

    Example:
        >>> from types import SimpleNamespace
        >>> config_patterns(SimpleNamespace(model_type="gpt2"))["h.*.attn.c_attn"]
        'packed_colwise'
    """
    found = getattr(config, "base_model_tp_plan", None) or DERIVED_PLANS.get(getattr(config, "model_type", ""))
    if not found:
        raise TensorParallelError(
            f"{owner or type(config).__name__} has no base_model_tp_plan (and pipecut derives none for it): pass "
            "TensorParallel(size=..., plan={module pattern: style}) with styles 'colwise', 'rowwise' or "
            "'packed_colwise' (e.g. {'layers.*.mlp.up_proj': 'colwise', 'layers.*.mlp.down_proj': 'rowwise'})"
        )
    return dict(found)


def plan_from_config(config: Any, names: Iterable[str]) -> dict[str, str]:
    """The tp plan of a Hugging Face config (:func:`config_patterns`) on these parameter names.

    Raises:
        TensorParallelError: the config has no plan and pipecut derives none, or :func:`plan_for`
            refuses one of its styles (MoE experts).
    """
    return plan_for(config_patterns(config), names)


def parallelize_stage(
    gm: fx.GraphModule,
    plan: Mapping[str, str],
    group: Any,
) -> TensorParallelLayout:
    """Shard ``gm``'s planned weights over ``group`` and rewrite its graph to compute the same function.

    ``gm`` (a stage, blocks outlined or not) is changed in place: the parameters in ``plan``
    become ``DTensor`` shards under the same names, and each graph it holds is rewritten and
    recompiled. It still takes and returns whole tensors, equal (to round-off: the row-parallel
    sums run in another order) to what it computed before, on every rank of the group. Every
    rank must hold the same weights before (the stage built alike on each) and call this alike.

    Args:
        gm: the stage module, traced to ``aten`` ops (``torch.export``: Hugging Face models).
        plan: parameter name -> ``'colwise'`` | ``'rowwise'`` | ``'packed_colwise'`` (:func:`plan_for`,
            :func:`plan_from_config`); a bias follows its weight. A packed layer holds ``k``
            outputs side by side (GPT-2's ``c_attn``: q, k, v), split into them right after:
            each rank keeps its slice of each part (``k`` is read from that split).
        group: the tensor-parallel ``ProcessGroup`` or a 1-D ``DeviceMesh``.

    Returns:
        What was sharded and the all-reduces a forward and a backward run.

    Raises:
        TensorParallelError: a planned weight is not read by one ``aten.linear`` or ``Conv1D``
            ``aten.addmm`` of the graph (an embedding, a weight tied elsewhere), a split dim is not
            divisible by ``tp`` (heads, kv heads, hidden units), or the sharded activations reach
            an op with no rule or leave the stage (a cut between a column layer and its row layer).

    Example:
        >>> import torch.distributed as dist  # doctest: +SKIP
        >>> layout = parallelize_stage(stage, plan_from_config(cfg, names), dist.group.WORLD)  # doctest: +SKIP
        >>> layout.forward_all_reduces  # doctest: +SKIP
        4
    """
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise TensorParallelError(f"the tp mesh must be 1-D; got {group.ndim} dims {group.mesh_dim_names}: "
                                      "pass mesh['tp']")
        mesh, pg = group, group.get_group()
    else:
        pg = group
        device = next((p.device.type for p in gm.parameters()), "cpu")
        mesh = DeviceMesh.from_group(pg, device)
    tp, rank = dist.get_world_size(pg), dist.get_rank(pg)
    params = dict(gm.named_parameters(remove_duplicate=False))
    unknown = sorted(set(plan) - set(params))
    if unknown:
        raise TensorParallelError(f"tp plan names {len(unknown)} parameter(s) this stage does not hold, e.g. "
                                  f"{unknown[0]!r}: map the plan onto this stage's names with plan_for")
    bad = {n: s for n, s in plan.items() if s not in STYLES}
    if bad:
        n, s = next(iter(bad.items()))
        raise TensorParallelError(f"{n!r}: style {s!r} is not one of {STYLES}")
    rw = _Rewriter(gm, plan, pg, tp)
    for prefix, sub in list(gm.named_modules()):
        if isinstance(sub, fx.GraphModule):
            rw.rewrite(sub, prefix + "." if prefix else "")
    missed = sorted(set(plan) - rw.seen, key=lambda n: (not n.endswith("weight"), n))
    if missed:
        reader = rw.readers.get(missed[0], "no op")
        raise TensorParallelError(
            f"{missed[0]!r} is in the tp plan but is read by {reader}, not as the weight of an aten.linear or a "
            "Conv1D's aten.addmm: only those layers are split; drop it from the plan to keep it whole"
        )
    for name, dim in rw.sharded.items():
        owner_path, _, leaf = name.rpartition(".")
        shard = _shard(params[name].detach(), dim, rw.packed.get(name, 1), mesh, tp, rank)
        setattr(gm.get_submodule(owner_path), leaf, nn.Parameter(shard, requires_grad=params[name].requires_grad))
    layout = TensorParallelLayout(tp=tp, sharded=dict(rw.sharded), forward_all_reduces=rw.reduces,
                                  backward_all_reduces=rw.enters, packed=dict(rw.packed), kept_whole=tuple(rw.whole))
    if rw.whole:
        log.info("kept whole on every tp rank (fewer heads than tp=%d; each rank takes its queries' heads at the "
                 "attention): %s", tp, ", ".join(rw.whole))
    log.info("tensor parallel over %d ranks: %d weights sharded, %d all-reduces a forward, %d a backward",
             tp, len(layout.sharded), layout.forward_all_reduces, layout.backward_all_reduces)
    return layout


def _shard(whole: torch.Tensor, dim: int, k: int, mesh: Any, tp: int, rank: int) -> Any:
    """This rank's shard of ``whole`` as a ``DTensor``: rows (or columns) ``rank / tp`` of it, or of
    each of its ``k`` packed parts, side by side (``_StridedShard``: its ``full_tensor()`` is
    ``whole`` again, parts in place)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    part = whole.shape[dim] // k // tp
    local = torch.cat([p.narrow(dim, rank * part, part) for p in whole.chunk(k, dim)], dim).clone()
    placement = Shard(dim) if k == 1 else _StridedShard(dim, split_factor=k)
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=whole.shape, stride=whole.stride())


class _Rewriter:
    """Rewrites the graphs of one stage; collects what it sharded and the collectives it added."""

    def __init__(self, root: fx.GraphModule, plan: Mapping[str, str], group: Any, tp: int) -> None:
        self.root, self.plan, self.group, self.tp = root, plan, group, tp
        self.sharded: dict[str, int] = {}
        self.packed: dict[str, int] = {}
        self.seen: set[str] = set()
        self.reduces = self.enters = 0
        self.readers: dict[str, str] = {}  # planned parameter -> the op that reads it, for errors
        self.whole: list[str] = []  # planned weights kept whole: fewer heads than tp

    def rewrite(self, gm: fx.GraphModule, prefix: str) -> None:
        graph = gm.graph
        local: dict[fx.Node, int] = {}  # node -> its sharded dim
        packed: dict[fx.Node, int] = {}  # node -> the parts a packed layer's output holds, until split
        entered: dict[fx.Node, fx.Node] = {}
        changed = False
        for node in list(graph.nodes):
            if node.op == "get_attr" and prefix + str(node.target) in self.plan and node.users:
                user = next(iter(node.users))
                self.readers[prefix + str(node.target)] = f"{user.name} ({user.target})"
            if node.op == "call_module" and not isinstance(gm.get_submodule(str(node.target)), fx.GraphModule):
                mod = gm.get_submodule(str(node.target))
                held = [prefix + str(node.target) + "." + n for n, _ in mod.named_parameters()]
                if any(h in self.plan for h in held):
                    raise TensorParallelError(
                        f"node {node.name}: layer {prefix}{node.target} is called as a module (an fx trace), "
                        "so its weights cannot be split in the graph: trace the model with torch.export "
                        "(pipecut's default for Hugging Face models) or drop it from the tp plan")
            layer = _layer(node)
            if layer is not None:
                style = self._style(prefix, node, layer[1])
                if style is not None and not self._kept_whole(prefix, node, style, layer):
                    self._split_layer(gm, prefix, node, style, layer, local, packed, entered)
                    changed = True
                    continue
            ins = [a for a in node.all_input_nodes if a in local]
            if not ins:
                continue
            if op_name(node) == "scaled_dot_product_attention":
                self._select_heads(gm, node, local)
            if op_name(node) in ELEMENTWISE:
                self._enter_whole(gm, node, local, entered)
            if node.op == "output":
                raise TensorParallelError(
                    f"{prefix or 'the stage'}: {ins[0].name} leaves the graph split over tp (a cut between a "
                    "column-parallel layer and its row-parallel layer): cut the pipeline between blocks")
            d = propagate(node, local, packed, self.tp)
            if d is not None:
                local[node] = d
            changed = True
        if changed:
            graph.lint()
            gm.recompile()

    def _style(self, prefix: str, node: fx.Node, w: Any) -> str | None:
        if not (isinstance(w, fx.Node) and w.op == "get_attr"):
            return None
        name = prefix + str(w.target)
        style = self.plan.get(name)
        if style is None:
            return None
        users = [u for u in w.users if u is not node]
        if users:
            raise TensorParallelError(f"{name!r} (tp {style}) is read by {users[0].name} besides {node.name}: a "
                                      "weight tied to another op stays whole; drop it from the tp plan")
        return style

    def _kept_whole(self, prefix: str, node: fx.Node, style: str, layer: _Layer) -> bool:
        """Whether a ``colwise`` layer projects to fewer heads than ``tp`` (grouped-query attention's
        k and v with kv heads < tp): it then stays whole on every rank, and each rank takes the
        heads its queries use at the attention (:meth:`_select_heads`)."""
        heads = _head_count(node) if style == "colwise" else None
        if heads is None or heads % self.tp == 0 or self.tp % heads:
            return False
        w, b = layer[1], layer[2]
        self.seen.add(prefix + str(w.target))
        if isinstance(b, fx.Node) and b.op == "get_attr":
            self.seen.add(prefix + str(b.target))
        self.whole.append(prefix + str(w.target))
        return True

    def _enter_whole(self, gm: fx.GraphModule, node: fx.Node, local: dict[fx.Node, int],
                     entered: dict[fx.Node, fx.Node]) -> None:
        """A whole tensor combined with a split one (a per-head norm's weight times this rank's
        heads, a gate broadcast over them): each rank's gradient of it covers its own part only,
        so it is read through :class:`_Enter`, whose backward all-reduces it over tp (only when
        it needs a gradient: a constant, cos or sin, a mask runs no collective). This is what
        transformers' ``replicated_with_grad_allreduce`` asks for, done wherever it is needed."""
        for arg in dict.fromkeys(node.all_input_nodes):
            if arg in local or not isinstance(arg.meta.get("val"), torch.Tensor):
                continue
            source = _gradient_source(gm, arg)
            if source is None:
                continue  # made of buffers, constants and integer inputs only (cos, sin, a mask): no gradient
            if arg not in entered:
                path = _free(gm, "pipecut_tp_whole")
                gm.add_submodule(path, TensorParallelIn(self.group))
                with gm.graph.inserting_before(node):
                    entered[arg] = gm.graph.call_module(path, (arg,))
                entered[arg].meta = dict(arg.meta)
                # Counted where a weight's gradient surely runs it; a stage input runs it only when
                # it arrives with a gradient (the previous stage's activations, not its cos/sin).
                self.enters += source == "weight"
            node.replace_input_with(arg, entered[arg])

    def _select_heads(self, gm: fx.GraphModule, node: fx.Node, local: dict[fx.Node, int]) -> None:
        """Attention with split queries and whole keys or values (kv heads < tp, repeated to every
        query head): each rank takes the heads of its queries (and all-reduces their gradient)."""
        q, *kv = node.args[:3]
        heads = len(shape_of(node)) - 3
        if local.get(q) != heads:  # type: ignore[arg-type]
            return
        for t in dict.fromkeys(kv):
            if not isinstance(t, fx.Node) or t in local:
                continue
            n = shape_of(t)[heads] // self.tp
            path = _free(gm, "pipecut_tp_heads")
            gm.add_submodule(path, TensorParallelHeads(self.group, heads, n))
            with gm.graph.inserting_before(node):
                sel = gm.graph.call_module(path, (t,))
            sel.meta = dict(t.meta)
            node.replace_input_with(t, sel)
            local[sel] = heads
            self.enters += 1

    def _split_layer(self, gm: fx.GraphModule, prefix: str, node: fx.Node, style: str, layer: _Layer,
                     local: dict[fx.Node, int], packed: dict[fx.Node, int], entered: dict[fx.Node, fx.Node]) -> None:
        graph = gm.graph
        x, w, b, conv = layer
        wname = prefix + str(w.target)
        shape = tuple(gm.get_parameter(str(w.target)).shape)
        col = style in _COLUMN
        dim = (1 if conv else 0) if col else (0 if conv else 1)  # a Conv1D's weight is (in, out)
        k = _packed_parts(node, wname) if style == "packed_colwise" else 1
        if shape[dim] % (k * self.tp):
            what = ("output features (heads x head dim, or hidden units)" if col else "input features") + (
                f" in {k} packed parts" if k > 1 else "")
            raise TensorParallelError(f"{wname!r} ({style}) has {shape[dim]} {what}, not divisible by "
                                      f"{k * self.tp} ({k} parts x tp={self.tp}): pick a tp that divides "
                                      f"{shape[dim] // k}")
        self.sharded[wname] = dim
        self.seen.add(wname)
        if k > 1:
            self.packed[wname] = k
        owner = str(w.target).rpartition(".")[0]
        with graph.inserting_before(node):
            wl = graph.call_method("to_local", (w,))
            wl.meta = dict(node.meta)
            node.replace_input_with(w, wl)
            if isinstance(b, fx.Node) and b.op == "get_attr":
                bname = prefix + str(b.target)
                self.seen.add(bname)
                if col:
                    self.sharded[bname] = 0
                    if k > 1:
                        self.packed[bname] = k
                    bl = graph.call_method("to_local", (b,))
                    bl.meta = dict(node.meta)
                    node.replace_input_with(b, bl)
        if col:
            if x in local:
                raise TensorParallelError(f"node {node.name}: {wname!r} is {style} but its input {x.name} is already "
                                          "split over tp (two column-parallel layers in a row): make the first rowwise")
            if x not in entered:
                path = _free(gm, owner + ".pipecut_tp_in")
                gm.add_submodule(path, TensorParallelIn(self.group))
                with graph.inserting_before(node):
                    entered[x] = graph.call_module(path, (x,))
                entered[x].meta = dict(node.meta)
                self.enters += 1
            node.replace_input_with(x, entered[x])
            if style == "colwise_gather_output":  # whole again after it: this rank's columns gathered
                path = _free(gm, owner + ".pipecut_tp_gather")
                gm.add_submodule(path, TensorParallelGather(self.group))
                with graph.inserting_after(node):
                    gathered = graph.call_module(path, (node,))
                gathered.meta = dict(node.meta)
                node.replace_all_uses_with(gathered, delete_user_cb=lambda user: user is not gathered)
                self.reduces += 1
                return
            local[node] = len(shape_of(node)) - 1
            if k > 1:
                packed[node] = k
            return
        if style == "rowwise_split_input":  # a whole input: each rank takes its columns of it
            if x in local:
                raise TensorParallelError(f"node {node.name}: {wname!r} is rowwise_split_input but its input {x.name} "
                                          "is already split over tp: make it 'rowwise'")
            path = _free(gm, owner + ".pipecut_tp_split")
            gm.add_submodule(path, TensorParallelSplit(self.group))
            with graph.inserting_before(node):
                part_in = graph.call_module(path, (x,))
            part_in.meta = dict(x.meta)
            node.replace_input_with(x, part_in)
            x = part_in
            local[x] = len(shape_of(x)) - 1
            self.enters += 1
        if local.get(x) != len(shape_of(x)) - 1 or x in packed:
            where = "whole on every rank" if x not in local else (
                f"split on dim {local[x]}, not its last" if x not in packed else "a packed layer's output")
            raise TensorParallelError(f"node {node.name}: {wname!r} is rowwise but its input {x.name} is {where}: "
                                      "a row-parallel layer must follow its column-parallel ones in the same stage")
        # The sum of the ranks' partial products first, the bias once after it.
        with graph.inserting_before(node):
            if conv:
                part = graph.call_function(torch.ops.aten.mm.default, (x, node.args[2]))
            else:
                part = graph.call_function(torch.ops.aten.linear.default, (x, node.args[1]))
        part.meta = dict(node.meta)
        path = _free(gm, owner + ".pipecut_tp_out")
        gm.add_submodule(path, TensorParallelOut(self.group))
        with graph.inserting_after(part):
            last = red = graph.call_module(path, (part,))
        red.meta = dict(node.meta)
        if b is not None:
            with graph.inserting_after(red):
                last = graph.call_function(torch.ops.aten.add.Tensor, (red, b))
            last.meta = dict(node.meta)
        node.replace_all_uses_with(last)
        graph.erase_node(node)
        self.reduces += 1


# A layer the rewrite splits: (input, weight, bias or None, whether it is a Conv1D's addmm on an (in, out) weight).
_Layer = tuple[fx.Node, fx.Node, Any, bool]


def _layer(node: fx.Node) -> _Layer | None:
    """``node`` as a layer, when it is an ``aten.linear`` or a ``Conv1D``'s ``aten.addmm(bias, x, W)``."""
    if node.op != "call_function":
        return None
    op, a = op_name(node), node.args
    if op == "linear" and isinstance(a[0], fx.Node) and isinstance(a[1], fx.Node):
        return a[0], a[1], a[2] if len(a) > 2 else node.kwargs.get("bias"), False
    if op == "addmm" and isinstance(a[1], fx.Node) and isinstance(a[2], fx.Node):
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return None  # not a Conv1D: its weight, if planned, is refused as not read by a layer
        return a[1], a[2], a[0], True
    return None


def _free(gm: nn.Module, path: str) -> str:
    """``path``, or ``path`` + ``_1``, ``_2``... where a module is already installed there."""
    taken = dict(gm.named_modules())
    out, k = path, 0
    while out in taken:
        k += 1
        out = f"{path}_{k}"
    return out
