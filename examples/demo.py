"""pipecut in one minute: plan a GPT-2, read the plan, train it as a pipeline, check the gradients.

Run (one process, all stages on CPU threads)::

    python examples/demo.py

It builds a small GPT-2 from a config (no download), cuts it into 4 stages with the exact
partitioner, prints the plan, checks that one pipelined backward gives the unpartitioned model's
gradients, then trains a few 1F1B steps on a toy counting task and prints the loss falling.
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn

from partitioner import Cluster, Cut, partition
from partitioner.zoo import gpt2
from runtime import Execution, PipelineTrainer


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, mean over every position."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def counting_task(batch: int, seq: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that count up from a random start (mod vocab): each next token is learnable."""
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    x = (start + torch.arange(seq)) % vocab
    return x[:, :-1], x[:, 1:]


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    vocab, seq, micro, m = 128, 33, 4, 8
    model, _ = gpt2(n_layer=4, n_embd=64, n_head=4, vocab_size=vocab, n_positions=64)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    example, _ = counting_task(micro, seq, vocab, gen)  # one micro-batch: the plan is per micro-batch

    t0 = time.perf_counter()
    plan = partition(model, (example,), 4, cluster=Cluster.uniform(4, "A100-80GB"), cut=Cut(microbatches=m))
    print(plan)
    print(f"planned in {time.perf_counter() - t0:.2f} s\n")

    trainer = PipelineTrainer(
        plan, lm_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-2), execution=Execution(schedule="1f1b", microbatches=m)
    )
    x, y = counting_task(micro * m, seq, vocab, gen)
    loss = trainer.forward_backward(x, y)
    ref_loss = lm_loss(reference(x), y)
    ref_loss.backward()
    ref_grads = dict(reference.named_parameters(remove_duplicate=False))
    worst = max(
        (prm.grad - ref_grads[name].grad).abs().max().item() for name, prm in trainer.named_parameters()
    )
    print(f"pipelined loss {loss.item():.6f} vs unpartitioned {ref_loss.item():.6f}; "
          f"largest gradient difference {worst:.2e}\n")

    for step in range(1, 31):
        x, y = counting_task(micro * m, seq, vocab, gen)
        t = time.perf_counter()
        loss = trainer.step(x, y)
        if step % 5 == 0 or step == 1:
            peak = trainer.last_peak_inflight
            print(f"step {step:2d}  loss {loss.item():.4f}  {1e3 * (time.perf_counter() - t):6.1f} ms  "
                  f"micro-batches held per stage {[peak[s] for s in sorted(peak)]}")


if __name__ == "__main__":
    main()
