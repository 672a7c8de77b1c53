"""What a family's forward does around its layers, read off the trace: each case against ``model.generate``.

Each family here once generated wrongly or was refused for one thing its top-level ``forward``
does that the generator did not; each is now read off the model or its traced graph, not listed:

* BLOOM adds an ALiBi bias its forward builds from the 2-D mask with the base model's
  ``build_alibi_tensor``;
* BertGeneration slices its positions from a ``position_ids`` buffer (BERT's way), which the
  generator replaces with each step's positions;
* NanoChat calls its final norm on the embeddings too: that call is told apart by export's module
  stack, and is the embedding stage's glue;
* Llama 4 shares its first layer's cast of the rotary's output with the layers after it (not a
  second hidden state), and gives its NoPE layers no rotary at all; Cohere 2 gives its global
  layers one they ignore (both read none of it in the trace: the layer's first call tells which);
* HY-V4's layers hand the next one their top-k indices beside hidden states of 4 dims (its
  hyper-connection streams), and a child of the base model (``hc_head``) runs before the final
  norm: over the thread ring, a pipeline rank sends both to the next.

The ring's new fields are also checked on their own: a hop's carried values, ``None`` among them,
and hidden streams travel as they were sent.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from family_sweep import NEW, PROMPTS, SEQ, check_generate
from partitioner import partition
from profiles import long_only
from runtime.generate import Generator, left_pad
from runtime.generate.ring import Ring
from runtime.generate.stage import Hop
from runtime.transport.p2p import LocalTransport
from tiny_configs import build_model, sweep_entries

transformers = pytest.importorskip("transformers")


def _model(model_type: str) -> Any:
    (entry,) = sweep_entries([model_type])
    return build_model(entry).eval()


@pytest.mark.parametrize("model_type", long_only(["bloom", "nanochat", "bert-generation", "llama4_text"],
                                                 ["bert-generation", "llama4_text"]))
def test_a_top_level_mechanism_read_off_the_model_generates_its_tokens_and_logits(model_type: str) -> None:
    (entry,) = sweep_entries([model_type])
    result = check_generate(entry, stages=(2,))
    assert result.status == "exact", result.detail


def test_a_layer_reading_no_rotary_is_given_none_unless_it_unpacks_one_it_ignores() -> None:
    # Llama 4's NoPE layers are given None by its forward (and run so); Cohere 2's global layers are
    # given the rotary, unpack it and ignore it: given None, they raise, so they get it.
    llama4 = _model("llama4_text")
    gen = Generator(partition(llama4, (torch.zeros(1, SEQ, dtype=torch.long),), 2))  # its self-check runs every layer
    nope = {f"model.layers.{i}" for i, rope in enumerate(llama4.config.no_rope_layers) if not rope}
    assert nope and gen.parts.glue.unrotated == nope and gen.parts.glue.none_ok == dict.fromkeys(nope, True)
    cohere2 = _model("cohere2")
    gen = Generator(partition(cohere2, (torch.zeros(1, SEQ, dtype=torch.long),), 2))
    full = {f"model.layers.{i}" for i, kind in enumerate(cohere2.config.layer_types) if kind == "full_attention"}
    assert full and gen.parts.glue.unrotated == full and gen.parts.glue.none_ok == dict.fromkeys(full, False)
    ids, mask = left_pad(PROMPTS, pad_token_id=0)
    want = cohere2.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, eos_token_id=[],
                            pad_token_id=0)
    assert torch.equal(gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0).sequences, want)


def test_layers_handing_on_values_and_hidden_streams_cross_the_thread_ring() -> None:
    model = _model("hy_v4")
    ids, mask = left_pad(PROMPTS, pad_token_id=0)
    want = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, eos_token_id=[],
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    gen = Generator(partition(model, (torch.zeros(1, SEQ, dtype=torch.long),), 2), transport="threads")
    assert gen.parts.carries == ("prev_topk_indices",) and gen.parts.tail == ("model.hc_head",)
    got = gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0, output_logits=True)
    assert torch.equal(got.sequences, want.sequences)
    assert got.logits is not None
    torch.testing.assert_close(torch.stack(got.logits, 1), torch.stack(want.logits, 1), rtol=1e-4, atol=1e-5)


def test_a_hops_carried_values_and_streams_arrive_as_sent() -> None:
    transport = LocalTransport({0: torch.device("cpu"), 1: torch.device("cpu")}, timeout=10)
    first, second = Ring(transport, 0, 2, torch.device("cpu")), Ring(transport, 1, 2, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    streams = torch.randn(3, 2, 4, 8, generator=gen)  # (B, T, S, H)
    topk = torch.randint(0, 5, (3, 2, 2), generator=gen, dtype=torch.int32)
    flags = torch.rand(3, 2, 1, generator=gen) > 0.5
    hop = Hop(streams, torch.arange(6).view(3, 2), torch.ones(3, 5, dtype=torch.long), carried=(topk, None, flags))
    first.send_hop(0, hop)
    got = second.recv_hop(0)
    assert got is not None and got.keep is None
    torch.testing.assert_close(got.data, streams, rtol=0, atol=0)
    assert got.carried[1] is None and len(got.carried) == 3
    for sent, came in zip((topk, flags), (got.carried[0], got.carried[2])):
        assert came is not None and came.dtype == sent.dtype and torch.equal(came, sent)
    # The next step's two sequences (the middle one of three stopped): no carried values.
    plain = Hop(torch.randn(2, 1, 8, generator=gen), torch.zeros(2, 1, dtype=torch.long),
                torch.ones(2, 6, dtype=torch.long), keep=torch.tensor([0, 2]))
    first.send_hop(1, plain)
    back = second.recv_hop(1)
    assert back is not None and back.carried == () and torch.equal(back.data, plain.data)
    assert back.keep is not None and back.keep.tolist() == [0, 2]
    first.send_hop(0, None)  # a group that ended: the header alone
    assert second.recv_hop(0) is None
