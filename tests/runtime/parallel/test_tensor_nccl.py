"""Tensor parallelism over NCCL: the Llama of test_tensor_trainer.py split over 2 GPUs per stage
(2 tp x 2 pp on 4 GPUs, 2 tp x 1 pp on 2 or 3), one process per GPU, trains as the plain model
on the CPU does: the loss, every gradient (shards gathered) and the parameters after 3 clipped
AdamW steps, within the GPU tests' tolerance.

Marked ``gpu``: skipped without CUDA or with fewer than 2 GPUs (tp = 2 needs one per rank).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
from torch import nn

from runtime.transport.launch import spawn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason=f"tp=2 over NCCL needs 2 GPUs, one per rank; {torch.cuda.device_count()} found"),
]

# GPU kernels (TF32 off, but other reduction orders) against the CPU in fp32, as tests/runtime/test_gpu.py.
GPU_TOL = {"rtol": 1e-4, "atol": 1e-5}


def _worker(rank: int, world: int, pp: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from partitioner import partition
    from runtime.options import TensorParallel
    from runtime.trainer import PipelineTrainer
    from tests.runtime.parallel.test_tensor_trainer import _batch, _llama, _loss

    os.environ["LOCAL_RANK"] = str(rank)  # the trainer's device under NCCL
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _llama()
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(5)
    x, y = _batch(gen)
    starts = ["model.layers.2"] if pp == 2 else []
    plan = partition(model, (x[:2],), pp, microbatches=4, schedule="1f1b", split_points=starts)
    opt = lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, eps=1e-5, foreach=True)  # noqa: E731
    trainer = PipelineTrainer(plan, _loss, opt, schedule="1f1b", transport="dist",
                              tensor_parallel=TensorParallel(size=2))
    loss = trainer.forward_backward(x, y)
    ref.zero_grad()
    want_loss = _loss(ref(x), y)
    want_loss.backward()
    torch.testing.assert_close(loss.cpu(), want_loss.detach(), **GPU_TOL)
    want = dict(ref.named_parameters())
    sharded = 0
    for n, prm in trainer.named_parameters():
        assert prm.grad is not None, n
        g = prm.grad.full_tensor() if isinstance(prm.grad, DTensor) else prm.grad
        assert g.is_cuda, f"{n}'s gradient is on {g.device}"
        torch.testing.assert_close(g.cpu(), want[n].grad, **GPU_TOL, msg=lambda m, n=n: f"{n}: {m}")
        sharded += any(not pl.is_replicate() for pl in getattr(prm, "placements", ()))
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
    for n, prm in trainer.named_parameters():
        got = prm.detach().full_tensor() if isinstance(prm, DTensor) else prm.detach()
        torch.testing.assert_close(got.cpu(), want[n].detach(), **GPU_TOL, msg=lambda m, n=n: f"{n}: {m}")
    return {"device": str(next(iter(trainer.devices.values()))), "sharded": sharded, "norms": norms,
            "pp_rank": trainer.mesh.pp_rank, "tp_rank": trainer.mesh.tp_rank}


def test_2_tp_over_nccl_trains_as_the_plain_model() -> None:
    pytest.importorskip("transformers")
    pp = 2 if torch.cuda.device_count() >= 4 else 1
    runs = spawn(_worker, 2 * pp, pp, backend="nccl", timeout=420)
    for rank, r in enumerate(runs):
        # _worker compared the loss, every gradient and the stepped parameters; here, the layout.
        assert r["device"] == f"cuda:{rank}" and (r["pp_rank"], r["tp_rank"]) == divmod(rank, 2)
        assert r["sharded"] == 7 * 4 // pp  # q, k, v, o, gate, up, down of each block this rank holds
        for mine, plain in r["norms"]:
            assert mine == pytest.approx(plain, rel=1e-4)
