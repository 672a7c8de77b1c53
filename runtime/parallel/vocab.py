"""Vocabulary parallelism: a stage's token embedding and LM head split over the tp ranks by vocabulary
rows, and the loss taken on logits sharded over the classes (torch's ``loss_parallel``).

Legend: ``tp`` ranks of the tensor-parallel group, ``t`` this rank in it, ``V`` the vocabulary,
``n = V / tp`` the rows a rank holds (``[t n, (t + 1) n)``), shapes ``(B, T, C)``.

Both weights are ``(V, C)`` and both are split by rows, so a weight tied between the first stage
and the last (GPT-2's ``wte`` and ``lm_head``) is split the same way on both, and the tie still
holds shard by shard (``runtime.parallel.tied`` sums rank ``t``'s shard of each). Each is a
``Shard(0)`` ``DTensor`` parameter, so checkpoints, exports, weight loading, clipping and AdamW take
it as they take the other tp shards.

- **Embedding** (an ``aten.embedding`` reading the weight): each rank looks up the ids in its
  range, a zero row for the others, and one all-reduce (sum) over the group gives the whole
  ``(B, T, C)`` output; backward each rank's rows get the gradient of their own ids only. Exact:
  the sum adds one value to zeros, and the gradient of a row is summed over the same positions.
- **LM head** (an ``aten.linear`` reading the weight, on the last stage only): column-parallel,
  each rank computing the logits of its ``n`` classes, ``(B, T, n)``, returned as a ``DTensor``
  ``Shard(-1)`` of ``(B, T, V)``. The whole logits are never built: the executor calls the user's
  ``loss_fn`` on them under :func:`sharded_loss` (``loss_parallel``: ``F.cross_entropy`` runs as
  a max, a sum of exponentials and the target's logit, each all-reduced over ``tp``), and its
  backward too; :func:`plain_loss` refuses a loss that gathered the logits whole.

Example:
    >>> vocab_rows(96, tp=2, rank=1)
    (48, 96)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils._python_dispatch import TorchDispatchMode

from runtime.parallel.tensor import _free
from runtime.parallel.tensor_collectives import TensorParallelIn, TensorParallelOut
from runtime.parallel.tensor_rules import TensorParallelError, op_name

__all__ = [
    "Gathers", "VocabLayout", "VocabLossError", "VocabParallelError", "parallelize_vocab", "plain_loss", "sharded_loss",
    "vocab_head", "vocab_names", "vocab_rows", "whole_outputs",
]

log = logging.getLogger(__name__)

_DROP = "or drop TensorParallel(vocab=True) to keep the embedding and the LM head whole on every tp rank"


class VocabParallelError(TensorParallelError):
    """The embedding or the LM head cannot be split over the vocabulary (its size, where or how it is
    read); the message names the weight and the way out."""


class VocabLossError(VocabParallelError):
    """``loss_fn`` cannot run on logits sharded over the classes (``loss_parallel`` does not support
    it, or it gathered the logits whole); the message says what it supports."""


@dataclass(frozen=True)
class VocabLayout:
    """What :func:`parallelize_vocab` did to a stage.

    Attributes:
        vocab: ``V``, the rows of the split weights.
        rows: this rank's rows ``[start, stop)``.
        embeddings: the weights split that an ``aten.embedding`` reads.
        heads: the weights split that an ``aten.linear`` (the LM head) reads.
    """

    vocab: int
    rows: tuple[int, int]
    embeddings: tuple[str, ...] = ()
    heads: tuple[str, ...] = ()


def vocab_rows(vocab: int, *, tp: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s rows ``[start, stop)`` of a ``V``-row weight split over ``tp`` ranks.

    Raises:
        VocabParallelError: ``V`` is not divisible by ``tp``.
    """
    if vocab % tp:
        raise VocabParallelError(
            f"the vocabulary has {vocab} rows, not divisible by tp={tp}: pad the vocabulary to a multiple of "
            f"{tp} (resize_token_embeddings(pad_to_multiple_of={tp}) in transformers), pick a tp dividing "
            f"{vocab}, {_DROP}")
    n = vocab // tp
    return rank * n, (rank + 1) * n


def vocab_names(model: nn.Module) -> frozenset[str]:
    """Every name (aliases of a tied weight included) of the model's input and output embedding
    weights, as a Hugging Face model names them (``get_input_embeddings()``,
    ``get_output_embeddings()``; a plain module may define the two methods).

    Raises:
        VocabParallelError: the model has neither method, or they return no ``(V, C)`` weight.
    """
    found: list[nn.Parameter] = []
    for method in ("get_input_embeddings", "get_output_embeddings"):
        get = getattr(model, method, None)
        layer = get() if callable(get) else None
        weight = getattr(layer, "weight", None)
        if isinstance(weight, nn.Parameter) and weight.dim() == 2:
            found.append(weight)
    if not found:
        raise VocabParallelError(
            f"{type(model).__name__} has no get_input_embeddings() / get_output_embeddings() returning a layer with a "
            "2-D weight, so the vocabulary's weights are not known: define them on the model (a Hugging Face model "
            f"has them), {_DROP}")
    ids = {id(w) for w in found}
    return frozenset(n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids)


def parallelize_vocab(
    gm: fx.GraphModule, names: frozenset[str], mesh: Any, *, last: bool,
    shared: dict[int, tuple[nn.Parameter, nn.Parameter]] | None = None,
) -> VocabLayout | None:
    """Split the vocabulary weights ``gm`` reads (an embedding, an LM head) by rows over ``mesh``, in place.

    Args:
        gm: a stage module (blocks outlined or not), after ``parallelize_stage``.
        names: the vocabulary weights' names (:func:`vocab_names`).
        mesh: the tp group as a 1-D ``DeviceMesh``.
        last: whether ``gm`` is the model's last stage: only there may an LM head be split (its
            logits leave the stage sharded, for the loss).
        shared: a whole parameter's id -> it and its shard, shared by the stages of one process
            so that a weight two of them read stays one parameter.

    Returns:
        What was split, or ``None``: the stage reads none of ``names``.

    Raises:
        VocabParallelError: ``V`` not divisible by tp; a vocabulary weight read by another op than
            an ``aten.embedding`` or an ``aten.linear``; an LM head on a stage other than the last;
            an embedding with ``scale_grad_by_freq`` or ``sparse``.
    """
    from torch.distributed.tensor import DTensor, Shard

    params = dict(gm.named_parameters(remove_duplicate=False))
    mine = {n: p for n, p in params.items() if n in names and not isinstance(p, DTensor)}
    if not mine:
        return None
    tp, t = mesh.size(), mesh.get_local_rank()
    sizes = {n: int(p.shape[0]) for n, p in mine.items()}
    vocab = max(sizes.values())
    if len(set(sizes.values())) > 1:
        raise VocabParallelError(f"the vocabulary's weights have different row counts ({sizes}): {_DROP}")
    start, stop = vocab_rows(vocab, tp=tp, rank=t)
    shared = {} if shared is None else shared
    embeddings: list[str] = []
    heads: list[str] = []
    group = mesh.get_group()
    for prefix, sub in list(gm.named_modules()):
        if not isinstance(sub, fx.GraphModule):
            continue
        pre = prefix + "." if prefix else ""
        changed = False
        for node in list(sub.graph.nodes):
            if node.op != "get_attr" or pre + str(node.target) not in mine:
                continue
            name = pre + str(node.target)
            local = None
            for user in list(node.users):
                if local is None:
                    with sub.graph.inserting_after(node):
                        local = sub.graph.call_method("to_local", (node,))
                    local.meta = dict(node.meta)
                kind = _rewrite_reader(sub, user, node, local, name, group, mesh, (start, stop), last)
                (embeddings if kind == "embedding" else heads).append(name)
                changed = True
        if changed:
            sub.graph.lint()
            sub.recompile()
    read = {id(params[n]) for n in embeddings + heads}
    unread = sorted(n for n, p in mine.items() if id(p) not in read)
    if unread:
        raise VocabParallelError(
            f"{unread[0]!r} is held by this stage but not read through the graph (a layer called as a module: an fx "
            "trace), so it cannot be split by rows: trace the model with torch.export (pipecut's default for Hugging "
            f"Face models), {_DROP}")
    for prm in mine.values():
        if id(prm) not in shared:
            local_rows = prm.detach()[start:stop].clone()
            shard = DTensor.from_local(local_rows, mesh, [Shard(0)], run_check=False)
            shared[id(prm)] = (prm, nn.Parameter(shard, requires_grad=prm.requires_grad))
    for _, mod in gm.named_modules(remove_duplicate=False):
        for leaf, prm in list(mod._parameters.items()):
            if prm is not None and id(prm) in shared and shared[id(prm)][0] is prm:
                mod._parameters[leaf] = shared[id(prm)][1]
    layout = VocabLayout(vocab, (start, stop), tuple(dict.fromkeys(embeddings)), tuple(dict.fromkeys(heads)))
    log.info("vocabulary split over tp=%d: rows [%d, %d) of %d; embeddings %s, LM heads %s", tp, start, stop,
             vocab, list(layout.embeddings), list(layout.heads))
    return layout


def _rewrite_reader(
    gm: fx.GraphModule, user: fx.Node, w: fx.Node, local: fx.Node, name: str, group: Any, mesh: Any,
    rows: tuple[int, int], last: bool,
) -> str:
    """Rewrite one op reading the vocabulary weight ``w`` to read its rows ``local``; returns its kind."""
    graph, op, args, kw = gm.graph, op_name(user), list[Any](user.args), dict[str, Any](user.kwargs)
    where = f"{name!r} (node {user.name}, {user.target})"
    if op == "embedding" and args[0] is w:
        pad = int(args[2] if len(args) > 2 else kw.get("padding_idx", -1))
        by_freq = bool(args[3] if len(args) > 3 else kw.get("scale_grad_by_freq", False))
        sparse = bool(args[4] if len(args) > 4 else kw.get("sparse", False))
        if by_freq or sparse:
            raise VocabParallelError(f"{where}: an embedding with scale_grad_by_freq or sparse gradients cannot be "
                                     f"split over the vocabulary (each rank would count only its own ids): {_DROP}")
        path = _free(gm, "pipecut_vocab_embedding")
        gm.add_submodule(path, VocabEmbedding(group, rows, pad))
        with graph.inserting_before(user):
            new = graph.call_module(path, (local, args[1]))
        new.meta = dict(user.meta)
        user.replace_all_uses_with(new)
        graph.erase_node(user)
        return "embedding"
    if op == "linear" and args[1] is w and isinstance(args[0], fx.Node):
        if not last:
            raise VocabParallelError(f"{where}: an LM head on a stage other than the model's last: its logits would "
                                     f"leave the stage split over the vocabulary; cut the pipeline after it, {_DROP}")
        bias = args[2] if len(args) > 2 else kw.get("bias")
        if bias is not None:
            raise VocabParallelError(f"{where}: an LM head with a bias is not split over the vocabulary yet: {_DROP}")
        path = _free(gm, "pipecut_vocab_in")
        gm.add_submodule(path, TensorParallelIn(group))
        head = _free(gm, "pipecut_vocab_logits")
        gm.add_submodule(head, VocabLogits(mesh))
        with graph.inserting_before(user):
            x = graph.call_module(path, (args[0],))
            part = graph.call_function(torch.ops.aten.linear.default, (x, local))
            out = graph.call_module(head, (part,))
        for n in (x, part, out):
            n.meta = dict(user.meta)
        user.replace_all_uses_with(out)
        graph.erase_node(user)
        return "head"
    raise VocabParallelError(f"{where}: a vocabulary weight read by something else than an aten.embedding or an "
                             f"aten.linear (the LM head) cannot be split by rows: {_DROP}")


class VocabEmbedding(nn.Module):
    """An embedding over this rank's rows ``[start, stop)``: the ids outside read a zero row, and the
    ranks' outputs are summed (:class:`TensorParallelOut`: all-reduce forward, identity backward)."""

    def __init__(self, group: Any, rows: tuple[int, int], padding_idx: int) -> None:
        super().__init__()
        self.start, self.stop = rows
        self.padding_idx = padding_idx - self.start if self.start <= padding_idx < self.stop else -1
        self.reduce = TensorParallelOut(group)

    def forward(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)
        local = torch.where(outside, torch.zeros_like(ids), ids - self.start)
        # (B, T, C): masked to exact zeros, so the sum is exact and row 0 gets no gradient from them.
        out = torch.ops.aten.embedding.default(weight, local, self.padding_idx).masked_fill(outside.unsqueeze(-1), 0)
        return self.reduce(out)  # type: ignore[no-any-return]


class VocabLogits(nn.Module):
    """This rank's logits ``(B, T, n)`` as the ``DTensor`` ``Shard(-1)`` of the whole ``(B, T, V)``
    (differentiable: the gradient comes back as this rank's classes)."""

    def __init__(self, mesh: Any) -> None:
        super().__init__()
        self.mesh = mesh

    def forward(self, local: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(local, self.mesh, [Shard(local.dim() - 1)], run_check=False)


def vocab_head(module: nn.Module) -> bool:
    """Whether a stage returns logits sharded over the vocabulary (its loss must run under :func:`sharded_loss`)."""
    return any(isinstance(m, VocabLogits) for m in module.modules())


_active = [0]  # loss_parallel's switch is global and not reentrant: a replayed loss runs inside a backward


@contextlib.contextmanager
def sharded_loss() -> Iterator[None]:
    """torch's ``loss_parallel()`` (cross-entropy on class-sharded ``DTensor`` logits), reentrant,
    and switched off again when the body raises."""
    if _active[0]:
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel

    ctx = loss_parallel()
    ctx.__enter__()
    _active[0] = 1
    try:
        yield
    finally:
        _active[0] = 0
        ctx.__exit__(None, None, None)


def plain_loss(loss_fn: Callable[[Any, Any], Any], out: Any, target: Any, where: str) -> Any:
    """``loss_fn(out, target)`` on logits sharded over the vocabulary, as a plain tensor.

    Runs under :func:`sharded_loss`, watching the collectives it runs (:class:`Gathers`): an
    all-gather means the loss built the whole logits (an op ``loss_parallel`` does not cover), which
    is refused.

    Raises:
        VocabLossError: ``loss_fn`` raised on the sharded logits, or gathered them.
    """
    from torch.distributed.tensor import DTensor

    supported = ("under TensorParallel(vocab=True) the logits reach loss_fn as a DTensor sharded over the classes "
                 "and loss_fn runs under torch's loss_parallel(), which computes F.cross_entropy (or F.nll_loss of "
                 "F.log_softmax) with class indices, reduction 'mean', 'sum' or 'none', without label smoothing")
    gathers = Gathers()
    try:
        with sharded_loss(), gathers:
            loss = loss_fn(out, target)
    except Exception as e:
        raise VocabLossError(f"{where}: loss_fn raised {type(e).__name__}: {e}; {supported}: write the loss that way, "
                             f"{_DROP}") from e
    if gathers.ops:
        raise VocabLossError(f"{where}: loss_fn gathered the logits whole ({', '.join(gathers.ops)}): an op on them "
                             f"that loss_parallel does not split ran on all V classes; {supported}: write the loss "
                             f"that way, {_DROP}")
    if isinstance(loss, DTensor):
        return loss.full_tensor()
    return loss


class Gathers(TorchDispatchMode):
    """Records the all-gathers run under it (``ops``), those a ``DTensor`` op makes included.

    A dispatch mode sees an op before a tensor subclass does; handing a ``DTensor`` op back
    (``NotImplemented``) lets ``DTensor`` run it and issue its collectives on local tensors, which
    this mode then sees (as torch's ``CommDebugMode`` does, without its module tracking).
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if "all_gather" in func.name() or "allgather" in func.name():
            self.ops.append(func.name())
        return func(*args, **(kwargs or {}))


def whole_outputs(outputs: Any) -> Any:
    """A stage's outputs with logits sharded over the vocabulary gathered whole (``predict``:
    the user asked for them)."""
    from torch.distributed.tensor import DTensor

    return tuple(o.full_tensor() if isinstance(o, DTensor) else o for o in outputs)
