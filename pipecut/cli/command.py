"""The ``pipecut`` command line: ``plan`` prints (and saves) a plan, ``simulate`` replays one,
``train`` trains a Hugging Face folder on a token file (docs/train.md), ``generate`` continues a
file of prompts with one (docs/generate.md).

Examples::

    pipecut plan gpt2-tiny --stages 4
    pipecut plan gpt2-tiny --stages 4 --schedule auto --microbatches auto --json plan.json
    pipecut simulate plan.json --schedule zbv --microbatches 16 --trace out.json
    pipecut plan gpt2-175b --stages 64 --device A100-80GB --granularity module --json plan.json
    pipecut plan gpt2-175b --devices 512 --global-batch 1536 --device A100-80GB --precision bf16 --granularity module
    pipecut plan examples/my_model.py:build --stages 2 --device cpu --dot plan.dot
    pipecut plan path/to/hf-folder --stages 8 --device H100-80GB --seq-len 4096
    pipecut plan path/to/hf-folder --inference --batch 32 --max-len 4096 --stages 4 --device H100-80GB --precision bf16
    pipecut calibrate --model gpt2-tiny --devices 4 --global-batch 16 --out cluster.json
    pipecut plan gpt2-tiny --devices 4 --global-batch 16 --calibrate cluster.json
    pipecut train --model path/to/hf-folder --data tokens.bin --out run --pp 2 --steps 100
    torchrun --standalone --nproc-per-node 4 -m pipecut train --model ... --pp 2 --dp 2
    torchrun --standalone --nproc-per-node 4 -m pipecut train --model ... --pp 2 --tp 2
    torchrun --standalone --nproc-per-node 8 -m pipecut train --model ... --layout auto --global-batch 64
    torchrun --standalone --nproc-per-node 8 -m pipecut train --model ... --plan plan.json --global-batch 64
    pipecut generate --model path/to/hf-folder --prompts prompts.jsonl --max-new-tokens 32 --pp 2
    torchrun --standalone --nproc-per-node 4 -m pipecut generate --model ... --prompts ... --pp 2 --dp 2
    pipecut --version

Exit codes: 0 done, 2 an error, 3 a device over capacity (docs/reference/errors.md, "Exit codes of the
command line").

Tables take the terminal's width (``COLUMNS`` when set); written to a file or a pipe they keep
``str(plan)``'s fixed width, so saved output has every column.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console

from partitioner.api import partition
from partitioner.cost.devices import DEVICE_PRESETS, Cluster, default_device
from partitioner.cost.recompute import RECOMPUTE_FLAGS
from partitioner.errors import CliArgumentError, InfeasibleMemoryError, PipecutError
from partitioner.options import METHODS, Capture, Costing, Cut, Inference, LayoutSpace
from partitioner.plan.layout import DEFAULT_ZERO, ZERO_OPTIONS
from partitioner.plan.plan import Plan
from partitioner.plan.predict import prediction, simulate_stages
from partitioner.plan.render import fmt_bytes, fmt_time, render_text
from partitioner.schedule.registry import TRAINING_SCHEDULES
from partitioner.search import plan_layout
from partitioner.zoo import MODELS, load_model
from pipecut.cli.calibrate import add_calibrate_parser, calibrate_command, calibrated
from pipecut.cli.common import folder_model, make_console, positive_count, positive_count_or_auto
from pipecut.cli.generate import add_generate_parser, generate_command
from pipecut.folder import is_hf_folder, max_positions

__all__ = ["main", "build_parser", "version", "EXIT_ERROR", "EXIT_OVER_CAPACITY"]

# Exit codes (docs/reference/errors.md, "Exit codes of the command line"): 0 done; 2 an error (a bad argument, model or
# plan file; argparse's usage errors too); 3 the plan does not fit: a device is over capacity (the
# row marked OVER) or no cut fits (InfeasibleMemoryError), so scripts can tell "too big" apart.
EXIT_ERROR = 2
EXIT_OVER_CAPACITY = 3


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``pipecut``."""
    parser = argparse.ArgumentParser(
        prog="pipecut", description="Cut a PyTorch model into pipeline stages and show the plan."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log each step's timing")
    parser.add_argument("--version", action="version", version=f"pipecut {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="trace, cost and partition a model; print the stage table")
    plan.add_argument(
        "model", help=f"a built-in model ({', '.join(MODELS)}), path/to/file.py:factory "
        "where factory() returns (model, example_inputs) for one micro-batch, or a Hugging Face "
        "folder (config.json; built on meta, so any size plans here)"
    )
    plan.add_argument("--stages", type=int, default=None, help="number of pipeline stages (or --devices)")
    plan.add_argument("--devices", type=positive_count, default=None,
                      help="search the whole layout of this many devices (dp x pp x tp, micro-batch size, schedule, "
                      "sharding) for --global-batch rows per step, instead of cutting --stages")
    plan.add_argument("--global-batch", type=positive_count, default=None,
                      help="rows per optimizer step (with --devices)")
    plan.add_argument("--top", type=positive_count, default=None,
                      help="layouts ranked in the table (with --devices; default 5)")
    plan.add_argument("--zero", default=None,
                      help="with --devices: the shardings over the replicas to search, comma-separated, of "
                      f"{', '.join(ZERO_OPTIONS)} (default {','.join(DEFAULT_ZERO)}; fsdp, FSDP2, only when named)")
    plan.add_argument("--tp", default=None,
                      help="with --devices: the tensor-parallel sizes to search, comma-separated (e.g. 1,2,4,8; "
                      "default: every divisor of the node size that divides the model's heads, 1 without a "
                      "Hugging Face config or a node size)")
    plan.add_argument(
        "--device", default=None, help=f"device preset for every stage ({', '.join(DEVICE_PRESETS)}); default: "
        "this machine's (its GPU's preset, else cpu), the same as pipecut train's"
    )
    plan.add_argument("--memory-reserve", default=None, metavar="SIZE",
                      help="memory each device keeps out of the plan, a size ('2GiB', '512MiB') or a share "
                      "('10%%'); default the device's own: 2 GiB + 5%% of a GPU, 0.5 GiB + 10%% of cpu")
    plan.add_argument("--microbatches", type=positive_count_or_auto, default=None,
                      help="micro-batches per step (default 8), or 'auto'")
    plan.add_argument("--schedule", default=None, choices=(*TRAINING_SCHEDULES, "auto"),
                      help="pipeline schedule (default 1f1b), or 'auto' to simulate them all and keep the fastest "
                      "that fits; with --devices every schedule is searched unless one is named")
    plan.add_argument("--method", default="exact", choices=METHODS)
    plan.add_argument("--no-refine", action="store_true", help="skip the DAG refinement after 'exact'")
    plan.add_argument("--split-points", default=None,
                      help="comma-separated module names where stages begin: full names or their ends "
                      "(h.4 for model.transformer.h.4); without --stages, one stage more than the names")
    plan.add_argument("--granularity", default=None, choices=("node", "module"),
                      help="where stages may be cut (default: between blocks for Hugging Face models, else anywhere)")
    plan.add_argument("--recompute", default=None, choices=("auto", "on", "off"),
                      help="activation recomputation: 'auto' (only the stages that do not fit memory otherwise; "
                      "default), 'on' (every stage) or 'off'")
    plan.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                      help="mixed precision the plan is costed for (autocast over fp32 weights; default fp32); with "
                      "--inference, what the weights and the KV cache are held in")
    plan.add_argument("--state-bytes", type=float, default=None, help="training-state bytes per parameter (default 16)")
    plan.add_argument("--link-bandwidth", type=float, default=None, help="bytes/s between neighbouring devices")
    plan.add_argument("--json", dest="json_path", default=None, help="write the plan as JSON here")
    plan.add_argument("--dot", dest="dot_path", default=None, help="write a Graphviz DOT picture here")
    plan.add_argument("--seq-len", type=positive_count, default=None,
                      help="a Hugging Face folder's example sequence length (default: 1024, or the model's maximum); "
                      "with --inference, the prompt's positions, the prefill (default --max-len)")
    plan.add_argument("--micro-batch-size", type=positive_count, default=None,
                      help="a Hugging Face folder's example rows per micro-batch (default 1)")
    plan.add_argument("--inference", action="store_true",
                      help="plan generation instead of training (a Hugging Face decoder): each stage's weights, KV "
                      "cache for --batch sequences of --max-len positions and working memory; cut for the slowest "
                      "decode step; says how many sequences fit (docs/generate.md, \"What the planner counts\")")
    plan.add_argument("--batch", type=positive_count, default=None,
                      help="with --inference: sequences decoded together (every stage caches each)")
    plan.add_argument("--max-len", type=positive_count, default=None,
                      help="with --inference: positions each sequence reaches, prompt and new tokens together")
    plan.add_argument("--trust-remote-code", action="store_true",
                      help="let a Hugging Face folder's own code (auto_map, modeling_*.py) run to build its model; "
                      "off by default: read that code first")
    plan.add_argument("--calibrate", metavar="FILE", default=None,
                      help="plan for the cluster in FILE, fitted to this model on this host by `pipecut calibrate "
                      "--model MODEL --devices N --out FILE` (warns when it was fitted on another model or device "
                      "count); if FILE does not exist, that fit is made first (N processes, a minute or more) and "
                      "saved there")
    add_calibrate_parser(sub)

    sim = sub.add_parser("simulate", help="simulate a saved plan under a schedule; print the step and write a trace")
    sim.add_argument("plan", help="a plan JSON file written by `pipecut plan ... --json`")
    sim.add_argument("--schedule", default=None, choices=TRAINING_SCHEDULES,
                     help="schedule to simulate (default: the plan's)")
    sim.add_argument("--microbatches", type=positive_count, default=None,
                     help="micro-batches per step (default: the plan's)")
    sim.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON here")
    sim.add_argument("--gantt", default=None, help="write a Gantt chart PNG here (needs matplotlib)")
    _add_train_parser(sub)
    add_generate_parser(sub)
    return parser


def version() -> str:
    """The installed distribution's version; from a source tree that is not installed, the package's own.

    Example:
        >>> import pipecut
        >>> version() == pipecut.__version__
        True
    """
    try:
        return importlib.metadata.version("pipecut")
    except importlib.metadata.PackageNotFoundError:
        import pipecut  # only here: the CLI itself needs none of what the package re-exports

        return pipecut.__version__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    commands = {"plan": _plan, "simulate": _simulate, "train": _train, "calibrate": calibrate_command,
                "generate": generate_command}
    try:
        return commands[args.command](args)
    except InfeasibleMemoryError as e:
        print(f"pipecut: error: {e}", file=sys.stderr)
        return EXIT_OVER_CAPACITY
    except (PipecutError, ImportError, FileNotFoundError, ValueError) as e:
        print(f"pipecut: error: {e}", file=sys.stderr)
        return EXIT_ERROR


def _tp_sizes(text: str) -> tuple[int, ...]:
    """``--tp 1,2,4,8`` as ``LayoutSpace.tp_sizes``."""
    sizes = tuple(positive_count(x.strip(), "in the comma-separated --tp list") for x in text.split(",") if x.strip())
    if not sizes:
        raise CliArgumentError(f"--tp takes comma-separated sizes such as 1,2,4,8, got {text!r}")
    return sizes


# Flags that size or search a training job, and what a plan for generation has instead of each.
_TRAINING_ONLY = {
    "devices": "--devices", "global_batch": "--global-batch", "top": "--top", "zero": "--zero", "tp": "--tp",
    "schedule": "--schedule", "microbatches": "--microbatches", "recompute": "--recompute",
    "state_bytes": "--state-bytes", "micro_batch_size": "--micro-batch-size",
}


def _inference_costing(args: argparse.Namespace) -> Costing:
    """``--inference``'s costing, once the training-only flags are refused (each named, with what to drop)."""
    given = [flag for key, flag in _TRAINING_ONLY.items() if getattr(args, key) is not None]
    if given:
        raise CliArgumentError(
            f"--inference plans generation, which has no optimizer step, micro-batches or schedule: drop "
            f"{', '.join(given)} (generation is sized by --batch sequences of --max-len positions, cut into --stages)"
        )
    if args.batch is None or args.max_len is None:
        raise CliArgumentError("--inference needs --batch N (sequences decoded together) and --max-len L "
                               "(positions each reaches, prompt and new tokens together)")
    if args.seq_len is not None and args.seq_len > args.max_len:
        raise CliArgumentError(f"--seq-len {args.seq_len} (the prompt) is longer than --max-len {args.max_len}: "
                               "a sequence reaches at least its prompt; raise --max-len or shorten --seq-len")
    dtype = args.precision if args.precision != "fp32" else None  # fp32: the model's own dtype
    return Costing(precision=args.precision, inference=Inference(batch=args.batch, max_len=args.max_len, dtype=dtype))


def _plan(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    inference: Costing | None = None
    if args.inference:
        inference = _inference_costing(args)
        args.seq_len = args.seq_len or args.max_len  # one prompt of the prefill's positions
    elif args.batch is not None or args.max_len is not None:
        raise CliArgumentError("--batch and --max-len size a plan for generation: add --inference, or drop them "
                               "(a training plan's micro-batch is --micro-batch-size rows of --seq-len)")
    if is_hf_folder(args.model):
        model, inputs = folder_model(args.model, args.seq_len, args.micro_batch_size or 1,
                                      trust_remote_code=args.trust_remote_code, command="pipecut plan")
    else:
        model, inputs = load_model(args.model)
    if args.inference:
        longest = max_positions(getattr(model, "config", None))
        if longest is not None and args.max_len > longest:
            raise CliArgumentError(f"--max-len {args.max_len} is longer than the model's {longest} positions: "
                                   f"lower it to {longest} or less")
    split = [s.strip() for s in args.split_points.split(",") if s.strip()] if args.split_points else None
    if split and args.stages is None and args.devices is None:
        args.stages = len(split) + 1  # the cuts say how many stages
    if split and args.devices is not None:
        raise CliArgumentError(
            "--split-points cuts a pipeline of --stages N; --devices searches the layout, whose depth it "
            "chooses itself: give --stages (or only --split-points) instead of --devices"
        )
    if (args.stages is None) == (args.devices is None):
        raise CliArgumentError("give --stages N (cut N stages) or --devices N --global-batch B (search the layout)")
    if args.devices is not None and args.global_batch is None:  # before a --calibrate fit runs
        raise CliArgumentError("--devices searches layouts for a global batch: add --global-batch B (rows per step)")
    count = args.devices if args.devices is not None else args.stages
    if args.calibrate:
        cluster = calibrated(args, count, model)
        if args.memory_reserve is not None:
            cluster = cluster.with_memory_reserve(args.memory_reserve)
    else:
        device = args.device if args.device not in (None, "auto") else default_device()
        if args.device in (None, "auto"):
            print(f"planning for {device}: this machine's device (the default; --device NAME plans for another)")
        cluster = Cluster.uniform(count, device, link_bandwidth=args.link_bandwidth,
                                  memory_reserve=args.memory_reserve)
    capture = Capture(granularity=args.granularity)
    costing = inference if inference is not None else Costing(
        precision=args.precision, recompute=RECOMPUTE_FLAGS[args.recompute or "auto"],
        state_bytes_per_param=16.0 if args.state_bytes is None else args.state_bytes,
    )
    top = args.top or 5
    if args.devices is not None:
        zero = args.zero if args.zero is not None else ",".join(DEFAULT_ZERO)
        space = LayoutSpace(
            schedules=(args.schedule,) if args.schedule not in (None, "auto") else None,
            zero=tuple(z.strip() for z in zero.split(",") if z.strip()), top=top,
            tp_sizes=_tp_sizes(args.tp) if args.tp is not None else None,
        )
        plan = plan_layout(model, inputs, cluster=cluster, global_batch=args.global_batch, space=space,
                           capture=capture, costing=costing)
    else:
        cut = Cut(schedule=args.schedule or "1f1b", microbatches=8 if args.microbatches is None else args.microbatches,
                  method=args.method,
                  refine=not args.no_refine, split_points=split)
        plan = partition(model, inputs, args.stages, cluster=cluster, cut=cut, capture=capture, costing=costing)
    print(render_text(plan, width=make_console().width, top=top), end="")
    if args.json_path:
        plan.save(args.json_path)
        print(f"plan written to {args.json_path}")
    if args.dot_path:
        plan.to_dot(args.dot_path)
        print(f"DOT written to {args.dot_path}")
    logging.getLogger(__name__).info("total %.2fs", time.perf_counter() - t0)
    over = [st.index for st in plan.stages if st.memory > st.capacity]
    if over and args.inference:
        print(f"pipecut: stage{'s' if len(over) > 1 else ''} {', '.join(map(str, over))} over capacity (marked OVER): "
              "use more stages, --method exact, a smaller --batch or --max-len, --precision bf16 or a larger --device "
              f"(exit code {EXIT_OVER_CAPACITY})", file=sys.stderr)
        return EXIT_OVER_CAPACITY
    if over:  # a cut that ignores memory (equal_count, split points): written, but not a success
        print(f"pipecut: stage{'s' if len(over) > 1 else ''} {', '.join(map(str, over))} over capacity "
              "(marked OVER): use more stages, --method exact, --recompute on, a smaller --state-bytes or "
              f"a larger --device (exit code {EXIT_OVER_CAPACITY})", file=sys.stderr)
        return EXIT_OVER_CAPACITY
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from rich.table import Table

    from partitioner.schedule.timeline import save_chrome_trace, save_gantt_png

    plan = Plan.load(args.plan)
    schedule = args.schedule or plan.schedule
    m = plan.microbatches if args.microbatches is None else args.microbatches
    sched, sim = simulate_stages(plan.stages, plan.cluster, schedule, m)
    pred = prediction(plan.stages, schedule, m, sched, sim)  # the step simulated once, not twice
    console = make_console()
    console.print(
        f"{args.plan}: {plan.num_stages} stages on {sched.num_ranks} ranks, schedule {schedule}, "
        f"{m} micro-batches (event simulator)"
    )
    table = Table(show_edge=False)
    for col in ("rank", "stages", "busy", "bubble", "micro-batches held", "peak memory"):
        table.add_column(col, justify="right")
    state = [0.0] * sched.num_ranks
    for s, r in enumerate(sched.stage_to_rank):
        state[r] += plan.stages[s].state_bytes
    busy = sim.busy
    peaks = sim.peak_bytes or (0.0,) * sched.num_ranks
    over: list[str] = []
    for r in range(sched.num_ranks):
        need = state[r] + peaks[r]
        capacity = min(plan.stages[s].capacity for s in sched.stages_of(r))
        if need > capacity:
            over.append(f"rank {r} ({fmt_bytes(need)} of {fmt_bytes(capacity)})")
        table.add_row(
            str(r), ",".join(map(str, sched.stages_of(r))), fmt_time(busy[r]), f"{sim.bubble[r]:.1%}",
            str(sim.peak_inflight[r]), fmt_bytes(need) + (" OVER" if need > capacity else ""),
        )
    console.print(table)
    smallest = min(st.capacity for st in plan.stages)
    console.print(
        f"step {fmt_time(sim.step_time)}, bubble {sim.bubble_total:.1%}, "
        f"fullest device {fmt_bytes(pred.memory)} of {fmt_bytes(smallest)}" + (" OVER" if over else "")
    )
    if args.trace:
        save_chrome_trace(sim.timeline, args.trace, name=f"pipecut {schedule} m={m}")
        console.print(f"trace written to {args.trace} (open in ui.perfetto.dev or chrome://tracing)")
    if args.gantt:
        save_gantt_png(sim.timeline, args.gantt, title=f"{schedule}, {m} micro-batches")
        console.print(f"Gantt chart written to {args.gantt}")
    if over:
        print(f"pipecut: over capacity: {', '.join(over)}; re-plan with more stages, fewer micro-batches "
              f"in flight or a schedule that holds fewer (exit code {EXIT_OVER_CAPACITY})", file=sys.stderr)
        return EXIT_OVER_CAPACITY
    return 0


# -- pipecut train -----------------------------------------------------------------------------

# flag -> (type, help); each is a key of pipecut.train.config.TrainConfig (docs/train.md).
_TRAIN_FLAGS: dict[str, tuple[Any, str]] = {
    "model": (str, "a Hugging Face folder: config.json, and weights to fine-tune (safetensors or pytorch_model.bin)"),
    "data": (str, "training tokens: .npy (1-D ints), .bin (raw uint16, nanoGPT's format), .txt or .jsonl"),
    "out": (str, "the run's folder: plan.json, metrics.jsonl, checkpoints/, final/"),
    "steps": (int, "optimizer steps in all (default 100); rerun with more to continue"),
    "seq-len": (int, "tokens per sequence (default 256)"),
    "global-batch": (int, "sequences per optimizer step over all replicas (default 8)"),
    "micro-batch-size": (int, "sequences per micro-batch (default 1)"),
    "pp": (int, "pipeline ranks (default: world size / dp; 1 in one process)"),
    "dp": (int, "data-parallel replicas, under torchrun (default: world size / pp)"),
    "tp": (int, ("tensor-parallel processes per pipeline rank, under torchrun: dp x pp x tp processes (default 1; "
                 "with --layout auto the planner's unless given)")),
    "schedule": (str, "pipeline schedule or 'auto' (default 1f1b)"),
    "zero": (str, "sharding over the replicas (dp >= 2): none (default), zero1 (optimizer state) or fsdp (FSDP2)"),
    "layout": (str, ("manual (default: the flags above) or auto: the planner chooses dp, pp, tp, schedule, "
                     "micro-batch size, recomputation and sharding for --global-batch; the layout flags given "
                     "constrain it")),
    "plan": (str, "train this saved plan (pipecut plan ... --json, or a run's OUT/plan.json): its layout"),
    "calibrate": (str, "with --layout auto: price the layouts on this cluster JSON (from pipecut calibrate)"),
    "precision": (str, "fp32, bf16 or fp16 (autocast over fp32 weights; default fp32)"),
    "memory-reserve": (str, "memory each device keeps out of the plan: '2GiB', '10%%' (default: the device's own)"),
    "recompute": (str, "activation recomputation: auto (where memory binds), on, off"),
    "lr": (float, "peak learning rate (default 3e-4)"),
    "warmup": (int, "steps of linear warm-up (default 0)"),
    "min-lr": (float, "learning rate at the end of the cosine decay (default lr / 10)"),
    "decay-steps": (int, "the step the decay ends at (default --steps; fix it to extend a run bitwise)"),
    "weight-decay": (float, "AdamW weight decay on matrices (default 0.1)"),
    "max-norm": (float, "clip gradients to this total norm (default 1.0)"),
    "checkpoint-every": (int, "save a checkpoint every N steps (default 100; always at the end)"),
    "keep": (int, "checkpoints kept (default 2)"),
    "eval-every": (int, "evaluate every N steps (default 0: never)"),
    "eval-data": (str, "evaluation tokens (default: another stream of --data)"),
    "eval-batches": (int, "batches per evaluation (default 4)"),
    "seed": (int, "seed of the initialisation and of the data order (default 0)"),
    "data-dtype": (str, "token type of a .bin: uint16 (default), uint32, int32, int64"),
    "device": (str, "device preset the plan is costed for (default: this machine's)"),
    "trust-remote-code": (bool, "let the folder's own code (auto_map, modeling_*.py) run; off by default"),
    "allow-nonfinite-weights": (str, ("comma-separated patterns of weight names that may load holding NaN/inf "
                                     "(e.g. '*.masked_bias'); every other loaded tensor must be finite")),
    "log-every": (int, ("a progress line every N steps, and at the first and last, on stdout when it is not a "
                        "terminal and in OUT/train.log (default: about 20 lines over --steps)")),
}

# Switches (true when given): each is a bool key of TrainConfig.
_TRAIN_SWITCHES: dict[str, str] = {
    "check-finite": "stop at a micro-batch's NaN or infinite loss before the optimizer step",
    "allow-nonfinite-loss": "train on past a NaN or infinite loss or gradient norm (default: stop, exit 2); "
                            "non-finite weights are still never checkpointed",
    "tensorboard": "also write the metrics as TensorBoard event files under OUT/tensorboard (pip install tensorboard)",
}


def _add_train_parser(sub: Any) -> None:
    train = sub.add_parser(
        "train", help="train a Hugging Face folder on a token file as a pipeline; rerun to resume",
        description="Train a Hugging Face causal LM folder on a token file, in one process (a thread per "
        "stage) or under torchrun (dp x pp x tp processes). Running the same command again resumes.",
    )
    train.add_argument("--config", dest="config_file", default=None,
                       help="a TOML file of these settings (flags override it)")
    for flag, (kind, text) in _TRAIN_FLAGS.items():
        if kind is bool:  # a switch: given or not
            train.add_argument(f"--{flag}", action="store_true", default=argparse.SUPPRESS, help=text)
        else:
            train.add_argument(f"--{flag}", type=kind, default=argparse.SUPPRESS, help=text)
    for flag, text in _TRAIN_SWITCHES.items():
        train.add_argument(f"--{flag}", action="store_true", default=argparse.SUPPRESS, help=text)


def _train(args: argparse.Namespace) -> int:
    from pipecut.train import StartReport, read_toml, resolve, train
    from pipecut.train.report import StepLog
    from runtime.metrics import TrainingProgress

    flags = {k: v for k, v in vars(args).items() if k.replace("_", "-") in {**_TRAIN_FLAGS, **_TRAIN_SWITCHES}}
    cfg = resolve(read_toml(args.config_file) if args.config_file else {}, flags)
    t0 = time.perf_counter()
    # The process group starts inside train(); under torchrun, RANK says who prints (a caller that
    # started the group itself, as torch.multiprocessing's spawn does, has no RANK: its group says).
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized()
    leader = dist.get_rank() == 0 if grouped else os.environ.get("RANK", "0") == "0"
    # A terminal gets the live bar; a file or a pipe (a batch job's log) a plain line every --log-every steps,
    # since a bar written there shows only its last frame.
    terminal = Console().is_terminal
    lines: list[StepLog] = []
    bars: list[TrainingProgress] = []

    with contextlib.ExitStack() as stack:

        def started(report: StartReport) -> None:
            if leader:
                print("\n".join(report.lines()), flush=True)
                lines.append(StepLog(steps=cfg.steps, every=cfg.log_interval))  # its clock starts at the first step
            # The bar under the block, its clock from the first step too.
            bars.append(stack.enter_context(TrainingProgress(total=cfg.steps, enabled=leader and terminal)))

        def stepped(metrics: Mapping[str, Any]) -> None:
            bars[0].update(metrics)
            text = lines[0].text(metrics) if lines and not terminal else None
            if text is not None:
                print(text, flush=True)

        result = train(cfg, on_step=stepped, on_start=started)
    if leader:
        done = len(result.metrics)
        last = result.metrics[-1] if result.metrics else None
        start = f" (resumed at step {result.resumed_from})" if result.resumed_from else ""
        loss = f", last loss {last['loss']:.4f}" if last else ""
        written = f"model written to {result.final}" if result.final else "no model written (weights not finite)"
        print(f"trained {done} steps{start} in {time.perf_counter() - t0:.1f} s{loss}; {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
