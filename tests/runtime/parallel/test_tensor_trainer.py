"""Tensor parallelism wired into the trainer: a Llama from transformers on 4 gloo processes, 2 tp x
2 pp (world rank ``(d * pp + s) * tp + t``), trains as the plain model does: the loss, every
gradient (shards gathered) and the parameters after 3 clipped AdamW steps, under 1F1B, ZB-H1 and
interleaved, with recompute and bf16; and what does not compose yet, refused."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
from torch import nn

from runtime.transport.launch import spawn
from tests.runtime.parity import TOL


def _loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def _llama(layers: int = 4) -> nn.Module:
    import transformers as T

    torch.manual_seed(0)
    cfg = T.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        num_hidden_layers=layers, vocab_size=96, max_position_embeddings=32, attention_dropout=0.0)
    return T.LlamaForCausalLM(cfg)


def _batch(gen: torch.Generator, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 96, (rows, 8), generator=gen), torch.randint(0, 96, (rows, 8), generator=gen)


def _case(schedule: str, stages: int, **opts: Any) -> dict[str, Any]:
    """One trainer of this rank (tp 2) against the plain model: forward_backward, then 3 clipped AdamW steps."""
    from torch.distributed.tensor import DTensor

    from partitioner import partition
    from runtime.options import TensorParallel
    from runtime.trainer import PipelineTrainer

    started = time.perf_counter()
    model = _llama()
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(5)
    x, y = _batch(gen)
    # Stages begin at blocks: a cut between a column layer and its row layer cannot be split.
    starts = [f"model.layers.{k * 4 // stages}" for k in range(1, stages)]
    plan = partition(model, (x[:2],), stages, microbatches=4, schedule=schedule, split_points=starts)
    # foreach=True: one multi-tensor update over DTensor shards and whole tensors together (CPU
    # defaults to the per-tensor loop). Adam divides by sqrt(v): a gradient near 0 turns the
    # round-off of the row-parallel sums (split in two, then all-reduced) into a visible step;
    # eps=1e-5 bounds that amplification to TOL (1e-6 left one element of 1,024 at 3e-6).
    opt = lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, eps=1e-5, foreach=True)  # noqa: E731
    trainer = PipelineTrainer(plan, _loss, opt, schedule=schedule, transport="dist",
                              tensor_parallel=TensorParallel(size=2), **opts)
    loss = trainer.forward_backward(x, y)
    ref.zero_grad()
    want_loss = _loss(ref(x), y)
    want_loss.backward()
    torch.testing.assert_close(loss, want_loss.detach(), **TOL)
    grads = {n: p.grad for n, p in ref.named_parameters()}
    sharded = []
    for n, prm in trainer.named_parameters():
        assert prm.grad is not None, n
        if isinstance(prm, DTensor):
            sharded.append(n)
        g = prm.grad.full_tensor() if isinstance(prm.grad, DTensor) else prm.grad
        torch.testing.assert_close(g, grads[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
    trainer.zero_grad()
    ref_opt = opt(list(ref.parameters()))
    norms = []
    for _ in range(3):
        x, y = _batch(gen)
        trainer.step(x, y, max_norm=0.5)
        ref_opt.zero_grad()
        _loss(ref(x), y).backward()
        norms.append((float(trainer.last_grad_norm), float(nn.utils.clip_grad_norm_(ref.parameters(), 0.5))))
        ref_opt.step()
    want = dict(ref.named_parameters())
    for n, prm in trainer.named_parameters():
        got = prm.detach().full_tensor() if isinstance(prm, DTensor) else prm.detach()
        torch.testing.assert_close(got, want[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
    return {"sharded": sharded, "checked": len(list(trainer.named_parameters())), "norms": norms,
            "tp_rank": trainer.mesh.tp_rank, "pp_rank": trainer.mesh.pp_rank, "stages": sorted(trainer.stages),
            "seconds": time.perf_counter() - started}


def _worker(rank: int, world: int, cases: list[tuple[str, int, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for schedule, stages, opts in cases:
        key = schedule + "".join(f" {k}={v}" for k, v in opts.items())
        try:
            out[key] = _case(schedule, stages, **opts)
        except Exception as e:  # noqa: BLE001 - the exploration reports every case
            import traceback
            out[key] = {"error": f"{type(e).__name__}: {e}"[:3000], "tb": traceback.format_exc()[-3000:]}
    return out


if __name__ == "__main__":
    import sys
    cases = [("1f1b", 2, {}), ("zbh1", 2, {}), ("interleaved", 4, {}), ("1f1b", 2, {"recompute": True}),
             ("1f1b", 2, {"precision": "bf16"})]
    sel = [c for c in cases if c[0] in sys.argv[1:] or not sys.argv[1:]]
    t = time.time()
    res = spawn(_worker, 4, sel, timeout=600)
    for r, d in enumerate(res):
        for k, v in d.items():
            print(r, k, {a: b for a, b in v.items() if a != "sharded"} if "error" not in v else v["error"][:1500])
    if "error" in res[0].get(next(iter(res[0])), {}):
        print(next(iter(res[0].values())).get("tb"))
    print("total", time.time() - t)
