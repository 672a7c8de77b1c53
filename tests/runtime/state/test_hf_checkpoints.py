"""Issue 30's family matrix: a Hugging Face folder written by ``save_pretrained`` trains as
``from_pretrained`` loads it, and what pipecut exports is what ``save_pretrained`` writes.

For ten families (GPT-NeoX's legacy ``embed_out``; Mixtral's, Qwen2-MoE's and Qwen3-MoE's
experts stored one by one and fused in the model; six families whose checkpoint keys are their
names, three of them with tied embeddings):

* ``Init(weights=FOLDER)`` on 2 and 4 stages: the first ``forward_backward`` gives
  ``from_pretrained(FOLDER)``'s loss and every gradient;
* ``export_safetensors`` after an optimizer step writes ``save_pretrained``'s keys, and
  ``from_pretrained`` of the export gives the trainer's logits;
* ``pipecut train`` (its CLI entry, 2 stages, 1 step): the step-1 loss in ``metrics.jsonl`` is
  ``from_pretrained``'s on the batch the run draws, and ``final/`` loads with the trainer's logits.

The reference runs the pipeline's micro-batches, each loss divided by their count, so both sum
the same terms in the same order (the losses were equal to the bit on the CPU when this was
written; each case prints ``|pipecut - from_pretrained|``: run with ``-s``).

Legend: ``p`` stages, ``m`` micro-batches, ``mb`` rows per micro-batch, ``L`` sequence length.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

import pipecut.train.loop
from families import zero_dropout
from partitioner import Cluster, Plan
from partitioner.plan.layout import Option
from partitioner.search import LayoutSearch
from pipecut.cli import main
from pipecut.train.data import TRAIN, open_tokens
from pipecut.train.loop import lm_loss
from profiles import long_only
from runtime import Init, PipelineTrainer, empty_weights

transformers = pytest.importorskip("transformers")

VOCAB = 128
L = 16
M, MB = 4, 2  # micro-batches of a step, rows of each: pipecut train's --global-batch 8 --micro-batch-size 2
STAGES = (2, 4)
# fp32 on one thread, the same kernels on the same micro-batches: only the order in which a
# gradient's micro-batch terms are summed (and wgrad fusion's accumulation) may differ.
TOL = {"rtol": 1e-5, "atol": 1e-6}

# Width 32, 2 layers, 4 heads of 8 (2 KV heads where the family has grouped-query attention); token
# ids inside the vocabulary (Phi-3's default padding id is not). 2 layers serve 4 stages too: a
# block is never cut, so they are embeddings | block 0 | block 1 | norm and head.
_LM = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
           max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_GQA = dict(_LM, intermediate_size=64, num_key_value_heads=2, head_dim=8)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


@dataclass(frozen=True)
class Family:
    """A causal LM family: its ``transformers`` config and model classes and tiny config arguments."""

    name: str
    config: str
    model: str
    kwargs: dict[str, Any]

    def write(self, folder: Path) -> None:
        """``save_pretrained`` of a random model, every dropout and router noise zeroed in its config."""
        cfg = zero_dropout(getattr(transformers, self.config)(**self.kwargs))
        torch.manual_seed(7)
        getattr(transformers, self.model)(cfg).save_pretrained(folder)


FAMILIES = {f.name: f for f in [
    Family("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_LM, intermediate_size=64)),
    Family("mixtral", "MixtralConfig", "MixtralForCausalLM", dict(_GQA, num_local_experts=4, num_experts_per_tok=2)),
    Family("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
           dict(_GQA, **_MOE, shared_expert_intermediate_size=32)),
    Family("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(_GQA, **_MOE)),
    Family("llama", "LlamaConfig", "LlamaForCausalLM", _GQA),
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", _GQA),
    Family("gemma2", "Gemma2Config", "Gemma2ForCausalLM", dict(_GQA, query_pre_attn_scalar=8, sliding_window=4)),
    Family("phi3", "Phi3Config", "Phi3ForCausalLM", dict(_LM, intermediate_size=64, num_key_value_heads=2)),
    Family("gpt2", "GPT2Config", "GPT2LMHeadModel", dict(vocab_size=VOCAB, n_embd=32, n_head=4, n_layer=2,
                                                         n_positions=64, bos_token_id=1, eos_token_id=2)),
    Family("opt", "OPTConfig", "OPTForCausalLM", dict(_LM, ffn_dim=64, word_embed_proj_dim=32)),
]}
# Whose checkpoint keys are not the model's names: transformers' conversion mapping renames or merges them.
CONVERTED = ("gpt_neox", "mixtral", "qwen2_moe", "qwen3_moe")
# pipecut train runs the loader and exporter the other tests check for every family: it is run
# for the converted families (one of each conversion) and Llama, to keep the file fast; by
# default for Llama and Mixtral (experts merged), the other conversions in the long profile.
TRAINED = ("gpt_neox", "mixtral", "qwen2_moe", "llama")
# Families whose checkpoint keys another default family already loads as they are (Llama's
# names; the long profile runs them): Qwen2 and Gemma 2, and OPT (GPT-2 stands for the
# non-Llama names). Every converted family runs by default.
SAME_KEYS = ("qwen2", "gemma2", "opt")


@dataclass
class Case:
    """A family's folder, and its plans on 2 and 4 stages (made on first use)."""

    folder: Path

    @functools.cached_property
    def plans(self) -> dict[int, Plan]:
        return _plans(self.folder)

    def reference(self) -> Any:
        """``from_pretrained(folder)``, in train mode as the pipeline runs (its dropout is zero)."""
        return transformers.AutoModelForCausalLM.from_pretrained(self.folder).train()


def _plans(folder: Path) -> dict[int, Plan]:
    """The folder's model cut into 2 and 4 stages of ``M`` micro-batches of ``MB`` rows, from one trace.

    LayoutSearch traces and costs the model once and plans any layout of it; a trace costs
    seconds and ten families are planned. The layout is dropped, so the trainer runs each plan
    as ``partition()``'s: one replica (``parity.plan_once`` does the same).
    """
    cfg = transformers.AutoConfig.from_pretrained(folder)
    with empty_weights():  # parameters on meta (the trainer loads them), buffers real (rotary tables)
        meta = transformers.AutoModelForCausalLM.from_config(cfg)
    search = LayoutSearch(meta, (torch.zeros(MB, L, dtype=torch.long),), cluster=Cluster.uniform(4, "cpu"),
                          global_batch=M * MB)
    plans = {}
    for p in STAGES:
        dp = 4 // p  # the search's 4 devices: 2 replicas of 2 stages, one pipeline of 4
        plan = search.plan(Option(dp=dp, pp=p, schedule="1f1b", microbatch_size=MB, zero="none",
                                  global_batch=dp * M * MB))
        plans[p] = dataclasses.replace(plan, layout=None)
        assert (plans[p].num_stages, plans[p].microbatches) == (p, M)
    return plans


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``cases(name)``: the family's folder and plans, made on first use."""
    made: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            FAMILIES[name].write(folder)
            made[name] = Case(folder)
        return made[name]

    return get


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (M * MB, L), generator=gen), torch.randint(0, VOCAB, (M * MB, L), generator=gen)


def _reference(model: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean of the ``M`` micro-batches' ``lm_loss``, and every parameter's gradient of it by every name."""
    model.zero_grad()
    total = torch.zeros(())
    for xs, ys in zip(x.chunk(M), y.chunk(M)):
        loss = lm_loss(model(xs).logits, ys) / M
        loss.backward()
        total = total + loss.detach()
    grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
    return total, grads


def _keys(folder: Path) -> set[str]:
    """The tensor keys of a folder's safetensors files."""
    keys: set[str] = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as opened:
            keys.update(opened.keys())
    return keys


@pytest.mark.parametrize("name", long_only(FAMILIES, SAME_KEYS))
def test_only_the_converted_families_folders_hold_keys_that_are_not_model_names(cases: Any, name: str) -> None:
    """What makes the matrix test the conversion: these folders cannot load by name alone."""
    case = cases(name)
    extra = _keys(case.folder) - set(case.reference().state_dict())
    assert bool(extra) == (name in CONVERTED), sorted(extra)[:4]


def _check_grads(trainer: PipelineTrainer, want: dict[str, torch.Tensor]) -> None:
    for name, prm in trainer.named_parameters():
        assert prm.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(prm.grad, want[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")


def _check_state(trainer: PipelineTrainer, model: Any) -> None:
    """Every tensor the trainer holds equals the model's of that name, bit for bit."""
    state = model.state_dict()
    for name, t in trainer.state_dict().items():
        assert torch.equal(t, state[name]), name


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("name", long_only(FAMILIES, SAME_KEYS))
def test_weights_give_from_pretrained_loss_and_every_gradient(cases: Any, name: str, p: int) -> None:
    case = cases(name)
    trainer = PipelineTrainer(case.plans[p], lm_loss, init=Init(weights=str(case.folder)))
    assert all(any(True for _ in stage.module.parameters()) for stage in trainer.stages.values())
    ref = case.reference()
    _check_state(trainer, ref)  # merged experts and renamed heads included
    x, y = _batch()
    loss = trainer.forward_backward(x, y)
    want_loss, want = _reference(ref, x, y)
    print(f"\n{name} p={p}: |pipecut - from_pretrained| = {abs(float(loss) - float(want_loss)):.3g}")
    torch.testing.assert_close(loss, want_loss, **TOL)
    _check_grads(trainer, want)


@pytest.mark.parametrize("name", long_only(FAMILIES, SAME_KEYS))
def test_the_export_has_save_pretrained_keys_and_reloads_with_the_trainers_logits(
    cases: Any, name: str, tmp_path: Path
) -> None:
    case = cases(name)
    trainer = PipelineTrainer(case.plans[2], lm_loss, lambda ps: torch.optim.SGD(ps, lr=0.1),
                              init=Init(weights=str(case.folder)))
    x, y = _batch()
    trainer.step(x, y)
    with torch.no_grad():
        got = trainer.predict(x).logits
    out = trainer.export_safetensors(tmp_path / "export")
    transformers.AutoConfig.from_pretrained(case.folder).save_pretrained(out)
    # save_pretrained's layout (transformers 4.x's for these families): experts one by one, legacy
    # names, a tied embedding once under its first name.
    assert _keys(out) == _keys(case.folder)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).train()
    _check_state(trainer, reloaded)
    with torch.no_grad():
        after = reloaded(x).logits
        before = case.reference()(x).logits
    torch.testing.assert_close(after, got, **TOL)
    assert not torch.allclose(after, before, atol=1e-3)  # the step's weights were exported, not the folder's


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, VOCAB, 2000))
    return path


@pytest.mark.parametrize("name", long_only(TRAINED, ("gpt_neox", "qwen2_moe")))
def test_pipecut_train_starts_at_from_pretrained_loss_and_its_final_export_reloads(
    cases: Any, name: str, token_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = cases(name)
    # The batch of step 1 as the run draws it (seed 0, the training stream), and the trainer's
    # logits on it just before the run exports its final weights.
    x, y = open_tokens(token_file).batch(seed=0, step=0, rows=M * MB, seq_len=L, stream=TRAIN, vocab_size=VOCAB)
    seen: dict[str, torch.Tensor] = {}
    export = pipecut.train.loop.export_final

    def watched(trainer: PipelineTrainer, *args: Any, **kwargs: Any) -> Path:
        with torch.no_grad():
            seen["logits"] = trainer.predict(x).logits
        return export(trainer, *args, **kwargs)

    monkeypatch.setattr(pipecut.train.loop, "export_final", watched)
    out = tmp_path / "run"
    assert main(["train", "--model", str(case.folder), "--data", str(token_file), "--out", str(out), "--seq-len",
                 str(L), "--global-batch", str(M * MB), "--micro-batch-size", str(MB), "--pp", "2",
                 "--steps", "1"]) == 0
    (line,) = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    want_loss, _ = _reference(case.reference(), x, y)
    print(f"\n{name} pipecut train: |step-1 loss - from_pretrained| = {abs(line['loss'] - float(want_loss)):.3g}")
    torch.testing.assert_close(line["loss"], float(want_loss), **TOL)
    assert _keys(out / "final") == _keys(case.folder)
    with torch.no_grad():
        final = transformers.AutoModelForCausalLM.from_pretrained(out / "final").train()(x).logits
    torch.testing.assert_close(final, seen["logits"], **TOL)
