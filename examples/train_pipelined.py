"""Train a GPT-2 as a pipeline: the same script in one process or one stage per process.

One process, every stage on its own thread (CPU)::

    python examples/train_pipelined.py --stages 4

One stage per process (gloo on CPU, NCCL when every rank has a GPU)::

    torchrun --standalone --nproc-per-node 4 examples/train_pipelined.py

Data x pipeline parallelism: 2 replicas of a 2-rank pipeline, each on half of the global batch,
gradients averaged across replicas (the same step as one pipeline on the whole batch)::

    torchrun --standalone --nproc-per-node 4 examples/train_pipelined.py --dp 2 --pp 2

Two nodes (run on each, with the first node's address)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/train_pipelined.py --layers 16

bf16 autocast, every stage recomputing its activations, optimizer state sharded over replicas::

    torchrun --standalone --nproc-per-node 4 examples/train_pipelined.py --dp 2 --pp 2 \
        --precision bf16 --recompute --shard-optimizer

Zero-bubble V schedule, two stages per process, and the last step's trace for Perfetto::

    torchrun --standalone --nproc-per-node 2 examples/train_pipelined.py --schedule zbv --trace zbv.json

Every rank builds the same model from the same seed and makes the same plan (planning is
deterministic), then keeps only its own stages. The loss printed is the whole (global) batch's
mean loss. The learning rate warms up linearly, then decays (a torch LR scheduler), and
gradients are clipped to a total norm of 1 over all stages.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from partitioner import Cluster, Costing, Cut, partition
from partitioner.schedule.registry import stages_per_rank
from partitioner.zoo import gpt2
from runtime import DataParallel, Execution, PipelineTrainer, TrainingProgress
from runtime.metrics import describe


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def batch(size: int, seq: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Counting sequences from random starts: next token = previous + 1 (mod vocab)."""
    start = torch.randint(0, vocab, (size, 1), generator=gen)
    x = (start + torch.arange(seq + 1)) % vocab
    return x[:, :-1], x[:, 1:]


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    parser.add_argument("--stages", type=int, default=None,
                        help="pipeline stages (default: pp x stages per rank)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline (torchrun)")
    parser.add_argument("--pp", type=int, default=None, help="ranks per pipeline (default: WORLD_SIZE / dp, or 4)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "zbh1", "interleaved", "zbv"))
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--max-norm", type=float, default=1.0, help="clip gradients to this total norm")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                        help="autocast over fp32 weights (fp16 with loss scaling); activations cross stages in it")
    parser.add_argument("--recompute", action="store_true",
                        help="every stage recomputes its forward in backward (default: where the plan says)")
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="with --dp > 1: each replica keeps the optimizer state of its share of the parameters")
    parser.add_argument("--progress", action="store_true", help="a progress bar instead of a line every 5 steps")
    parser.add_argument("--trace", default="", help="write the last step as a Chrome/Perfetto trace here")
    args = parser.parse_args(argv)
    per_rank = stages_per_rank(args.schedule)
    if args.pp is None:
        args.pp = int(os.environ.get("WORLD_SIZE", str(4 * args.dp))) // args.dp
    if args.stages is None:
        args.stages = args.pp * per_rank

    torch.set_num_threads(1)
    torch.manual_seed(0)  # same weights on every rank
    vocab = 128
    model, _ = gpt2(n_layer=args.layers, n_embd=args.width, n_head=4, vocab_size=vocab,
                    n_positions=max(64, args.seq), batch=args.micro_batch_size, seq=args.seq)
    gen = torch.Generator().manual_seed(1)  # same data on every rank
    example, _ = batch(args.micro_batch_size, args.seq, vocab, gen)
    device = "H100-80GB" if torch.cuda.is_available() else "cpu"
    ranks = max(1, args.stages // per_rank)
    plan = partition(model, (example,), args.stages, cluster=Cluster.uniform(ranks, device),
                     cut=Cut(microbatches=args.microbatches, schedule=args.schedule),
                     costing=Costing(precision=args.precision))
    warmup = max(1, args.steps // 5)
    schedule = lambda opt: torch.optim.lr_scheduler.LambdaLR(  # noqa: E731
        opt, lambda i: min(1.0, (i + 1) / warmup) * max(0.1, 1 - i / args.steps))
    trainer = PipelineTrainer(
        plan, lm_loss, lambda ps: torch.optim.AdamW(ps, lr=args.lr), lr_scheduler=schedule,
        recompute=True if args.recompute else None,
        execution=Execution(schedule=args.schedule, record=bool(args.trace)),
        data_parallel=DataParallel(size=args.dp if launched else None,
                                   shard_optimizer=args.shard_optimizer and launched),
    )
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        print(plan)
        how = f"torchrun, {trainer.mesh.dp} x {trainer.mesh.pp} (dp x pp) processes" if launched else "one process"
        print(f"training with {trainer.mode!r} transport, {how}")
    loss = torch.tensor(float("nan"))
    with TrainingProgress(total=args.steps, enabled=rank == 0 and args.progress) as bar:
        for step in range(1, args.steps + 1):
            # Every rank draws the same global batch and keeps its replica's rows (a real job
            # would give each replica its own shard of the data set).
            x, y = batch(args.micro_batch_size * args.microbatches * args.dp, args.seq, vocab, gen)
            loss = trainer.step(*trainer.local_batch(x, y), max_norm=args.max_norm)
            bar.update(trainer.last_metrics)  # a dict: hand it to any logger as well
            if rank == 0 and not args.progress and (step == 1 or step % 5 == 0):
                print(f"step {step:3d}  {describe(trainer.last_metrics)}")
    if args.trace:
        written = trainer.save_trace(args.trace)  # under torchrun: gathered, written by rank 0
        if written is not None:
            print(f"trace of the last step written to {written} (open in https://ui.perfetto.dev)")
    if dist.is_initialized():
        dist.destroy_process_group()
    return float(loss)


if __name__ == "__main__":
    main()
