"""``pipecut generate``: a Hugging Face folder's model, planned into ``--pp`` stages, continues a file
of prompts; completions come out as JSON lines (docs/generate.md, "pipecut generate").

Legend: ``p`` stages, ``B`` prompts in a batch, ``n`` new tokens.

The folder is read as ``pipecut train`` reads it (:class:`~pipecut.folder.HFFolder`: the same
door checks, no code from the folder unless ``--trust-remote-code``), the model is built on meta,
planned with :func:`~partitioner.api.partition`, and a :class:`~runtime.generate.Generator`
gives each stage real tensors and loads only that stage's weights. The stages run one after
another in this process today.

Example::

    pipecut generate --model path/to/hf-folder --prompts prompts.jsonl --max-new-tokens 32 --pp 2
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from rich.console import Console

from partitioner.api import partition
from partitioner.cost.devices import Cluster, default_device
from partitioner.errors import CliArgumentError
from partitioner.options import Capture, Costing, Cut, Inference
from pipecut.folder import FolderError, HFFolder, max_positions
from pipecut.prompts import Prompt, PromptsError, read_prompts
from runtime.generate import Generator, Sampling
from runtime.state.weights import Weights

__all__ = ["add_generate_parser", "generate_command"]

def add_generate_parser(sub: Any) -> None:
    """Add ``pipecut generate`` to the subcommands ``sub``."""
    gen = sub.add_parser(
        "generate", help="continue a file of prompts with a Hugging Face folder's model, cut into pipeline stages",
        description="Generate completions for a file of prompts (JSON lines with a \"prompt\" field, or plain text "
        "lines) with a Hugging Face causal LM folder planned into --pp stages; JSON lines out. Greedy unless "
        "--temperature > 0. The stages run one after another in this process.",
    )
    gen.add_argument("--model", required=True, help="a Hugging Face folder: config.json, weights and a tokenizer")
    gen.add_argument("--prompts", required=True, help="a file of prompts: JSON lines {\"prompt\": ...} or text lines")
    gen.add_argument("--max-new-tokens", type=int, required=True, help="the most new tokens per prompt (>= 1)")
    gen.add_argument("--pp", type=int, default=1, help="pipeline stages the model is cut into (default 1)")
    gen.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                     help="fp32 (default) or bf16 (autocast over the fp32 weights, as pipecut train)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0 (default): greedy, the most likely token; > 0: sample at this temperature")
    gen.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens only")
    gen.add_argument("--top-p", type=float, default=None,
                     help="sample among the most likely tokens whose probability reaches p only")
    gen.add_argument("--seed", type=int, default=0,
                     help="sampling seed (default 0): the same seed gives the same text on any --pp and --batch-size")
    gen.add_argument("--batch-size", type=int, default=8, help="prompts generated together (default 8)")
    gen.add_argument("--out", default=None, help="write the completions here (default: stdout)")
    gen.add_argument("--trust-remote-code", action="store_true",
                     help="let the folder's own code (auto_map, modeling_*.py) run; off by default")


@dataclass(frozen=True)
class _Options:
    """The command's flags, checked."""

    max_new_tokens: int
    pp: int
    batch_size: int
    sampling: Sampling | None
    autocast: torch.dtype | None


def generate_command(args: argparse.Namespace) -> int:
    """Run ``pipecut generate``; returns the exit code (errors are raised, typed, for ``main``)."""
    t0 = time.perf_counter()
    opts = _options(args)
    prompts = read_prompts(args.prompts)
    folder = HFFolder(args.model, trust_remote_code=args.trust_remote_code)
    config = folder.config
    folder.check_causal_lm(config, command="pipecut generate")
    weights = folder.weights
    if weights is None:
        raise FolderError(
            f"{folder.path} holds no weights (model.safetensors, pytorch_model.bin...): generating from a random "
            "initialisation makes noise; save the trained model there (model.save_pretrained), or pass a pipecut "
            "train run's OUT/final"
        )
    if not folder.tokenizer_files:  # before the model is planned and loaded (HFFolder's message is train's)
        raise FolderError(
            f"{folder.path} has no tokenizer files (tokenizer.json, tokenizer_config.json...) to turn the prompts "
            "into tokens and the completions into text: save the model's tokenizer there (tokenizer.save_pretrained)"
        )
    tokenizer = folder.tokenizer()
    ids = _tokenized(tokenizer, prompts, args.prompts)
    length = _checked_length(ids, opts.max_new_tokens, config)
    eos, pad = _stops(folder, config)
    err = Console(stderr=True, highlight=False, markup=False, soft_wrap=True)  # a line per message, never wrapped
    generator = _generator(folder, config, weights, opts, length)
    mode = "greedy" if opts.sampling is None else "sampling"
    err.print(f"pipecut generate: {len(prompts)} prompts, {opts.pp} stage{'s' if opts.pp > 1 else ''} in this "
              f"process, {mode}, loaded in {time.perf_counter() - t0:.1f} s")
    started = time.perf_counter()
    made = 0
    with _output(args.out) as out, _Progress(err, len(prompts)) as bar:
        for start in range(0, len(prompts), opts.batch_size):
            batch = range(start, min(start + opts.batch_size, len(prompts)))
            t = time.perf_counter()
            with _autocast(generator.device, opts.autocast):
                # Each prompt samples by its place in the file, not in its batch: any --batch-size, the same text.
                sampling = dataclasses.replace(opts.sampling, first_index=start) if opts.sampling else None
                result = generator.generate([ids[i] for i in batch], max_new_tokens=opts.max_new_tokens,
                                            eos_token_id=eos, pad_token_id=pad, sampling=sampling)
            seconds = time.perf_counter() - t
            for i, tokens in zip(batch, result.tokens, strict=True):
                record = {"prompt": prompts[i].text,
                          "completion": tokenizer.decode(list(tokens), skip_special_tokens=True),
                          "prompt_tokens": len(ids[i]), "completion_tokens": len(tokens),
                          "seconds": round(seconds, 4)}
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
            made += sum(len(t) for t in result.tokens)
            bar.advance(len(batch), made, time.perf_counter() - started)
    elapsed = time.perf_counter() - started
    where = f"; written to {args.out}" if args.out else ""
    err.print(f"generated {made} tokens for {len(prompts)} prompts in {elapsed:.2f} s "
              f"({made / max(elapsed, 1e-9):.1f} tokens/s){where}")
    return 0


def _options(args: argparse.Namespace) -> _Options:
    """The flags checked before any file is read: each wrong value refused with what was given."""
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--pp", args.pp),
                        ("--batch-size", args.batch_size)):
        if value < 1:
            raise CliArgumentError(f"{flag} must be a positive integer, got {value}")
    if args.temperature < 0:
        raise CliArgumentError(f"--temperature must be 0 (greedy) or positive (sampling), got {args.temperature}")
    sampling = None
    if args.temperature > 0:
        sampling = Sampling(args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    elif args.top_k is not None or args.top_p is not None:
        raise CliArgumentError(
            f"--top-k {args.top_k} / --top-p {args.top_p} filter sampling, and --temperature 0 decodes greedily: "
            "add --temperature T (T > 0; 1 samples from the model's distribution), or drop them"
        )
    return _Options(args.max_new_tokens, args.pp, args.batch_size, sampling,
                    torch.bfloat16 if args.precision == "bf16" else None)


def _tokenized(tokenizer: Any, prompts: Sequence[Prompt], path: str) -> list[list[int]]:
    """Each prompt's token ids, with the special tokens the tokenizer adds (a BOS), as ``generate`` gets them."""
    ids = [list(tokenizer(p.text)["input_ids"]) for p in prompts]
    empty = [p.line for p, row in zip(prompts, ids, strict=True) if not row]
    if empty:
        raise PromptsError(
            f"{path}: the prompts on lines {', '.join(map(str, empty))} are empty once tokenised (0 tokens); "
            "give each prompt some text"
        )
    return ids


def _checked_length(ids: Sequence[Sequence[int]], max_new_tokens: int, config: Any) -> int:
    """The longest sequence a batch reaches (longest prompt + ``max_new_tokens``), within the model's positions."""
    longest = max(len(row) for row in ids)
    total = longest + max_new_tokens
    limit = max_positions(config)
    if limit is not None and total > limit:
        raise CliArgumentError(
            f"the longest prompt ({longest} tokens) and --max-new-tokens {max_new_tokens} reach {total} positions, "
            f"more than the model's {limit}: lower --max-new-tokens to {max(limit - longest, 0)} or shorten the prompt"
        )
    return total


def _stops(folder: HFFolder, config: Any) -> tuple[int | list[int] | None, int | None]:
    """The end-of-sequence and padding tokens ``model.generate`` uses for a model loaded from the folder:
    its ``generation_config.json``, else the ones the config names."""
    from transformers import GenerationConfig

    if (folder.path / "generation_config.json").is_file():
        gen = GenerationConfig.from_pretrained(str(folder.path), local_files_only=True)
    else:
        gen = GenerationConfig.from_model_config(config)
    return gen.eos_token_id, gen.pad_token_id


def _generator(folder: HFFolder, config: Any, weights: Path, opts: _Options, length: int) -> Generator:
    """The model on meta, cut into ``opts.pp`` stages between whole blocks for generation (each stage's fp32
    weights, the KV cache of ``--batch-size`` sequences of ``length`` positions, the slowest decode step), each
    stage made real and loaded alone."""
    model = folder.build(meta=True, config=config).eval()
    # One row of the longest prompt: the prefill the plan's working memory is counted for.
    inputs = folder.example_inputs(seq_len=max(length - opts.max_new_tokens, 1), micro_batch_size=1)
    # The stages hold fp32 weights (a bf16 checkpoint is cast up), and --precision bf16 autocasts over them.
    inference = Inference(batch=opts.batch_size, max_len=length, dtype="fp32")
    plan = partition(
        model, inputs, opts.pp, cluster=Cluster.uniform(opts.pp, default_device()), cut=Cut(), capture=Capture(),
        costing=Costing(precision="bf16" if opts.autocast is not None else "fp32", inference=inference),
    )
    # cast: a bf16 or fp16 checkpoint loads into the fp32 weights the stages compute with.
    return Generator(plan, weights=Weights(weights, cast=True))


@contextlib.contextmanager
def _output(path: str | None) -> Iterator[IO[str]]:
    """The completions' file (written as they come, line by line), or stdout."""
    if path is None:
        yield sys.stdout
        return
    with open(path, "w", encoding="utf-8") as f:
        yield f


@contextlib.contextmanager
def _autocast(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    with torch.autocast(device.type, dtype=dtype):
        yield


class _Progress:
    """Prompts done and tokens/s: a rich bar on a terminal's stderr, else a plain line per batch."""

    def __init__(self, console: Console, total: int) -> None:
        self.console = console
        self.total = total
        self.done = 0
        self._bar: Any = None
        self._task: Any = None
        if console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[info]}"), console=console)
            self._task = self._bar.add_task("prompts", total=total, info="")

    def __enter__(self) -> _Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def advance(self, prompts: int, tokens: int, seconds: float) -> None:
        """``prompts`` more done; ``tokens`` generated in all in ``seconds``."""
        self.done += prompts
        info = f"{tokens} tokens, {tokens / max(seconds, 1e-9):.1f} tokens/s"
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, info=info)
        else:
            self.console.print(f"{self.done}/{self.total} prompts: {info}")
