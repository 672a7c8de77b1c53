"""Tiny Hugging Face models of many families, built from configs only (no hub, no network).

Each family gives the Hugging Face model itself, no wrapper (``partition`` turns its cache off for
the trace, and the last stage returns its ``ModelOutput``), random batches for it as a dict by
input name (``input_ids``, ``decoder_input_ids``, ``pixel_values``...: the first positional, the
rest keyword inputs), and one loss for all, on ``out.logits``. Every dropout, layer-drop and router-noise
probability is zeroed in the config: several families apply dropout functionally from the config,
not through ``nn.Dropout``, so only then is train mode deterministic and a pipeline's gradients
comparable with the unpartitioned model's exactly.

Importable by the tests and by spawned gloo ranks (everything here is module-level and picklable).
``transformers`` is imported only when a model is built.

Legend: ``p`` stages (= ranks over gloo), ``m`` micro-batches, ``mb`` rows per micro-batch.
"""

from __future__ import annotations

import copy
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from partitioner import Plan, partition
from runtime import PipelineTrainer

# The runtime tests' shared tolerance; importing parity also makes every linear layer, however
# small, fuse its weight-gradient accumulation, so 1F1B checks the fused path here too.
sys.path.append(str(Path(__file__).resolve().parent / "runtime"))
from parity import TOL, check_grads, reference

__all__ = [
    "FAMILIES", "Family", "M", "MB", "ROWS", "SEED", "TOL", "check_grads", "dist_worker", "first_names",
    "loss_fn", "make_plan", "reference", "zero_dropout",
]

VOCAB = 96
SEQ = 8
M = 4  # micro-batches per step
MB = 2  # rows per micro-batch: the example a plan is traced with
ROWS = M * MB  # rows of a training batch
SEED = 1234  # the training batch's generator seed
# Config attributes that make training random: dropout probabilities, layer-drop, router noise.
_RANDOM = re.compile(r"drop|jitter")


def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the model output's ``logits`` over the last dimension: token logits
    (B, T, V) or class logits (B, C)."""
    logits: torch.Tensor = out.logits
    return nn.functional.cross_entropy(logits.flatten(0, -2), target.flatten())


def zero_dropout(cfg: Any) -> Any:
    """Zero every float attribute of ``cfg`` named like a dropout (``hidden_dropout_prob``,
    ``resid_pdrop``, ``dropout_rate``, ``encoder_layerdrop``, ``router_jitter_noise``...); returns it."""
    for key, value in vars(cfg).items():
        if _RANDOM.search(key) and isinstance(value, float):
            setattr(cfg, key, 0.0)
    return cfg


_IDS = ("ids", (SEQ,), VOCAB)


@dataclass(frozen=True)
class Family:
    """One model family: a tiny config and what its model eats.

    Attributes:
        name: short name, the test id.
        config: the ``transformers`` config class's name.
        model: the ``transformers`` model class's name.
        kwargs: config arguments (tiny sizes); dropout is zeroed after.
        inputs: per model input, its name and ``('ids', shape, high)`` (integers below ``high``)
            or ``('float', shape)`` (normal), shapes without the batch dimension. The first is
            the model's first positional input, the others keyword inputs.
        target: the loss target, as an input's spec.
    """

    name: str
    config: str
    model: str
    kwargs: dict[str, Any] = field(hash=False)
    inputs: tuple[tuple[str, tuple[Any, ...]], ...] = (("input_ids", _IDS),)
    target: tuple[Any, ...] = _IDS

    def build(self) -> nn.Module:
        """The Hugging Face model in train mode; the same weights in every process."""
        import transformers

        cfg = zero_dropout(getattr(transformers, self.config)(**self.kwargs))
        torch.manual_seed(0)
        return getattr(transformers, self.model)(cfg).train()  # type: ignore[no-any-return]

    def batch(self, rows: int, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``rows`` random inputs (by name, in the model's input order) and targets."""
        return {name: _random(spec, rows, gen) for name, spec in self.inputs}, _random(self.target, rows, gen)


def _random(spec: tuple[Any, ...], rows: int, gen: torch.Generator) -> torch.Tensor:
    shape = (rows, *spec[1])
    if spec[0] == "float":
        return torch.randn(shape, generator=gen)
    return torch.randint(0, spec[2], shape, generator=gen)


# Width 32, 2 layers, 4 heads of 8 (2 KV heads where the family has grouped-query attention).
_LM = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
_GQA = dict(_LM, intermediate_size=64, num_key_value_heads=2, head_dim=8)
_SEQ2SEQ = (("input_ids", _IDS), ("decoder_input_ids", _IDS))
_BART = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)

FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("llama", "LlamaConfig", "LlamaForCausalLM", _GQA),
    Family("mistral", "MistralConfig", "MistralForCausalLM", dict(_GQA, sliding_window=4)),  # window < SEQ
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", _GQA),
    Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", _GQA),
    Family("gemma", "GemmaConfig", "GemmaForCausalLM", _GQA),
    Family("gemma2", "Gemma2Config", "Gemma2ForCausalLM", dict(_GQA, query_pre_attn_scalar=8, sliding_window=4)),
    Family("phi", "PhiConfig", "PhiForCausalLM", dict(_LM, intermediate_size=64)),
    Family("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_LM, intermediate_size=64)),
    Family("opt", "OPTConfig", "OPTForCausalLM", dict(_LM, ffn_dim=64, word_embed_proj_dim=32)),
    Family("bloom", "BloomConfig", "BloomForCausalLM", dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)),
    Family("falcon", "FalconConfig", "FalconForCausalLM", dict(_LM, num_kv_heads=4, ffn_hidden_size=64)),
    Family("mixtral", "MixtralConfig", "MixtralForCausalLM", dict(_GQA, num_local_experts=4, num_experts_per_tok=2)),
    Family("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        _GQA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    Family("bert", "BertConfig", "BertForMaskedLM", dict(_LM, intermediate_size=64)),
    Family("roberta", "RobertaConfig", "RobertaForMaskedLM", dict(_LM, intermediate_size=64)),
    Family("t5", "T5Config", "T5ForConditionalGeneration", dict(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8), inputs=_SEQ2SEQ),
    Family("bart", "BartConfig", "BartForConditionalGeneration", dict(_BART, max_position_embeddings=64),
           inputs=_SEQ2SEQ),
    Family("vit", "ViTConfig", "ViTForImageClassification", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
        patch_size=4, num_labels=5), inputs=(("pixel_values", ("float", (3, 16, 16))),), target=("ids", (), 5)),
    # 8 mel bins x 16 frames (twice max_source_positions: the encoder's convolutions halve it).
    Family("whisper", "WhisperConfig", "WhisperForConditionalGeneration", dict(
        _BART, num_mel_bins=8, max_source_positions=8, max_target_positions=32, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1),
        inputs=(("input_features", ("float", (8, 16))), ("decoder_input_ids", _IDS))),
    # A state-space model: transformers' sequential scan on the CPU (no CUDA kernels).
    Family("mamba", "MambaConfig", "MambaForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, time_step_rank=4)),
]}


def make_plan(model: nn.Module, x: dict[str, torch.Tensor], p: int) -> Plan:
    """``p`` stages for ``m`` micro-batches, traced with the first micro-batch of ``x``: its first
    input positional, the others keyword inputs, as a user passes a Hugging Face model's."""
    (_, ids), *rest = x.items()
    return partition(model, (ids[:MB],), p, example_kwargs={k: t[:MB] for k, t in rest}, microbatches=M,
                     schedule="1f1b")


def first_names(model: nn.Module) -> dict[str, str]:
    """Every trainable parameter's name -> the first name of the same tensor (tied weights share one)."""
    first: dict[int, str] = {}
    named = model.named_parameters(remove_duplicate=False)
    return {n: first.setdefault(id(prm), n) for n, prm in named if prm.requires_grad}


def dist_worker(rank: int, world: int, names: list[str], via_file: str | None = None) -> dict[str, dict[str, Any]]:
    """On each rank of ``world`` gloo processes: 1F1B over ``world`` stages, one family at a time.

    The family named ``via_file`` trains from its plan saved to JSON and loaded back (bound to the
    model, its keyword inputs included): ``loss_fn`` gets the ModelOutput the file describes.
    Returns, per family, the loss, the parameter names this rank checked against the
    unpartitioned model, and every trainable name's first name (to check coverage).
    """
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        fam = FAMILIES[name]
        model = fam.build()
        ref = copy.deepcopy(model)
        x, y = fam.batch(ROWS, torch.Generator().manual_seed(SEED))
        want_loss, want = reference(ref, loss_fn, x, y)
        plan = make_plan(model, x, world)
        if name == via_file:
            with tempfile.TemporaryDirectory() as tmp:
                plan.save(Path(tmp) / "plan.json")
                (_, first), *rest = x.items()
                plan = Plan.load(Path(tmp) / "plan.json", model, (first[:MB],),
                                 example_kwargs={k: t[:MB] for k, t in rest})
        trainer = PipelineTrainer(plan, loss_fn, schedule="1f1b", transport="dist", timeout=120)
        loss = trainer.forward_backward(x, y)
        torch.testing.assert_close(loss, want_loss, **TOL)
        out[name] = {"loss": float(loss), "checked": check_grads(trainer, want), "first": first_names(ref)}
    return out
