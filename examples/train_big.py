"""Train a model that does not fit on one device: build on meta, plan, load per stage, train,
save, resume, export.

One process, a thread per stage::

    python examples/train_big.py --stages 2 --out /tmp/big

One stage per process (gloo on CPU, NCCL when every rank has a GPU)::

    torchrun --standalone --nproc-per-node 2 examples/train_big.py --out /tmp/big

What it does, with a Llama-style Hugging Face model built from a config (no hub), passed to
``partition`` as it is (no wrapper: its parameter names, checkpoint keys and ``ModelOutput`` are its own):

1. writes a "pretrained" safetensors checkpoint (``--out/pretrained``) once, from a small real
   model: your checkpoint stands in for it;
2. builds the model under ``runtime.empty_weights()``: parameters on ``meta`` (no memory),
   buffers such as the rotary table real;
3. plans it (every rank makes the same plan: planning is deterministic);
4. builds the trainer with ``weights=``: each rank allocates and reads only its own stages;
5. trains ``--steps`` steps, saves a checkpoint (``--out/ckpt``), trains more;
6. resumes from the checkpoint in a fresh trainer and checks that it repeats those steps
   bitwise;
7. exports the weights as a Hugging Face folder (``--out/hf``) that ``from_pretrained`` loads.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partitioner import Cut, partition
from runtime import Execution, Init, PipelineTrainer, Weights, empty_weights, save_safetensors


def config(layers: int) -> object:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128)


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """The last stage returns the model's ``CausalLMOutputWithPast``: its ``logits`` are (B, T, vocab)."""
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def batch(step: int, rows: int = 8, seq: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 256, (rows, seq + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def write_pretrained(directory: Path, layers: int) -> None:
    """Stand-in for a real pretrained checkpoint: a small real model's weights as safetensors."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config(layers))
    save_safetensors(model.state_dict(), directory, max_shard_bytes=200_000)  # several shards
    model.config.save_pretrained(directory)


def build_trainer(layers: int, stages: int, pretrained: Path, transport: str) -> PipelineTrainer:
    from transformers import LlamaForCausalLM

    with empty_weights():  # parameters on meta: nothing allocated until a rank materialises its stages
        model = LlamaForCausalLM(config(layers))
    example = batch(0, rows=2)[0]  # one micro-batch
    plan = partition(model, (example,), stages, cut=Cut(microbatches=4, schedule="1f1b"))
    return PipelineTrainer(
        plan, lm_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 4)),
        execution=Execution(transport=transport),
        init=Init(weights=Weights(pretrained)),  # the checkpoint's keys are the model's own names
    )


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="big-run", help="folder for the checkpoints")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2, help="stages (one process; under torchrun: the world size)")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if launched and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    stages = dist.get_world_size() if dist.is_initialized() else args.stages
    transport = "dist" if dist.is_initialized() else "local"
    out = Path(args.out)
    pretrained = out / "pretrained"
    if rank == 0 and not (pretrained / "model.safetensors.index.json").exists():
        write_pretrained(pretrained, args.layers)
    if dist.is_initialized():
        dist.barrier()

    trainer = build_trainer(args.layers, stages, pretrained, transport)
    say = print if rank == 0 else (lambda *a, **k: None)
    losses = [float(trainer.step(*batch(k))) for k in range(args.steps)]
    trainer.save(out / "ckpt")
    more = [float(trainer.step(*batch(k))) for k in range(args.steps, 2 * args.steps)]
    say(f"steps 1-{2 * args.steps}: losses " + " ".join(f"{x:.4f}" for x in losses + more))

    resumed = build_trainer(args.layers, stages, pretrained, transport)
    resumed.load(out / "ckpt")
    again = [float(resumed.step(*batch(k))) for k in range(args.steps, 2 * args.steps)]
    assert again == more, f"resume is not exact: {again} != {more}"
    say(f"resumed at step {args.steps} from {out / 'ckpt'}: the same {args.steps} losses, bitwise")

    resumed.export_safetensors(out / "hf")
    if rank == 0:
        from transformers import LlamaForCausalLM

        config(args.layers).save_pretrained(out / "hf")
        LlamaForCausalLM.from_pretrained(out / "hf")
        say(f"exported to {out / 'hf'}; LlamaForCausalLM.from_pretrained loads it")
    if dist.is_initialized():
        dist.barrier()
    return losses + more


if __name__ == "__main__":
    main()
