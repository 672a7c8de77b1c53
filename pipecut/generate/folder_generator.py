"""A :class:`~runtime.generate.Generator` from a Hugging Face folder: the model on meta, cut, each stage loaded alone.

Legend: ``p`` pipeline stages (``pp``), ``d`` data-parallel replicas (``dp``), ``L`` the plan's
example sequence length.

The folder is read as ``pipecut train`` reads it (:class:`~pipecut.folder.HFFolder`: the same
door checks, no code from the folder unless ``trust_remote_code``); the model is built on meta
(no weight memory), planned into ``p`` stages with :func:`~partitioner.api.partition` (cut
between whole blocks), and a :class:`~runtime.generate.Generator` gives this process's stages
real tensors and loads only their weights. Under torch.distributed (torchrun) every rank does
the same, plans the same cut (planning is deterministic) and builds only its own stage. There is
no loss and no optimizer: the plan is costed for the weights alone. ``pipecut generate`` builds
its generator here (:func:`open_generation_folder`, then :func:`build_generator`).

Example:
    >>> import tempfile, torch, transformers
    >>> folder = tempfile.mkdtemp()
    >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
    ...                                num_attention_heads=2, intermediate_size=32)
    >>> transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    >>> loaded = load_generator(folder, pp=2)
    >>> out = loaded.generator.generate([[5, 6, 7]], max_new_tokens=4, eos_token_id=[])
    >>> [len(t) for t in out.tokens], len(loaded.generator.spans)
    ([4], 2)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from partitioner.api import partition
from partitioner.cost.devices import Cluster, default_device
from partitioner.inference.kv import pricing_problems
from partitioner.options import Capture, Costing, Cut, Inference
from pipecut.folder import FolderError, HFFolder, max_positions
from runtime.generate import GenerateOptionError, Generator, Sampling
from runtime.generate.parts import generation_problems, layer_count
from runtime.precision import MixedPrecision
from runtime.state.weights import Weights

__all__ = ["load_generator", "FolderGenerator", "GenerationFolder", "open_generation_folder", "build_generator",
           "NoTokenizerError"]

log = logging.getLogger(__name__)

# The plan's example length when the caller names none (the model's own, when shorter).
_DEFAULT_LENGTH = 1024


class NoTokenizerError(FolderError):
    """Text was asked of a folder that has no tokenizer files to turn it into tokens and back."""


@dataclass(frozen=True)
class GenerationFolder:
    """A Hugging Face folder admitted for generation: what :func:`build_generator` and the text need.

    Attributes:
        folder: the folder.
        config: its model config.
        weights: its checkpoint (safetensors or ``pytorch_model.bin``, sharded or not).
        tokenizer: its tokenizer, or ``None`` when it has no tokenizer files.
        eos_token_id: what ends a sequence: its ``generation_config.json``'s, else its config's.
        pad_token_id: what pads, from the same place (``None``: the first end-of-sequence token).
    """

    folder: HFFolder
    config: Any
    weights: Path
    tokenizer: Any
    eos_token_id: int | list[int] | None
    pad_token_id: int | None

    @property
    def max_positions(self) -> int | None:
        """The most positions the model takes (``None``: no limit in its config)."""
        return max_positions(self.config)


def open_generation_folder(
    path: str | os.PathLike[str], *, trust_remote_code: bool = False, command: str = "load_generator",
) -> GenerationFolder:
    """Open a folder for generation, refusing it at the door (before any planning or loading).

    Args:
        path: a Hugging Face folder (``config.json``, weights, a tokenizer).
        trust_remote_code: let the folder's own code (``auto_map``, ``modeling_*.py``) run.
        command: who asks, for messages.

    Raises:
        FolderError: not a folder, no ``config.json``, or no weights.
        UnsupportedModelError: not a causal LM (an encoder such as BERT, an encoder-decoder).
        RemoteCodeError: the model needs the folder's code and ``trust_remote_code`` is off.
    """
    folder = HFFolder(path, trust_remote_code=trust_remote_code)
    config = folder.config
    folder.check_causal_lm(config, command=command)
    weights = folder.weights
    if weights is None:
        raise FolderError(
            f"{folder.path} holds no weights (model.safetensors, pytorch_model.bin...): generating from a random "
            "initialisation makes noise; save the trained model there (model.save_pretrained), or pass a pipecut "
            "train run's OUT/final"
        )
    tokenizer = folder.tokenizer() if folder.tokenizer_files else None
    eos, pad = _stops(folder, config)
    return GenerationFolder(folder, config, weights, tokenizer, eos, pad)


def build_generator(
    opened: GenerationFolder, *, pp: int | None = None, dp: int = 1, transport: str = "auto",
    precision: str = "fp32", seq_len: int | None = None, timeout: float = 300.0,
    device: torch.device | str | None = None, batch: int = 8, prompt_len: int | None = None,
) -> Generator:
    """The folder's model on meta, cut into ``pp`` stages between blocks; this process's stages made real and loaded.

    Args:
        opened: the folder (:func:`open_generation_folder`).
        pp: stages; default: under an initialised process group of several ranks, its ranks over
            ``dp``; else 1.
        dp, transport, timeout, device: as :class:`~runtime.generate.Generator`'s.
        precision: ``'fp32'``, ``'bf16'`` or ``'fp16'``: autocast over the fp32 weights on every rank.
        seq_len: the longest sequence (prompt and new tokens) the plan's key/value caches are
            costed for (default: 1024, or the model's maximum).
        batch: the sequences generated together that the plan's caches are costed for.
        prompt_len: the prompt length the plan's prefill is costed at (default ``seq_len``).

    Raises:
        GenerateOptionError: ``pp``, ``dp`` and the world do not fit (with what to launch), or the
            folder's ``config.json`` rules generation out (layers that keep a state, not keys and
            values; more stages than layers), before any model is built.
        PrecisionError: an unknown ``precision``.
        WeightsError, MaterializeError: loading the stages failed.
    """
    stages = _stage_count(pp, dp, transport)
    problems = generation_problems(opened.config, stages)
    layers = layer_count(opened.config)
    name = getattr(opened.config, "model_type", "this model")
    if problems:
        if layers is not None and stages > layers and len(problems) == 1:
            raise GenerateOptionError(f"--pp {stages}: {problems[0]}: pick --pp of at most {layers}")
        raise GenerateOptionError(f"pipecut generate cannot run {name}: {'; '.join(problems)}; generate it with "
                                  "transformers' model.generate")
    unpriced = pricing_problems(opened.config)
    if unpriced:  # the generator runs these layers; the plan cannot size their caches yet
        raise GenerateOptionError(
            f"pipecut generate cannot plan {name}'s stages: {'; '.join(unpriced)}. The generator runs this "
            "family exactly from Python (runtime.generate.Generator on a plan from partitioner.partition), or "
            "generate it with transformers' model.generate"
        )
    limit = opened.max_positions
    length = seq_len or min(_DEFAULT_LENGTH, limit or _DEFAULT_LENGTH)
    policy = MixedPrecision(precision)  # refused before the model is planned
    model = opened.folder.build(meta=True, config=opened.config).eval()
    # The folder's own stop and pad tokens are the generator's defaults, as model.generate's are.
    gen_config: Any = model.generation_config
    gen_config.eos_token_id, gen_config.pad_token_id = opened.eos_token_id, opened.pad_token_id
    # One row of the longest prompt: the prefill the plan's working memory is counted for. The stages hold
    # fp32 weights (a bf16 checkpoint is cast up) and autocast over them; the caches are costed at fp32.
    inputs = opened.folder.example_inputs(seq_len=min(prompt_len or length, length), micro_batch_size=1)
    inference = Inference(batch=batch, max_len=length, dtype="fp32")
    plan = partition(
        model, inputs, stages, cluster=Cluster.uniform(stages, default_device()), cut=Cut(), capture=Capture(),
        costing=Costing(precision=policy.name, inference=inference),
    )
    # cast: a bf16 or fp16 checkpoint loads into the fp32 weights the stages compute with.
    return Generator(plan, weights=Weights(opened.weights, cast=True), transport=transport, dp=dp, pp=stages,
                     timeout=timeout, precision=policy, device=device)


@dataclass(frozen=True)
class FolderGenerator:
    """What :func:`load_generator` returns: the generator and what turns text into its tokens and back.

    Attributes:
        generator: the :class:`~runtime.generate.Generator` over this process's stages.
        tokenizer: the folder's tokenizer (``None``: the folder has none; pass token ids).
        eos_token_id, pad_token_id: the folder's stop and pad tokens (already the generator's defaults).
    """

    generator: Generator
    tokenizer: Any
    eos_token_id: int | list[int] | None
    pad_token_id: int | None

    def complete(
        self, prompts: Sequence[str], *, max_new_tokens: int = 20, sampling: Sampling | None = None,
    ) -> list[str]:
        """Continue each text prompt; return each one's new text (special tokens left out).

        The prompts are tokenised as ``tokenizer(text)`` does (its BOS included) and generated
        together, left-padded as ``model.generate`` pads a batch. Under torch.distributed every
        rank calls it with the same prompts and every rank gets every completion.

        Raises:
            NoTokenizerError: the folder has no tokenizer.
            GenerateOptionError: a prompt with no tokens.
        """
        if self.tokenizer is None:
            raise NoTokenizerError(
                "this folder has no tokenizer files (tokenizer.json, tokenizer_config.json...): save the model's "
                "tokenizer there (tokenizer.save_pretrained), or pass token ids to .generator.generate"
            )
        ids = [list(self.tokenizer(text)["input_ids"]) for text in prompts]
        out = self.generator.generate(ids, max_new_tokens=max_new_tokens, sampling=sampling)
        return [self.tokenizer.decode(list(tokens), skip_special_tokens=True) for tokens in out.tokens]


def load_generator(
    folder: str | os.PathLike[str], *, pp: int | None = None, dp: int = 1, transport: str = "auto",
    precision: str = "fp32", seq_len: int | None = None, trust_remote_code: bool = False, timeout: float = 300.0,
    device: torch.device | str | None = None,
) -> FolderGenerator:
    """A generator of a Hugging Face folder's causal LM, cut into ``pp`` stages, each rank loading only its own.

    In one process, ``transport='auto'`` runs the stages one after another (``'sequential'``:
    measured faster there than a thread per stage, docs/generate.md); under torchrun (an
    initialised process group of several ranks) it runs one pipeline rank per process
    (``'dist'``) in ``dp`` replicas that split the prompts.

    Args:
        folder: a folder written by ``save_pretrained`` (``config.json``, weights, a tokenizer).
        pp: stages the model is cut into; default: the world size over ``dp`` under
            torch.distributed, else 1.
        dp: data-parallel replicas (``'dist'`` only: world rank ``d * pp + r`` is replica ``d``'s rank ``r``).
        transport: ``'auto'``, ``'sequential'``, ``'threads'`` or ``'dist'`` (:class:`~runtime.generate.Generator`).
        precision: ``'fp32'`` (default), ``'bf16'`` or ``'fp16'``: autocast over the fp32 weights,
            on every rank and rank thread.
        seq_len: the sequence length the plan is costed at (default 1024, or the model's
            maximum); generation is not limited to it.
        trust_remote_code: let the folder's own code run (off by default: read it first).
        timeout: seconds any one message between ranks may take.
        device: where the stages go (default: the CPU; a rank's GPU under NCCL).

    Returns:
        A :class:`FolderGenerator`: ``.generator``, ``.tokenizer``, the stop and pad tokens, and
        ``.complete(texts, max_new_tokens=...)`` for text in, text out.

    Raises:
        FolderError, UnsupportedModelError, RemoteCodeError: the folder is refused at the door.
        GenerateOptionError: ``pp``, ``dp``, ``transport`` and the world do not fit.
        WeightsError: the checkpoint does not load into the stages.

    Example:
        See the module's example, and docs/reference/load-generator.md.
    """
    opened = open_generation_folder(folder, trust_remote_code=trust_remote_code)
    generator = build_generator(opened, pp=pp, dp=dp, transport=transport, precision=precision, seq_len=seq_len,
                                timeout=timeout, device=device)
    log.info("loaded %s as %d stages (%s)", opened.folder.path, len(generator.spans), generator.transport)
    return FolderGenerator(generator, opened.tokenizer, opened.eos_token_id, opened.pad_token_id)


def _stage_count(pp: int | None, dp: int, transport: str) -> int:
    """The stages to plan: ``pp``, else the world's pipeline ranks under torch.distributed, else 1."""
    import torch.distributed as dist

    if pp is not None and (not isinstance(pp, int) or pp < 1):
        raise GenerateOptionError(f"pp must be a positive int (the stages), got {pp!r}")
    grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if pp is not None:
        return pp
    if grouped and transport in ("auto", "dist"):
        world = dist.get_world_size()
        if not isinstance(dp, int) or dp < 1 or world % dp:
            raise GenerateOptionError(
                f"dp={dp!r} data-parallel replicas do not divide the {world} ranks: launch dp x pp ranks"
            )
        return world // dp
    return 1


def _stops(folder: HFFolder, config: Any) -> tuple[int | list[int] | None, int | None]:
    """The end-of-sequence and padding tokens ``model.generate`` uses for a model loaded from the folder:
    its ``generation_config.json``, else the ones the config names."""
    from transformers import GenerationConfig

    if (folder.path / "generation_config.json").is_file():
        gen = GenerationConfig.from_pretrained(str(folder.path), local_files_only=True)
    else:
        gen = GenerationConfig.from_model_config(config)
    return gen.eos_token_id, gen.pad_token_id
