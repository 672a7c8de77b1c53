"""The CUDA paths: stages on GPUs in one process, NCCL between processes, fused weight gradients.

Marked ``gpu``; every test skips without CUDA (the NCCL test without two GPUs). Each compares the
loss and every gradient with the unpartitioned model computed on the CPU.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
from torch import nn

from parity import case, reference_grads
from partitioner import partition
from runtime import PipelineTrainer
from runtime.execute.wgrad_fusion import linear_accumulate
from runtime.transport.launch import spawn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# GPU kernels (TF32 off, but other reduction orders) are compared with the CPU's in fp32.
GPU_TOL = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(autouse=True)
def _no_tf32() -> Any:
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _like(example: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random tensor of ``example``'s shape: normal floats, or token ids below 64."""
    if example.is_floating_point():
        return torch.randn(example.shape, generator=gen)
    return torch.randint(0, 64, example.shape, generator=gen)


def _check(trainer: PipelineTrainer, loss: torch.Tensor, want_loss: torch.Tensor, want: dict[str, torch.Tensor]) -> int:
    torch.testing.assert_close(loss.cpu(), want_loss, **GPU_TOL)
    n = 0
    for name, prm in trainer.named_parameters():
        assert prm.grad is not None, f"{name} got no gradient"
        assert prm.grad.is_cuda, f"{name}'s gradient is on {prm.grad.device}"
        torch.testing.assert_close(prm.grad.cpu(), want[name], **GPU_TOL, msg=lambda m, name=name: f"{name}: {m}")
        n += 1
    return n


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbh1"])
@pytest.mark.parametrize("name", ["mlp", "gpt2", "skip"])
def test_in_process_stages_on_gpus_match_reference(name: str, schedule: str) -> None:
    """Two stages, each on a GPU (both on cuda:0 with one GPU); CPU inputs and targets."""
    c = case(name, 2)
    ref = copy.deepcopy(c["model"])
    gpus = [f"cuda:{i % torch.cuda.device_count()}" for i in range(2)]
    plan = partition(c["model"], c["example"], 2, microbatches=4, schedule=schedule, **c["opts"])
    trainer = PipelineTrainer(plan, c["loss"], schedule=schedule, transport="local", devices=gpus)
    gen = torch.Generator().manual_seed(5)
    x, y = (_like(c[k], gen) for k in ("x", "y"))
    loss = trainer.forward_backward(x, y)
    want_loss, want = reference_grads(c, ref, x, y)
    assert _check(trainer, loss, want_loss, want) > 0


def _nccl_worker(rank: int, world: int, name: str, schedule: str) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)  # the trainer's default device under NCCL
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    c = case(name, world)
    ref = copy.deepcopy(c["model"])
    plan = partition(c["model"], c["example"], world, microbatches=4, schedule=schedule, **c["opts"])
    trainer = PipelineTrainer(plan, c["loss"], schedule=schedule, transport="dist")
    gen = torch.Generator().manual_seed(11)
    x, y = (_like(c[k], gen) for k in ("x", "y"))
    loss = trainer.forward_backward(x, y)
    want_loss, want = reference_grads(c, ref, x, y)
    return {"checked": _check(trainer, loss, want_loss, want), "device": str(next(iter(trainer.devices.values())))}


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_nccl_two_processes_match_reference(name: str, schedule: str) -> None:
    out = spawn(_nccl_worker, 2, name, schedule, backend="nccl", timeout=300)
    assert [o["device"] for o in out] == ["cuda:0", "cuda:1"]
    assert all(o["checked"] > 0 for o in out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_weight_gradient_on_cuda(dtype: torch.dtype) -> None:
    """``addmm_`` accumulation on the GPU equals autograd's, in fp32 and under bf16 autocast."""
    w = nn.Parameter(torch.randn(256, 512, device="cuda"))
    ref = nn.Parameter(w.detach().clone())
    for _ in range(3):
        x = torch.randn(4, 16, 512, device="cuda")
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            linear_accumulate(x, w).float().square().mean().backward()
            nn.functional.linear(x, ref).float().square().mean().backward()
    tol = GPU_TOL if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    assert w.grad is not None and w.grad.dtype == torch.float32
    torch.testing.assert_close(w.grad, ref.grad, **tol)


def test_bf16_autocast_on_cuda_equals_the_plain_model_under_it() -> None:
    """Stages on the GPU under bf16 autocast, values kept in autocast's dtypes on the wire:
    the plain model on the same GPU under the same autocast, micro-batch by micro-batch."""
    from runtime.precision import MixedPrecision

    c = case("gpt2", 2)
    ref = copy.deepcopy(c["model"]).cuda()
    plan = partition(c["model"], c["example"], 2, microbatches=4)
    trainer = PipelineTrainer(plan, c["loss"], transport="local", devices=["cuda:0", "cuda:0"],
                              precision=MixedPrecision("bf16", cast_activations=False))
    gen = torch.Generator().manual_seed(5)
    x, y = (_like(c[k], gen) for k in ("x", "y"))
    loss = trainer.forward_backward(x, y)
    total = torch.zeros((), device="cuda")
    for xc, yc in zip(x.cuda().chunk(4), y.cuda().chunk(4)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            part = c["loss"](ref(xc), yc) / 4
        part.backward()
        total += part.detach().float()
    torch.testing.assert_close(loss.cpu(), total.cpu(), rtol=1e-4, atol=1e-5)
    want = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    for name, prm in trainer.named_parameters():
        assert prm.grad is not None and prm.grad.dtype == torch.float32, name
        err = (prm.grad - want[name]).abs().max() / want[name].abs().max()
        assert err < 1e-3, (name, float(err))


def test_recomputation_replays_cuda_dropout() -> None:
    """A recomputing stage on the GPU draws the same dropout masks in its replay (the CUDA RNG
    state is saved at F): its gradients equal those of the run that kept its activations."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 64), nn.Dropout(0.5),
                          nn.Linear(64, 8))
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    grads = []
    for recompute in (False, True):
        plan = partition(copy.deepcopy(model), (x[:4],), 2, microbatches=4)
        trainer = PipelineTrainer(plan, nn.functional.mse_loss, transport="sequential",
                                  devices=["cuda:0", "cuda:0"], recompute=recompute)
        torch.manual_seed(7)
        trainer.forward_backward(x, y)
        grads.append({n: p.grad.detach().cpu().clone() for n, p in trainer.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=0)


def _nccl_two_by_two(
    rank: int, **trainer_kw: Any
) -> tuple[PipelineTrainer, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """GPT-2 as 2 replicas x 2 stages on this rank's GPU (NCCL): one ``forward_backward`` of this
    replica's share of a global batch; the trainer, its loss, and the plain model's loss and gradients."""
    os.environ["LOCAL_RANK"] = str(rank)
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    c = case("gpt2", 2)
    ref = copy.deepcopy(c["model"])
    plan = partition(c["model"], c["example"], 2, microbatches=4)
    trainer = PipelineTrainer(plan, c["loss"], transport="dist", **trainer_kw)
    gen = torch.Generator().manual_seed(11)
    x = torch.randint(0, 64, (16, 8), generator=gen)
    y = torch.randint(0, 64, (16, 8), generator=gen)
    loss = trainer.forward_backward(*trainer.local_batch(x, y))
    want_loss, want = reference_grads(c, ref, x, y)
    return trainer, loss, want_loss, want


def _nccl_dp_worker(rank: int, world: int) -> int:
    return _check(*_nccl_two_by_two(rank, data_parallel=2))


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs")
def test_nccl_two_replicas_of_two_stages_match_reference() -> None:
    assert all(n > 0 for n in spawn(_nccl_dp_worker, 4, backend="nccl", timeout=300))


def _nccl_fsdp_worker(rank: int, world: int, gathered: bool) -> dict[str, Any]:
    """2 replicas x 2 stages on FSDP2 over NCCL; with ``gathered``, weights all-gathered in bf16."""
    from runtime import DataParallel
    from runtime.precision import MixedPrecision

    precision = MixedPrecision("bf16", cast_activations=False, gather_low_precision=True) if gathered else None
    trainer, loss, want_loss, want = _nccl_two_by_two(rank, precision=precision,
                                                      data_parallel=DataParallel(size=2, engine="fsdp"))
    worst, n = 0.0, 0
    for name, prm in trainer.named_parameters():
        assert prm.grad is not None, f"{name} got no gradient"
        grad = prm.grad.full_tensor().cpu()
        assert grad.dtype == torch.float32, name
        worst = max(worst, float((grad - want[name]).abs().max() / want[name].abs().max()))
        n += 1
    return {"n": n, "worst": worst, "loss": float(loss), "want_loss": float(want_loss)}


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs")
@pytest.mark.parametrize("gathered", [False, True])
def test_nccl_fsdp_two_replicas_of_two_stages_match_reference(gathered: bool) -> None:
    # fp32: the plain model's gradients up to GPU round-off. Weights gathered in bf16 under bf16
    # autocast (layer_norm runs in fp32 on CUDA): within bf16's reach of the fp32 model.
    for r in spawn(_nccl_fsdp_worker, 4, gathered, backend="nccl", timeout=300):
        assert r["n"] > 0
        if gathered:
            assert r["worst"] < 5e-2 and r["loss"] == pytest.approx(r["want_loss"], rel=1e-2), r
        else:
            assert r["worst"] < 1e-4 and r["loss"] == pytest.approx(r["want_loss"], rel=1e-5), r
