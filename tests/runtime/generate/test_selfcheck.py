"""The generator takes a family's top-level arithmetic from its traced graph and checks itself on a probe.

A family nobody listed, whose forward scales its embeddings and logits, generates the model's own
tokens and logits (the glue replays its ops). A family whose difference the glue cannot see (its
forward rescales the position ids before the rotary) is refused at build by the self-check, with
the part named. A family module that raises becomes a typed error naming the part. The check
leaves the model's mode and grad mode as it found them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from gen_cases import PROMPTS, build

from partitioner import partition
from profiles import LONG
from runtime.generate import GenerateFamilyError, Generator, SelfCheckError, left_pad, self_check

transformers = pytest.importorskip("transformers")

EXAMPLE = (torch.zeros(2, 8, dtype=torch.long),)
NEW = 4


def _scaled_llama(embed_scale: float, logit_scale: float) -> Any:
    """A Llama whose top-level forward multiplies the embeddings and the logits: a family pipecut
    has never seen, whose multipliers live in its own forward only."""
    from transformers import LlamaForCausalLM, LlamaModel

    class ScaledModel(LlamaModel):
        def forward(self, input_ids: Any = None, inputs_embeds: Any = None, **kwargs: Any) -> Any:
            if inputs_embeds is None:
                inputs_embeds = self.embed_tokens(input_ids)
            return super().forward(inputs_embeds=inputs_embeds * embed_scale, **kwargs)

    class ScaledForCausalLM(LlamaForCausalLM):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.model = ScaledModel(config)
            self.post_init()

        def forward(self, input_ids: Any = None, use_cache: Any = None, **kwargs: Any) -> Any:
            out = super().forward(input_ids, use_cache=use_cache, **kwargs)
            out.logits = out.logits * logit_scale
            return out

    torch.manual_seed(0)
    return ScaledForCausalLM(build("llama").config).eval()


def test_an_unlisted_familys_top_level_scales_are_replayed_from_its_graph() -> None:
    model = _scaled_llama(3.0, 0.25)
    two = Generator(partition(model, EXAMPLE, 2))
    glue = two.parts.glue
    assert glue.ops()["embed"] == ["mul(embedding, 3.0)"] and glue.ops()["head"] == ["mul(linear, 0.25)"]
    ids, mask = left_pad(PROMPTS, pad_token_id=0)
    want = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, eos_token_id=[],
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    for gen in (two, *([Generator(partition(model, EXAMPLE, 4))] if LONG else [])):  # 4 stages: the long profile's
        got = gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0, output_logits=True)
        assert torch.equal(got.sequences, want.sequences)
        assert got.logits is not None
        torch.testing.assert_close(torch.stack(got.logits, 1), torch.stack(want.logits, 1), rtol=1e-5, atol=1e-5)


def test_a_family_whose_difference_the_glue_cannot_see_is_refused_at_build() -> None:
    from transformers import LlamaForCausalLM, LlamaModel

    class StretchedModel(LlamaModel):  # rotary positions twice the token positions: not a hidden-state op
        def forward(self, input_ids: Any = None, position_ids: Any = None, **kwargs: Any) -> Any:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
            return super().forward(input_ids=input_ids, position_ids=position_ids * 2, **kwargs)

    class Stretched(LlamaForCausalLM):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.model = StretchedModel(config)
            self.post_init()

    torch.manual_seed(0)
    model = Stretched(build("llama").config).train()
    plan = partition(model, EXAMPLE, 2)
    with pytest.raises(SelfCheckError, match=r"model.layers.0 \(stage 0\)") as caught:
        Generator(plan)
    assert caught.value.part == "model.layers.0" and caught.value.stage == 0 and caught.value.error > 0
    assert model.training and all(m.training for m in model.modules())  # the check's eval() is undone
    assert torch.is_grad_enabled()
    unchecked = Generator(plan, check=False)  # the user's way out, on their own responsibility
    with pytest.raises(SelfCheckError):
        self_check(unchecked.parts, unchecked.spans, unchecked.device)


def test_a_family_module_that_raises_is_a_typed_error_naming_the_part() -> None:
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaMLP

    class NeedsMore(LlamaMLP):  # a module that wants an input the generator does not give
        def forward(self, x: Any, extra: Any = None) -> Any:
            if extra is None:
                raise TypeError("NeedsMore.forward() missing its 'extra' input")
            return super().forward(x)

    torch.manual_seed(0)
    model = LlamaForCausalLM(build("llama").config).eval()
    plan = partition(model, EXAMPLE, 2)
    model.model.layers[1].mlp.__class__ = NeedsMore  # after the trace: the generator meets it first
    with pytest.raises(GenerateFamilyError, match=r"model.layers.1 \(stage 0\) raised TypeError") as caught:
        Generator(plan)
    assert caught.value.part == "model.layers.1" and isinstance(caught.value.__cause__, TypeError)
