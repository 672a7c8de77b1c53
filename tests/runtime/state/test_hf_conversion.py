"""Checkpoints read through transformers' conversion mapping: the same values as from_pretrained,
per stage, checked before any read; the export's keys are save_pretrained's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from runtime.state import hf_conversion, weight_sources
from runtime.state.hf_conversion import checkpoint_names
from runtime.state.weight_errors import NonFiniteWeightsError, UnexpectedWeightsError, WeightShapeError
from runtime.state.weights import load_weights

transformers = pytest.importorskip("transformers")


def _mixtral_config(experts: int = 4) -> Any:
    return transformers.MixtralConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=experts, num_experts_per_tok=2, vocab_size=128, attention_dropout=0.0,
    )


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor], list[str]]:
    """A Mixtral folder as save_pretrained writes it (experts one by one), what from_pretrained
    makes of it, and the model's names (from a meta model)."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("mixtral")
    transformers.MixtralForCausalLM(_mixtral_config()).save_pretrained(folder)
    want = transformers.MixtralForCausalLM.from_pretrained(folder).state_dict()
    return folder, want, list(want)


def _meta(config: Any) -> Any:
    with torch.device("meta"):
        return transformers.MixtralForCausalLM(config)


def _layer1(want: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A rank holding layer 1 and the head: fresh destinations."""
    mine = (".layers.1.", "lm_head.", "model.norm.")
    return {n: torch.zeros_like(t) for n, t in want.items() if any(m in n for m in mine)}


def _record_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every checkpoint key read from the safetensors file (``Source.get`` reads through ``read`` too)."""
    read: list[str] = []
    plan_read = weight_sources._SafetensorsSource.read

    def recording_read(self: Any, plan: Any, done: Any) -> int:
        read.extend(plan)
        return plan_read(self, plan, done)

    monkeypatch.setattr(weight_sources._SafetensorsSource, "read", recording_read)
    return read


@pytest.fixture(params=[True, False], ids=["experts-to-slices", "materialised"])
def experts_to_slices(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether experts are copied into their slices as read (else each group is materialised whole first)."""
    if not request.param:
        monkeypatch.setattr(hf_conversion, "_merged_slices", lambda group, wanted: None)
    return bool(request.param)


@pytest.mark.usefixtures("experts_to_slices")
def test_a_stage_loads_what_from_pretrained_makes(mixtral: tuple[Path, dict[str, torch.Tensor], list[str]]) -> None:
    folder, want, names = mixtral
    into = _layer1(want)
    report = load_weights(folder, into, names=names, model=_meta(_mixtral_config()))
    assert "model.layers.1.mlp.experts.gate_up_proj" in into and report.converted > 0
    for n, t in into.items():
        assert torch.equal(t, want[n]), n
    assert "renamed or merged as from_pretrained does" in str(report)


def test_a_rank_reads_only_the_source_tensors_of_its_own_layers(
    mixtral: tuple[Path, dict[str, torch.Tensor], list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, want, names = mixtral
    read = _record_reads(monkeypatch)
    load_weights(folder, _layer1(want), names=names, model=_meta(_mixtral_config()))
    assert read and not [k for k in read if ".layers.0." in k or k.startswith("model.embed_tokens")]
    experts = [k for k in read if ".experts." in k]
    assert len(experts) == len(set(experts)) == 4 * 3  # each of layer 1's expert tensors, once


def test_a_converted_shape_that_differs_is_refused_before_any_read(
    mixtral: tuple[Path, dict[str, torch.Tensor], list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = mixtral[0]
    fewer = _mixtral_config(experts=2)  # the checkpoint has 4 experts per layer
    meta = _meta(fewer)
    into = {n: torch.zeros(t.shape) for n, t in meta.state_dict().items() if ".layers.1." in n}
    read = _record_reads(monkeypatch)
    with pytest.raises(WeightShapeError) as info:
        load_weights(folder, into, names=list(meta.state_dict()), model=meta)
    assert "model.layers.1.mlp.experts.gate_up_proj" in str(info.value) and "(4, 96, 32)" in str(info.value)
    assert read == []


def test_keys_that_reach_no_name_are_reported_as_the_checkpoint_spells_them(
    mixtral: tuple[Path, dict[str, torch.Tensor], list[str]], tmp_path: Path
) -> None:
    folder, want, names = mixtral
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.block_sparse_moe.experts.0.w9.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnexpectedWeightsError) as info:
        load_weights(tmp_path, _layer1(want), names=names, model=_meta(_mixtral_config()))
    assert info.value.keys == ("model.layers.0.block_sparse_moe.experts.0.w9.weight",)


def test_a_nan_in_a_merged_expert_is_named_with_its_file(
    mixtral: tuple[Path, dict[str, torch.Tensor], list[str]], tmp_path: Path
) -> None:
    folder, want, names = mixtral
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"][0, 0] = float("nan")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NonFiniteWeightsError) as info:
        load_weights(tmp_path, _layer1(want), names=names, model=_meta(_mixtral_config()))
    message = str(info.value)
    assert "model.layers.1.mlp.experts.gate_up_proj" in message and "1 of" in message
    assert str(tmp_path / "model.safetensors") in message and "allow_nonfinite" in message
    # Named on purpose: loaded as it is.
    into = _layer1(want)
    load_weights(tmp_path, into, names=names, model=_meta(_mixtral_config()),
                 allow_nonfinite=["*.experts.gate_up_proj"])
    assert torch.isnan(into["model.layers.1.mlp.experts.gate_up_proj"]).sum() == 1


def test_a_nan_in_a_plain_checkpoint_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(3), "b": torch.tensor([1.0, float("inf")]), "i": torch.ones(2, dtype=torch.int64)},
              path)
    into = {"a": torch.zeros(3), "b": torch.zeros(2), "i": torch.zeros(2, dtype=torch.int64)}
    with pytest.raises(NonFiniteWeightsError) as info:
        load_weights(path, into, names=list(into))
    assert info.value.keys == ("b",) and "'b'" in str(info.value)


def test_the_conversion_is_found_inside_a_wrapper_and_absent_for_plain_models() -> None:
    from partitioner.tracing.trace import CausalLMLogits

    model = _meta(_mixtral_config())
    assert hf_conversion.hf_conversion(torch.nn.Linear(2, 2)) is None
    found = hf_conversion.hf_conversion(CausalLMLogits(model))
    assert found is not None and found.prefix == "model." and found.model is model and found.converts


def test_a_wrapped_model_loads_with_its_prefix(mixtral: tuple[Path, dict[str, torch.Tensor], list[str]]) -> None:
    from partitioner.tracing.trace import CausalLMLogits

    folder, want, _ = mixtral
    wrapped = CausalLMLogits(_meta(_mixtral_config()))
    into = {f"model.{n}": t for n, t in _layer1(want).items()}
    report = load_weights(folder, into, names=list(wrapped.state_dict()), model=wrapped)
    assert report.prefix.model == "model."
    for n, t in into.items():
        assert torch.equal(t, want[n.removeprefix("model.")]), n


def test_export_names_are_the_ones_save_pretrained_writes(
    mixtral: tuple[Path, dict[str, torch.Tensor], list[str]],
) -> None:
    folder, want, _ = mixtral
    out = checkpoint_names(want, _meta(_mixtral_config()))
    with safe_open(folder / "model.safetensors", "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safe_open handle is no dict)
    assert set(out) == set(saved)
    for k, t in out.items():
        assert torch.equal(t, saved[k]), k
    # Each a tensor of its own (safetensors refuses tensors sharing memory).
    ptrs = [t.untyped_storage().data_ptr() for t in out.values()]
    assert len(ptrs) == len(set(ptrs))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.usefixtures("experts_to_slices")
def test_a_stage_on_the_gpu_loads_what_from_pretrained_makes(
    mixtral: tuple[Path, dict[str, torch.Tensor], list[str]],
) -> None:
    """Experts copied from the host into their slices of CUDA destinations, in bf16 (``cast``)."""
    folder, want, names = mixtral
    into = {n: torch.zeros_like(t, device="cuda", dtype=torch.bfloat16) for n, t in _layer1(want).items()}
    load_weights(folder, into, names=names, model=_meta(_mixtral_config()), cast=True)
    for n, t in into.items():
        assert t.is_cuda and torch.equal(t.cpu(), want[n].to(torch.bfloat16)), n
