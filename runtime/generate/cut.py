"""What each stage of a plan holds of a decoder-only LM: the embedding, a run of layers, the final norm, the head.

Legend: ``p`` stages, ``s`` a stage index, ``i`` a layer index.

The cut is the plan's. Each compute node of the traced graph belongs to a stage (``plan.stage_of()``)
and was traced inside a module (``node_module_path``); a part of the model (the embedding side,
layer ``i``, the final norm, the head) is on the stage of its nodes. A part whose nodes fall on
two stages is a cut inside it, which generation cannot run (a stage keeps the keys and values of
whole layers), so it is refused, as is a plan whose parts are not in model order along the stages.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from partitioner.plan.plan import Plan
from partitioner.tracing.trace import module_call_index, node_module_path
from runtime.generate.errors import CutInsideBlockError
from runtime.generate.parts import DecoderParts

__all__ = ["StageSpan", "stage_spans", "spans_from_parts"]


@dataclass(frozen=True)
class StageSpan:
    """The parts of the model stage ``index`` runs, in this order.

    Attributes:
        index: the stage index ``s``.
        embed: whether it embeds the tokens (it then receives token ids, not hidden states).
        layers: the model's layers it runs (and whose keys and values it keeps), in order.
        norm: whether it runs the final norm.
        head: whether it runs the LM head (it then returns logits).

    Example:
        >>> StageSpan(0, embed=True, layers=range(0, 2), norm=False, head=False)
        StageSpan(index=0, embed=True, layers=range(0, 2), norm=False, head=False)
    """

    index: int
    embed: bool
    layers: range
    norm: bool
    head: bool


def stage_spans(plan: Plan, parts: DecoderParts) -> tuple[StageSpan, ...]:
    """Each stage's span of ``parts``, read off ``plan``'s cut.

    Raises:
        PlanMismatchError: the plan was loaded from a file and not bound to the model yet.
        CutInsideBlockError: a part's nodes fall on two stages (a cut inside a layer), a part has no
            node, or the parts are not in model order along the stages; the message names them.
    """
    stage_of = plan.stage_of()
    names = [*parts.pre, *parts.layers, *([parts.norm] if parts.norm else []), parts.head]
    by_call: dict[tuple[str, int], set[int]] = {}
    for node in plan.traced.gm.graph.nodes:
        s = stage_of.get(node.name)
        if s is None:
            continue
        path = node_module_path(node)
        owner = next((n for n in names if path == n or path.startswith(n + ".")), None)
        if owner is not None:
            by_call.setdefault((owner, module_call_index(node, owner)), set()).add(s)
    # A part a forward calls more than once is where its last call is (NanoChat's final norm also
    # runs on the embeddings: that call is the embedding stage's glue).
    last = dict(sorted(by_call))  # by part: its last call
    found = {owner: stages for (owner, call), stages in by_call.items() if call == last[owner]}
    return spans_from_parts(parts, found, plan.num_stages)


def spans_from_parts(parts: DecoderParts, found: Mapping[str, set[int]], p: int) -> tuple[StageSpan, ...]:
    """The spans of ``p`` stages from the stages each part's nodes are on (``found``: part name ->
    stages). Pure: :func:`stage_spans` reads ``found`` off a plan.

    Raises:
        CutInsideBlockError: as :func:`stage_spans`.
    """
    split = {n: sorted(ss) for n, ss in found.items() if len(ss) > 1}
    if split:
        raise CutInsideBlockError(
            f"the plan cuts inside {', '.join(f'{n} (stages {ss})' for n, ss in split.items())}: a stage must "
            "hold whole layers to keep their keys and values. Re-plan with whole blocks: "
            "partition(model, inputs, p) cuts between blocks by default (granularity='module'); do not pass "
            "granularity='node' or split points inside a layer"
        )
    pre = [s for n in parts.pre for s in found.get(n, ())]
    order: list[tuple[str, int | None]] = [
        ("the embedding", min(pre) if pre else None),
        *((n, _only(found.get(n))) for n in parts.layers),
        # A family without a final norm: the head's stage takes the last layer's output as it is.
        (parts.norm or "the final norm", _only(found.get(parts.norm or parts.head))),
        (parts.head, _only(found.get(parts.head))),
    ]
    missing = [n for n, s in order if s is None]
    if missing:
        raise CutInsideBlockError(
            f"no stage of the plan computes {missing}: the plan was not made from this model's forward "
            "(partition(model, (input_ids,), p) on the same model makes one)"
        )
    if len(set(pre)) > 1:
        raise CutInsideBlockError(
            f"the plan puts the embedding modules {list(parts.pre)} on stages {sorted(set(pre))}; the "
            "generator embeds on one stage: re-plan so that they stay together"
        )
    stages = [s for _, s in order if s is not None]
    back = [(order[k][0], stages[k], order[k + 1][0], stages[k + 1]) for k in range(len(stages) - 1)
            if stages[k + 1] < stages[k]]
    if back:
        a, sa, b, sb = back[0]
        raise CutInsideBlockError(
            f"the plan puts {b} on stage {sb}, before {a} on stage {sa}: the generator runs the model's parts "
            "in order along the stages (embedding, layers, norm, head). Re-plan with partition()"
        )
    embed_stage, norm_stage, head_stage = stages[0], stages[-2], stages[-1]
    layer_stages = stages[1:-2]
    spans = []
    for s in range(p):
        mine = [i for i, ls in enumerate(layer_stages) if ls == s]
        layers = range(mine[0], mine[-1] + 1) if mine else range(0)
        spans.append(StageSpan(s, embed=s == embed_stage, layers=layers, norm=s == norm_stage, head=s == head_stage))
    return tuple(spans)


def _only(stages: set[int] | None) -> int | None:
    return None if not stages else next(iter(stages))
