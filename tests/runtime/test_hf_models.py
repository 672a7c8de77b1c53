"""A Hugging Face model trained as it is: its own checkpoint folder loads with no prefix, keyword
inputs (``attention_mask``, ``labels``) pass through ``partition`` and the trainer alike, and
``loss_fn`` gets the model's ``ModelOutput``, from a fresh plan and from a plan file. Every case
compares the loss and every gradient with the unpartitioned model. Plain models keep their output:
one tensor stays a tensor, a dict reaches ``loss_fn`` as a dict."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from parity import TOL, check_grads, reference
from partitioner import Plan, partition
from partitioner.errors import InputError, PlanFormatError
from partitioner.plan.records import structure_spec
from runtime import Init, PipelineTrainer

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 64


def _config(tie: bool = False) -> Any:
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32,
                                    tie_word_embeddings=tie)


def _logits_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def _batch(rows: int = 8, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return torch.randint(0, VOCAB, (rows, seq), generator=gen), torch.randint(0, VOCAB, (rows, seq), generator=gen)


@pytest.mark.parametrize("tie", [False, True])
def test_weights_load_the_models_own_save_pretrained_folder_with_no_prefix(tmp_path: Path, tie: bool) -> None:
    torch.manual_seed(1)
    pretrained = transformers.LlamaForCausalLM(_config(tie)).train()
    pretrained.save_pretrained(tmp_path / "hf")
    with torch.device("meta"):  # nothing of the model's size is allocated before the load
        model = transformers.LlamaForCausalLM(_config(tie)).train()
    ids, y = _batch()
    plan = partition(model, (ids[:2],), 2, microbatches=4)
    trainer = PipelineTrainer(plan, _logits_loss, init=Init(weights=str(tmp_path / "hf")))
    want_state = pretrained.state_dict()
    got_state = trainer.state_dict()
    assert set(got_state) == set(want_state)  # the model's own names: no 'model.' prefix
    assert "model names = checkpoint keys" in str(trainer.load_weights(tmp_path / "hf"))
    for name, t in got_state.items():
        assert torch.equal(t, want_state[name]), name
    want_loss, want = reference(copy.deepcopy(pretrained), _logits_loss, {"input_ids": ids}, y)
    loss = trainer.forward_backward(ids, y)
    torch.testing.assert_close(loss, want_loss, **TOL)
    check_grads(trainer, want)


def test_attention_mask_and_labels_pass_through_and_loss_fn_reads_out_loss() -> None:
    torch.manual_seed(2)
    model = transformers.LlamaForCausalLM(_config()).train()
    ref = copy.deepcopy(model)
    ids, _ = _batch()
    mask = torch.ones_like(ids)
    mask[:, -2:] = 0  # every row padded alike: each micro-batch's mean loss counts the same tokens
    labels = ids.masked_fill(mask == 0, -100)
    x = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    plan = partition(model, (ids[:2],), 2, microbatches=4,
                     example_kwargs={"attention_mask": mask[:2], "labels": labels[:2]})
    assert plan.input_names == ("input_ids", "attention_mask", "labels")
    seen: list[tuple[type, Any]] = []

    def loss_fn(out: Any, target: Any) -> torch.Tensor:
        seen.append((type(out), target))
        return out.loss  # type: ignore[no-any-return]

    trainer = PipelineTrainer(plan, loss_fn)
    want_loss, want = reference(ref, lambda out, _: out.loss, x, torch.empty(0))
    loss = trainer.forward_backward(x)  # no targets: the labels are an input
    torch.testing.assert_close(loss, want_loss, **TOL)
    check_grads(trainer, want)
    assert set(seen) == {(transformers.modeling_outputs.CausalLMOutputWithPast, None)}
    assert len(seen) == 4  # once per micro-batch

    trainer.zero_grad()  # the same batch as a tuple, in the plan's input order
    torch.testing.assert_close(trainer.forward_backward((ids, mask, labels)), want_loss, **TOL)
    check_grads(trainer, want)

    out = trainer.predict(x)  # the whole batch's ModelOutput, its logits the model's
    assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithPast)
    with torch.no_grad():
        whole = ref(**x)
    torch.testing.assert_close(out.logits, whole.logits, **TOL)
    torch.testing.assert_close(out.loss, whole.loss, **TOL)  # the micro-batches' mean: equal token counts

    with pytest.raises(InputError, match=r"missing \['attention_mask', 'labels'\]"):
        trainer.forward_backward({"input_ids": ids})


def test_one_plan_trains_other_batch_sizes_and_sequence_lengths() -> None:
    torch.manual_seed(4)
    model = transformers.LlamaForCausalLM(_config()).train()
    ref = copy.deepcopy(model)
    ids, _ = _batch()
    plan = partition(model, (ids[:2],), 2, microbatches=4,
                     example_kwargs={"attention_mask": torch.ones_like(ids[:2])})
    trainer = PipelineTrainer(plan, _logits_loss)
    ids, y = _batch(rows=12, seq=5)  # micro-batches of 3 rows of 5 tokens; traced with 2 of 8
    x = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    want_loss, want = reference(ref, _logits_loss, x, y)
    torch.testing.assert_close(trainer.forward_backward(x, y), want_loss, **TOL)
    check_grads(trainer, want)


def test_a_plan_file_carries_the_output_structure(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(_config()).train()
    ref = copy.deepcopy(model)
    ids, y = _batch()
    plan = partition(model, (ids[:2],), 2, microbatches=4)
    plan.save(tmp_path / "plan.json")
    assert "CausalLMOutputWithPast" in json.loads((tmp_path / "plan.json").read_text())["output_structure"]
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.output_treespec() == plan.traced.out_spec  # read back before any model is bound
    bound = loaded.bind(model, (ids[:2],))
    trainer = PipelineTrainer(bound, _logits_loss)
    want_loss, want = reference(ref, _logits_loss, {"input_ids": ids}, y)
    torch.testing.assert_close(trainer.forward_backward({"input_ids": ids}, y), want_loss, **TOL)
    check_grads(trainer, want)


def _plain_plan() -> Plan:
    return partition(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), (torch.randn(2, 4),), 2,
                     microbatches=2)


def test_an_output_type_is_imported_from_its_package_once_that_package_is_in_use(tmp_path: Path) -> None:
    from transformers.models.mamba.modeling_mamba import MambaCausalLMOutput

    _, spec = pytree.tree_flatten(MambaCausalLMOutput(logits=torch.zeros(1)))
    plan = _plain_plan()  # one output, as the structure holds
    dataclasses.replace(plan, output_structure=pytree.treespec_dumps(spec)).save(tmp_path / "plan.json")
    code = (
        "import sys, transformers\n"
        "from partitioner import Plan\n"
        "assert 'transformers.models.mamba.modeling_mamba' not in sys.modules\n"
        f"print(Plan.load({str(tmp_path / 'plan.json')!r}).output_treespec().type.__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["MambaCausalLMOutput"]

    unknown = pytree.treespec_dumps(spec).replace("transformers.models.mamba.modeling_mamba", "not_imported_pkg.outs")
    with pytest.raises(PlanFormatError, match=r"not_imported_pkg\.outs\.MambaCausalLMOutput.*import the library"):
        structure_spec(unknown)
    with pytest.raises(PlanFormatError, match="holds 2 tensors but the last stage returns 1"):
        _, two = pytree.tree_flatten({"a": 0, "b": 0})
        Plan.from_dict(dataclasses.replace(plan, output_structure=pytree.treespec_dumps(two)).to_dict())


def test_a_plain_model_keeps_its_tensor_output_and_plan_bytes() -> None:
    plan = _plain_plan()
    assert plan.output_structure == "" and "output_structure" not in plan.to_dict()
    got: list[Any] = []

    def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
        got.append(out)
        return nn.functional.mse_loss(out, y)

    PipelineTrainer(plan, loss_fn).forward_backward(torch.randn(4, 4), torch.randn(4, 2))
    assert all(isinstance(o, torch.Tensor) for o in got) and len(got) == 2


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return {"score": self.a(h), "aux": self.b(h)}


def _two_heads_loss(out: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out["score"], y) + out["aux"].pow(2).mean()


def test_a_dict_output_reaches_loss_fn_as_a_dict_from_a_plan_file_too(tmp_path: Path) -> None:
    model = _TwoHeads()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    plan = partition(model, (x[:2],), 2, microbatches=4)
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json", model, (x[:2],))
    want_loss, want = reference(ref, _two_heads_loss, (x,), y)
    for p in (plan, loaded):
        trainer = PipelineTrainer(p, _two_heads_loss)
        trainer.zero_grad()
        torch.testing.assert_close(trainer.forward_backward(x, y), want_loss, **TOL)
        check_grads(trainer, want)
        assert set(trainer.predict(x)) == {"score", "aux"}
