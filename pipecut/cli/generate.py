"""``pipecut generate``: a Hugging Face folder's model, planned into ``--pp`` stages, continues a file
of prompts; completions come out as JSON lines (docs/generate.md, "pipecut generate").

Legend: ``p`` stages (``--pp``), ``d`` replicas (``--dp``), ``B`` prompts in a batch, ``n`` new tokens.

The folder is opened and the generator built by :mod:`pipecut.generate.folder_generator` (the same door
checks as ``pipecut train``; the model on meta, planned with :func:`~partitioner.api.partition`,
each stage made real and loaded alone). In one process the stages run one after another
(measured faster there than a thread per stage: docs/generate.md). Under torchrun each of the
``d x p`` processes plans the same cut and builds and loads only its own stage; the replicas split
each batch; global rank 0 alone writes the completions, the progress and the summary
(:mod:`pipecut.generate.job`: the layout, the ranks' checks, one-line errors).

Examples::

    pipecut generate --model path/to/hf-folder --prompts prompts.jsonl --max-new-tokens 32 --pp 2
    torchrun --standalone --nproc-per-node 4 -m pipecut generate --model path/to/hf-folder \\
        --prompts prompts.jsonl --max-new-tokens 32 --pp 2 --dp 2 --out completions.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

from rich.console import Console

from partitioner.errors import CliArgumentError
from pipecut.folder import FolderError
from pipecut.generate import (
    GenerationFolder,
    Job,
    Prompt,
    PromptsError,
    build_generator,
    job_layout,
    one_line_errors,
    open_generation_folder,
    read_prompts,
    together,
)
from runtime.generate import Sampling

__all__ = ["add_generate_parser", "generate_command"]


def add_generate_parser(sub: Any) -> None:
    """Add ``pipecut generate`` to the subcommands ``sub``."""
    gen = sub.add_parser(
        "generate", help="continue a file of prompts with a Hugging Face folder's model, cut into pipeline stages",
        description="Generate completions for a file of prompts (JSON lines with a \"prompt\" field, or plain text "
        "lines) with a Hugging Face causal LM folder planned into --pp stages; JSON lines out. Greedy unless "
        "--temperature > 0. In one process the stages run one after another; under torchrun "
        "(--nproc-per-node = dp x pp) each process runs one stage of one replica.",
    )
    gen.add_argument("--model", required=True, help="a Hugging Face folder: config.json, weights and a tokenizer")
    gen.add_argument("--prompts", required=True, help="a file of prompts: JSON lines {\"prompt\": ...} or text lines")
    gen.add_argument("--max-new-tokens", type=int, required=True, help="the most new tokens per prompt (>= 1)")
    gen.add_argument("--pp", type=int, default=None,
                     help="pipeline stages the model is cut into (default: 1 in one process; under torchrun the "
                     "world size / --dp)")
    gen.add_argument("--dp", type=int, default=None,
                     help="data-parallel replicas of the pipeline, under torchrun only, each taking a share of "
                     "every batch (default: the world size / --pp)")
    gen.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                     help="fp32 (default) or bf16 (autocast over the fp32 weights on every rank, as pipecut train)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0 (default): greedy, the most likely token; > 0: sample at this temperature")
    gen.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens only")
    gen.add_argument("--top-p", type=float, default=None,
                     help="sample among the most likely tokens whose probability reaches p only")
    gen.add_argument("--seed", type=int, default=0,
                     help="sampling seed (default 0): the same seed gives the same text on any --pp, --dp and "
                     "--batch-size")
    gen.add_argument("--batch-size", type=int, default=8, help="prompts generated together (default 8)")
    gen.add_argument("--prefill-chunk", type=int, default=None,
                     help="prompt positions per prefill message between stages: each prompt enters the pipeline "
                     "in pieces, so the next stage starts sooner (default: the whole prompt at once)")
    gen.add_argument("--out", default=None, help="write the completions here (default: stdout)")
    gen.add_argument("--timeout", type=float, default=300.0,
                     help="under torchrun, seconds any rank waits for another (a message, or the others loading "
                     "their stages) before it gives up (default 300)")
    gen.add_argument("--trust-remote-code", action="store_true",
                     help="let the folder's own code (auto_map, modeling_*.py) run; off by default")


@dataclass(frozen=True)
class _Options:
    """The command's flags, checked."""

    max_new_tokens: int
    pp: int | None
    dp: int | None
    batch_size: int
    sampling: Sampling | None
    precision: str
    timeout: float
    prefill_chunk: int | None


def generate_command(args: argparse.Namespace) -> int:
    """Run ``pipecut generate``; returns the exit code (errors are raised, typed, for ``main``)."""
    t0 = time.perf_counter()
    opts = _options(args)
    job = job_layout(opts.pp, opts.dp, timeout=opts.timeout)
    with one_line_errors(job):
        return _generate(args, opts, job, t0)


def _generate(args: argparse.Namespace, opts: _Options, job: Job, t0: float) -> int:
    """Every rank: read, check, build and load its stages, then generate batch after batch; rank 0 writes."""
    # What one rank alone could fail (its own copy of the files) is checked together before anything is loaded.
    read = together(job, "reading the prompts and the model folder", lambda: _read(args, opts))
    prompts, opened, tokenizer, ids = read.prompts, read.opened, read.tokenizer, read.ids
    generator = together(job, "loading its stages", lambda: build_generator(
        opened, pp=job.pp, dp=job.dp, transport="dist" if job.world > 1 else "sequential", precision=opts.precision,
        seq_len=read.length, timeout=opts.timeout, batch=opts.batch_size,
        prompt_len=read.length - opts.max_new_tokens))
    err = Console(stderr=True, highlight=False, markup=False, soft_wrap=True, quiet=not job.leader)
    mode = "greedy" if opts.sampling is None else "sampling"
    err.print(f"pipecut generate: {len(prompts)} prompts, {_where(job)}, {mode}, "
              f"loaded in {time.perf_counter() - t0:.1f} s")
    started = time.perf_counter()
    made = 0
    with _output(args.out if job.leader else None, job.leader) as out, _Progress(err, len(prompts)) as bar:
        for start in range(0, len(prompts), opts.batch_size):
            batch = range(start, min(start + opts.batch_size, len(prompts)))
            t = time.perf_counter()
            # Each prompt samples by its place in the file, not in its batch: any --batch-size, the same text.
            sampling = dataclasses.replace(opts.sampling, first_index=start) if opts.sampling else None
            result = generator.generate([ids[i] for i in batch], max_new_tokens=opts.max_new_tokens,
                                        eos_token_id=opened.eos_token_id, pad_token_id=opened.pad_token_id,
                                        sampling=sampling, prefill_chunk=opts.prefill_chunk)
            seconds = time.perf_counter() - t
            for i, tokens in zip(batch, result.tokens, strict=True):
                record = {"prompt": prompts[i].text,
                          "completion": tokenizer.decode(list(tokens), skip_special_tokens=True),
                          "prompt_tokens": len(ids[i]), "completion_tokens": len(tokens),
                          "seconds": round(seconds, 4)}
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
            made += sum(len(t) for t in result.tokens)  # every replica's: each rank gets the whole batch's tokens
            bar.advance(len(batch), made, time.perf_counter() - started)
    elapsed = time.perf_counter() - started
    where = f"; written to {args.out}" if args.out else ""
    err.print(f"generated {made} tokens for {len(prompts)} prompts in {elapsed:.2f} s "
              f"({made / max(elapsed, 1e-9):.1f} tokens/s){where}")
    return 0


@dataclass(frozen=True)
class _Read:
    """The prompts, the folder and the prompts' tokens: what every rank reads before it loads anything."""

    prompts: list[Prompt]
    opened: GenerationFolder
    tokenizer: Any
    ids: list[list[int]]
    length: int


def _read(args: argparse.Namespace, opts: _Options) -> _Read:
    prompts = read_prompts(args.prompts)
    opened = open_generation_folder(args.model, trust_remote_code=args.trust_remote_code, command="pipecut generate")
    tokenizer = _tokenizer(opened)
    ids = _tokenized(tokenizer, prompts, args.prompts)
    return _Read(prompts, opened, tokenizer, ids, _checked_length(ids, opts.max_new_tokens, opened.max_positions))


def _where(job: Job) -> str:
    """Where the stages run, for the first line."""
    stages = f"{job.pp} stage{'s' if job.pp > 1 else ''}"
    if job.world == 1:
        return f"{stages} in this process" + (", one after another" if job.pp > 1 else "")
    return f"{stages} x {job.dp} replica{'s' if job.dp > 1 else ''} on {job.world} processes"


def _options(args: argparse.Namespace) -> _Options:
    """The flags checked before any file is read: each wrong value refused with what was given."""
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--pp", args.pp), ("--dp", args.dp),
                        ("--batch-size", args.batch_size), ("--prefill-chunk", args.prefill_chunk)):
        if value is not None and value < 1:
            raise CliArgumentError(f"{flag} must be a positive integer, got {value}")
    if not args.timeout > 0:
        raise CliArgumentError(f"--timeout must be a positive number of seconds, got {args.timeout}")
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
    return _Options(args.max_new_tokens, args.pp, args.dp, args.batch_size, sampling, args.precision, args.timeout,
                    args.prefill_chunk)


def _tokenizer(opened: GenerationFolder) -> Any:
    """The folder's tokenizer, before the model is planned and loaded (HFFolder's message is train's)."""
    if opened.tokenizer is None:
        raise FolderError(
            f"{opened.folder.path} has no tokenizer files (tokenizer.json, tokenizer_config.json...) to turn the "
            "prompts into tokens and the completions into text: save the model's tokenizer there "
            "(tokenizer.save_pretrained)"
        )
    return opened.tokenizer


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


def _checked_length(ids: Sequence[Sequence[int]], max_new_tokens: int, limit: int | None) -> int:
    """The longest sequence a batch reaches (longest prompt + ``max_new_tokens``), within the model's positions."""
    longest = max(len(row) for row in ids)
    total = longest + max_new_tokens
    if limit is not None and total > limit:
        raise CliArgumentError(
            f"the longest prompt ({longest} tokens) and --max-new-tokens {max_new_tokens} reach {total} positions, "
            f"more than the model's {limit}: lower --max-new-tokens to {max(limit - longest, 0)} or shorten the prompt"
        )
    return total


@contextlib.contextmanager
def _output(path: str | None, leader: bool) -> Iterator[IO[str]]:
    """The completions' file (written as they come, line by line), or stdout; on ranks other than 0, nowhere."""
    if not leader:
        with open(os.devnull, "w", encoding="utf-8") as f:
            yield f
        return
    if path is None:
        yield sys.stdout
        return
    with open(path, "w", encoding="utf-8") as f:
        yield f


class _Progress:
    """Prompts done and tokens/s: a rich bar on a terminal's stderr, else a plain line per batch."""

    def __init__(self, console: Console, total: int) -> None:
        self.console = console
        self.total = total
        self.done = 0
        self._bar: Any = None
        self._task: Any = None
        if console.is_terminal and not console.quiet:  # ranks other than 0 stay silent
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
