"""What each stage holds, read off a plan's cut: whole layers in model order, or a typed refusal."""

from __future__ import annotations

import pytest
from gen_cases import build

from runtime.generate import CutInsideBlockError, StageSpan, decoder_parts
from runtime.generate.cut import spans_from_parts

pytest.importorskip("transformers")


def _found(stage_of_layer: list[int], embed: int = 0, norm: int = 1, head: int = 1) -> dict[str, set[int]]:
    found = {"model.embed_tokens": {embed}, "model.norm": {norm}, "lm_head": {head}}
    found.update({f"model.layers.{i}": {s} for i, s in enumerate(stage_of_layer)})
    return found


def test_spans_follow_the_stages_of_the_parts() -> None:
    parts = decoder_parts(build("llama"))
    spans = spans_from_parts(parts, _found([0, 0, 1, 2], norm=2, head=3), 4)
    assert spans == (
        StageSpan(0, embed=True, layers=range(2), norm=False, head=False),
        StageSpan(1, embed=False, layers=range(2, 3), norm=False, head=False),
        StageSpan(2, embed=False, layers=range(3, 4), norm=True, head=False),
        StageSpan(3, embed=False, layers=range(0), norm=False, head=True),
    )


def test_a_cut_inside_a_layer_is_refused_with_the_layer_and_its_stages() -> None:
    parts = decoder_parts(build("llama"))
    found = _found([0, 0, 1, 1])
    found["model.layers.1"] = {0, 1}
    with pytest.raises(CutInsideBlockError, match=r"cuts inside model.layers.1 \(stages \[0, 1\]\).*granularity"):
        spans_from_parts(parts, found, 2)


def test_parts_out_of_model_order_or_missing_are_refused() -> None:
    parts = decoder_parts(build("llama"))
    order = r"puts model\.layers\.2 on stage 0, before model\.layers\.1 on stage 1"
    with pytest.raises(CutInsideBlockError, match=order):
        spans_from_parts(parts, _found([0, 1, 0, 1]), 2)
    found = _found([0, 0, 1, 1])
    del found["lm_head"]
    with pytest.raises(CutInsideBlockError, match=r"no stage of the plan computes \['lm_head'\]"):
        spans_from_parts(parts, found, 2)
