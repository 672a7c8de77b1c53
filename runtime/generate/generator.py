"""The generator: a plan's stages, each with its own key/value cache, decoding a batch of prompts.

Legend: ``p`` stages, ``s`` a stage index, ``B`` sequences, ``T0`` the padded prompt length,
``n`` new tokens, ``V`` vocabulary.

With ``transport='sequential'`` one step runs the stages one after another in this process: the
first embeds, each runs its layers and hands the next a :class:`~runtime.generate.stage.Hop`, the
last returns the logits of each sequence's last position, and the next tokens are chosen from them.
With ``'threads'`` (a thread per pipeline rank) and ``'dist'`` (a process per rank, with
data-parallel replicas) the sequences are split into groups that are in flight together
(:mod:`runtime.generate.pipelined`, :mod:`runtime.generate.ranks`). The prompts are prefilled
once (the whole padded batch through every stage); each later step sends one position per sequence.
Ragged prompts are left-padded with an attention mask and per-sequence positions, as
``model.generate`` does, so the greedy tokens are the same as its.

Precision is autocast over the fp32 weights, as the trainer's (``runtime.precision``): every rank
runs its stages under the generator's ``precision``, or under the caller's ``torch.autocast``
around :meth:`Generator.generate`, which is carried into the rank threads of ``'threads'``
(autocast's state is per thread, so it would not reach them on its own).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from partitioner.plan.plan import Plan
from runtime.generate.build import build_stages
from runtime.generate.cut import StageSpan, stage_spans
from runtime.generate.errors import GenerateOptionError
from runtime.generate.glue import derive_glue
from runtime.generate.parts import DecoderParts, decoder_parts
from runtime.generate.pipelined import Batch, GroupResult, GroupState, Step, chunk_groups, run_rank, split_groups
from runtime.generate.ranks import Layout, dist_layout, rank_spans, run_dist, run_threads
from runtime.generate.ring import Ring
from runtime.generate.sampling import Sampling, kept_generators, next_tokens, sequence_generators
from runtime.generate.selfcheck import self_check
from runtime.generate.stage import StageRunner
from runtime.precision import MixedPrecision, caller_policy, resolve_precision
from runtime.state.materialize import InitFn
from runtime.state.weights import LoadReport, Weights
from runtime.transport.p2p import LocalTransport
from runtime.transport.process_group import default_device

__all__ = ["Generator", "Generation", "left_pad"]

log = logging.getLogger(__name__)

Prompts = torch.Tensor | Sequence[Sequence[int]]


@dataclass(frozen=True)
class Generation:
    """What :meth:`Generator.generate` returns.

    Attributes:
        sequences: (B, T0 + n) the left-padded prompts followed by the new tokens, a sequence that
            stopped padded with ``pad_token_id`` after its stop: what ``model.generate`` returns.
        attention_mask: (B, T0) the prompts' mask (0 on left padding).
        tokens: per sequence, its new tokens, up to and including the end-of-sequence token that
            stopped it.
        steps: forward steps through the stages (the prefill is the first).
        logits: with ``output_logits=True``, each step's logits (B, V) of the last position, as
            the last stage returned them (``generate``'s ``output_logits``); else ``None``. With
            several groups, a group that had already ended has NaN rows at the later steps.
        timeline: with ``'threads'`` and ``'dist'``, each step each pipeline rank of this
            process ran, per group, with its start and end (``time.time()``).
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    tokens: tuple[tuple[int, ...], ...]
    steps: int
    logits: tuple[torch.Tensor, ...] | None = None
    timeline: tuple[Step, ...] = ()


class Generator:
    """Generates text with a plan's stages, each keeping the keys and values of its own layers.

    For Hugging Face decoder-only causal LMs (Llama, Qwen2, Mistral, Gemma 2, GPT-2, Phi-3,
    Mixtral, Qwen2-MoE...). The stages are the plan's: each runs the model's own modules for its
    part (embedding, a run of layers, final norm, head; :mod:`runtime.generate.cut`), in this
    process, one after another (``transport='sequential'``), on a thread per pipeline rank
    (``'threads'``) or on a process per rank under torch.distributed (``'dist'``, each rank
    building and loading only its own stages). A model built under :func:`runtime.empty_weights` gets real tensors
    for the stages' parts only, and ``weights`` loads only those.

    Args:
        plan: a plan of the model, bound to it (``partition(model, (input_ids,), p)``, or a loaded
            plan after ``plan.bind(model, example_inputs)``), cut between blocks (the default).
        weights: a checkpoint to load the stages from (a Hugging Face folder, a ``.safetensors``
            file, a DCP folder...) or a :class:`~runtime.state.weights.Weights`; ``None`` keeps the
            model's values.
        device: where meta tensors are made and the stages' modules go; default: meta tensors on
            the CPU, real ones where they are.
        seed: initialisation seed for meta tensors no checkpoint fills (as the trainer's ``Init``).
        init_fn: ``init_fn(name, module)`` to initialise those instead.
        transport: ``'sequential'`` (every stage in this thread), ``'threads'`` (a thread per
            pipeline rank), ``'dist'`` (a process per rank; torch.distributed initialised, e.g. by
            torchrun), or ``'auto'``: ``'dist'`` when an initialised process group has several
            ranks, else ``'sequential'``.
        pp: pipeline ranks for ``'threads'`` (default: one per stage); each gets a contiguous run
            of the plan's stages. Under ``'dist'`` it is the world size over ``dp``.
        dp: data-parallel replicas under ``'dist'``: world rank ``d * pp + r`` is replica ``d``'s
            rank ``r``, and the replicas split the prompts.
        timeout: seconds any one message between ranks may take.
        precision: ``'fp32'``, ``'bf16'`` or ``'fp16'`` (autocast to that dtype over the fp32
            weights, on every rank whatever the transport), or a
            :class:`~runtime.precision.MixedPrecision`; default: the one the plan was costed for.
            A caller's ``torch.autocast`` around :meth:`generate` is honoured too, on every rank
            (a :class:`~runtime.precision.AutocastConflictError` if it names another low dtype).
        check: run the self-check (:func:`runtime.generate.selfcheck.self_check`): a 6-token
            probe prefill through the stages must give the model's own logits, or the build
            fails. It needs every stage in this process (skipped on a ``'dist'`` rank that holds
            only its own).

    Raises:
        PlanMismatchError: the plan is not bound to a model.
        GenerateModelError: the model is not a decoder-only causal LM of transformers, or its
            forward computes something between its parts that a generation step cannot.
        SelfCheckError: the probe's logits through the stages differ from the model's own.
        GenerateFamilyError: a family's module raised on the generator's path.
        CutInsideBlockError: the plan cuts inside a layer, or out of model order.
        PrecisionError: an unknown ``precision``.
        MaterializeError, WeightsError: building or loading the stages failed.

    Example:
        >>> import torch, transformers
        >>> from partitioner import partition
        >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
        ...                                num_attention_heads=2, intermediate_size=32)
        >>> model = transformers.LlamaForCausalLM(cfg).eval()
        >>> plan = partition(model, (torch.zeros(1, 8, dtype=torch.long),), 2)
        >>> out = Generator(plan).generate([[5, 6, 7], [8, 9]], max_new_tokens=4)
        >>> out.sequences.shape, [len(t) for t in out.tokens]
        (torch.Size([2, 7]), [4, 4])
    """

    def __init__(
        self, plan: Plan, *, weights: str | os.PathLike[str] | Weights | None = None,
        device: torch.device | str | None = None, seed: int = 0, init_fn: InitFn | None = None,
        transport: str = "auto", pp: int | None = None, dp: int = 1, timeout: float = 300.0,
        precision: str | MixedPrecision | None = None, check: bool = True,
    ) -> None:
        self.plan = plan
        self.precision = resolve_precision(precision, plan.precision)
        parts = decoder_parts(plan.model)
        glue = derive_glue(plan, parts)
        # The base model's other children: on the embedding side, before the norm, or between the norm and the head.
        self.parts: DecoderParts = replace(parts, others=tuple(n for n in parts.others if n in glue.pre),
                                           tail=glue.tail, post=glue.post, glue=glue)
        self.spans: tuple[StageSpan, ...] = stage_spans(plan, self.parts)
        self.transport = _transport(transport)
        self.timeout = timeout
        self.layout: Layout | None = None
        if self.transport == "dist":
            self.layout = dist_layout(dp)
            if pp is not None and pp != self.layout.ranks:
                raise GenerateOptionError(
                    f"pp={pp} but the world's {dist.get_world_size()} ranks in dp={dp} replicas make pipelines of "
                    f"{self.layout.ranks}: launch dp x pp ranks, or leave pp out"
                )
            self.per_rank = rank_spans(self.spans, self.layout.ranks)
            own = self.per_rank[self.layout.position]
            device = default_device() if device is None and dist.get_backend() == "nccl" else device
        else:
            if dp != 1:
                raise GenerateOptionError(f"dp={dp} needs transport='dist' (a process per rank), got {transport!r}")
            self.per_rank = rank_spans(self.spans, len(self.spans) if pp is None else pp)
            own = self.spans
        self.load_report: LoadReport | None
        self.modules, self.load_report = build_stages(plan, self.parts, own, weights=weights, device=device,
                                                      seed=seed, init_fn=init_fn)
        self.stages = [StageRunner(self.parts, span) for span in own]
        first = next((t for m in self.modules.values() for t in m.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        if check and len(own) == len(self.spans):
            self_check(self.parts, self.spans, self.device)
        elif check:
            log.info("generator: the self-check needs every stage in one process; this rank holds %d of %d",
                     len(own), len(self.spans))
        log.info("generator (%s, %d pipeline ranks): %d stages: %s", self.transport, len(self.per_rank),
                 len(self.spans), ", ".join(_describe(s) for s in self.spans))

    @torch.no_grad()
    def generate(
        self, prompts: Prompts, *, attention_mask: torch.Tensor | None = None,
        max_new_tokens: int | Sequence[int] = 20, eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None, sampling: Sampling | None = None, output_logits: bool = False,
        groups: int | None = None, group_size: int | None = None, prefill_chunk: int | None = None,
    ) -> Generation:
        """Continue each prompt until it emits an end-of-sequence token or its ``max_new_tokens``.

        Args:
            prompts: token id lists of any lengths, or a (B, T0) tensor of left-padded ids with
                ``attention_mask`` (as a tokenizer with ``padding_side='left'`` gives; without a
                mask, every position is a token).
            attention_mask: (B, T0), 1 on tokens and 0 on left padding, for tensor ``prompts``.
            max_new_tokens: the most new tokens, for all sequences or one per sequence.
            eos_token_id: token(s) that stop a sequence; default the model's
                ``generation_config.eos_token_id``.
            pad_token_id: what pads prompts on the left and sequences after their stop; default the
                model's ``generation_config.pad_token_id``, else the first end-of-sequence token, else 0.
            sampling: ``None`` for greedy decoding, or a :class:`~runtime.generate.sampling.Sampling`.
            output_logits: keep each step's logits in ``Generation.logits``.
            groups: how many groups of sequences are in flight at once (each with its own cache
                on each stage); default: one per pipeline rank (``'threads'``, ``'dist'``, per
                replica), one for ``'sequential'``. The tokens do not depend on it.
            group_size: ``None`` (default): the batch (each replica's share) is split evenly into
                ``groups`` groups that all start at once. An int: it is cut into groups of this
                many sequences, ``groups`` of them in flight, and each group that ends gives its
                place to the next (continuous batching: memory for ``groups x group_size``
                sequences' caches, however many prompts). The tokens do not depend on it.
            prefill_chunk: ``None`` (default): a group's whole padded prompt is one hop. An int:
                the prompt enters the pipeline in pieces of this many positions, each stage
                extending its cache piece by piece, so the next rank starts on the first piece
                while this one runs the second (the pipeline fills sooner; a chunked prefill).
                Tokens and logits are a whole prompt's up to the round-off of the smaller products.

        Within a group, a sequence that stops leaves it: no stage computes for it again, and
        its rows leave every stage's cache.

        Under ``'dist'`` every rank calls this with the same arguments, and every rank returns
        the whole batch's :class:`Generation`. The stages compute in the generator's precision,
        or in the caller's ``torch.autocast`` around this call (on every rank thread too).

        Returns:
            A :class:`Generation`.

        Raises:
            GenerateOptionError: an empty prompt, right padding, a bad ``max_new_tokens`` or
                ``prefill_chunk``.
            AutocastConflictError: the caller's autocast names another low dtype than ``precision``.
        """
        precision = caller_policy(self.precision, [self.device.type], what="generate()")
        eos = _eos(self.parts, eos_token_id)
        pad = _pad(self.parts, pad_token_id, eos)
        ids, mask = _batch(prompts, attention_mask, pad, self.device)
        b = ids.shape[0]
        limits = _limits(max_new_tokens, b, self.device)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # padding's positions reach no token
        if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
            raise GenerateOptionError(f"prefill_chunk must be None or an int >= 1, got {prefill_chunk!r}")
        batch = Batch(ids, mask, positions, limits, tuple(eos), pad, sampling, output_logits, prefill_chunk)
        if self.transport != "sequential" or (groups or 1) > 1 or group_size is not None or prefill_chunk:
            return self._pipelined(batch, groups, group_size, precision)
        # One group through this generator's own stages (their caches stay readable: cached_layers).
        generators = sequence_generators(sampling, range(b), self.device) if sampling is not None else []
        for stage in self.stages:
            stage.reset()
        group = GroupState(batch, range(b))
        hop = group.prefill()
        with precision.autocast(self.device):  # the choice of tokens too, as a rank thread makes it
            while hop is not None:
                out = hop
                for stage in self.stages:
                    out = stage(out)
                generators = kept_generators(generators, hop.keep)  # the stopped sequences' leave with them
                hop = group.advance(next_tokens(out.data, sampling, generators), out.data if output_logits else None,
                                    pad)
        return _assembled(batch, {0: group.result()}, [])

    def _pipelined(self, batch: Batch, groups: int | None, group_size: int | None,
                   precision: MixedPrecision) -> Generation:
        b = batch.ids.shape[0]
        timeline: list[Step]
        ranks = self.layout.ranks if self.layout is not None else len(self.per_rank)
        in_flight = groups or (1 if self.transport == "sequential" else ranks)
        if groups is not None:
            split_groups(1, groups)  # refuses a bad count before anything runs

        def cut(rows: range) -> list[range]:  # these rows as groups, as rows of the whole batch
            if not len(rows):
                return []
            parts = split_groups(len(rows), in_flight) if group_size is None else chunk_groups(len(rows), group_size)
            return [range(rows.start + r.start, rows.start + r.stop) for r in parts]

        slots = None if group_size is None else in_flight
        if self.transport == "dist":
            assert self.layout is not None
            replicas = split_groups(b, self.layout.replicas)
            rows = replicas[self.layout.replica] if self.layout.replica < len(replicas) else range(b, b)
            results, timeline = run_dist(self.parts, self.per_rank[self.layout.position], self.layout, batch,
                                         cut(rows), self.timeout, precision, slots)
        elif self.transport == "threads":
            results, timeline = run_threads(self.parts, self.per_rank, batch, cut(range(b)), self.timeout, precision,
                                            slots)
        else:  # every stage in this thread, the groups taking turns (the ring's one rank sends to itself)
            timeline = []
            ring = Ring(LocalTransport({0: self.device}, timeout=self.timeout), 0, 1, self.device)
            with precision.autocast(self.device):
                results = run_rank(ring, self.parts, self.spans, batch, cut(range(b)), timeline, in_flight=slots)
        return _assembled(batch, results, timeline)

    def cached_layers(self) -> list[list[int]]:
        """Per stage, the layers whose keys and values its cache holds now."""
        return [stage.cached_layers() for stage in self.stages]


def _transport(transport: str) -> str:
    if transport not in ("auto", "sequential", "threads", "dist"):
        raise GenerateOptionError(
            f"transport must be 'auto', 'sequential', 'threads' or 'dist', got {transport!r}"
        )
    if transport == "auto":
        return "dist" if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else "sequential"
    return transport


def _assembled(batch: Batch, results: dict[int, GroupResult], timeline: list[Step]) -> Generation:
    """The groups' tokens as one batch: each group padded after its last step, as a stopped sequence is."""
    b = batch.ids.shape[0]
    n = max((r.tokens.shape[1] for r in results.values()), default=0)
    tokens = batch.ids.new_full((b, n), batch.pad)
    for r in results.values():
        tokens[r.rows.start:r.rows.stop, : r.tokens.shape[1]] = r.tokens
    logits = None
    if batch.output_logits:
        width = next((x.shape[1] for r in results.values() for x in r.logits), 0)
        dtype = next((x.dtype for r in results.values() for x in r.logits), torch.float32)
        logits = tuple(torch.full((b, width), float("nan"), dtype=dtype, device=batch.ids.device) for _ in range(n))
        for r in results.values():
            for step, x in enumerate(r.logits):
                logits[step][r.rows.start:r.rows.stop] = x
    trimmed = _trimmed(tokens, list(batch.eos), batch.limits)
    return Generation(torch.cat([batch.ids, tokens], dim=1), batch.mask, trimmed, n, logits,
                      tuple(sorted(timeline, key=lambda s: s.start)))


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists of any lengths as one left-padded (B, T0) tensor and its mask.

    Raises:
        GenerateOptionError: no prompts, or an empty prompt.

    Example:
        >>> left_pad([[5, 6, 7], [8]], pad_token_id=0)
        (tensor([[5, 6, 7],
                [0, 0, 8]]), tensor([[1, 1, 1],
                [0, 0, 1]]))
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        empty = [b for b, p in enumerate(prompts) if len(p) == 0]
        raise GenerateOptionError(
            f"every prompt needs at least one token; got {len(prompts)} prompts, empty: {empty} "
            "(start a prompt with the tokenizer's BOS token)"
        )
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[b, width - len(p):] = 1
    return ids, mask


def _batch(
    prompts: Prompts, attention_mask: torch.Tensor | None, pad: int, device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(prompts, torch.Tensor):
        ids, mask = left_pad(prompts, pad)
        return ids.to(device), mask.to(device)
    if prompts.ndim != 2 or prompts.shape[1] == 0:
        raise GenerateOptionError(f"prompts must be (B, T0) token ids with T0 >= 1, got shape {tuple(prompts.shape)}")
    mask = torch.ones_like(prompts) if attention_mask is None else attention_mask
    if mask.shape != prompts.shape:
        raise GenerateOptionError(
            f"attention_mask has shape {tuple(mask.shape)}, the prompts {tuple(prompts.shape)}: give one mask value "
            "per prompt token"
        )
    mask = mask.to(device=device, dtype=torch.long)
    bad = [b for b in range(mask.shape[0]) if not bool(mask[b, -1]) or bool((mask[b, 1:] < mask[b, :-1]).any())]
    if bad:
        raise GenerateOptionError(
            f"prompts {bad} are not left-padded (their mask must be 0s then 1s, ending with a token): pad on the "
            "left (tokenizer.padding_side = 'left'), or pass the prompts as lists of token ids"
        )
    return prompts.to(device=device, dtype=torch.long), mask


def _limits(max_new_tokens: int | Sequence[int], b: int, device: torch.device) -> torch.Tensor:
    values = [max_new_tokens] * b if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(values) != b or any(not isinstance(v, int) or v < 0 for v in values):
        raise GenerateOptionError(
            f"max_new_tokens must be an int >= 0 or one per prompt ({b}), got {max_new_tokens!r}"
        )
    return torch.tensor(values, dtype=torch.long, device=device)


def _eos(parts: DecoderParts, eos_token_id: int | Sequence[int] | None) -> list[int]:
    if eos_token_id is None:
        config = getattr(parts.model, "generation_config", None) or parts.config
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None:
        return []
    return [eos_token_id] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]


def _pad(parts: DecoderParts, pad_token_id: int | None, eos: list[int]) -> int:
    if pad_token_id is not None:
        return pad_token_id
    config = getattr(parts.model, "generation_config", None) or parts.config
    found = getattr(config, "pad_token_id", None)
    return int(found) if found is not None else eos[0] if eos else 0


def _trimmed(tokens: torch.Tensor, eos: list[int], limits: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    out = []
    stops = set(eos)
    for b, row in enumerate(tokens.tolist()):
        kept: list[int] = []
        for t in row[: int(limits[b])]:
            kept.append(t)
            if t in stops:
                break
        out.append(tuple(kept))
    return tuple(out)


def _describe(span: StageSpan) -> str:
    parts = ["embed"] if span.embed else []
    if len(span.layers):
        parts.append(f"layers {span.layers.start}-{span.layers.stop - 1}")
    parts += ["norm"] * span.norm + ["head"] * span.head
    return f"stage {span.index}: {' + '.join(parts) or 'nothing'}"
