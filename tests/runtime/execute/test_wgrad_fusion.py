"""Weight-gradient accumulation fusion: same gradients as autograd, and only where it is safe."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx, nn

from runtime.execute.wgrad_fusion import (
    accumulate_deferred,
    addmm_accumulate,
    deferring,
    fuse_weight_grad_accumulation,
    fused_params,
    linear_accumulate,
)

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _fused_count(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.target in (linear_accumulate, addmm_accumulate))


@settings(max_examples=25, deadline=None)
@given(
    lead=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    fan_in=st.integers(1, 9), fan_out=st.integers(1, 9),
    bias=st.booleans(), x_grad=st.booleans(), calls=st.integers(1, 3), seed=st.integers(0, 2**16),
)
def test_linear_accumulate_matches_autograd(
    lead: list[int], fan_in: int, fan_out: int, bias: bool, x_grad: bool, calls: int, seed: int
) -> None:
    """Any leading shape, with or without bias or input gradient, over several accumulating calls."""
    gen = torch.Generator().manual_seed(seed)
    w = nn.Parameter(torch.randn(fan_out, fan_in, generator=gen))
    b = nn.Parameter(torch.randn(fan_out, generator=gen)) if bias else None
    w2 = nn.Parameter(w.detach().clone())
    b2 = nn.Parameter(b.detach().clone()) if b is not None else None
    for _ in range(calls):
        x = torch.randn(*lead, fan_in, generator=gen)
        xa, xb = x.clone().requires_grad_(x_grad), x.clone().requires_grad_(x_grad)
        g = torch.randn(*lead, fan_out, generator=gen)
        (nn.functional.linear(xa, w, b) * g).sum().backward()
        (linear_accumulate(xb, w2, b2) * g).sum().backward()
        if x_grad:
            torch.testing.assert_close(xb.grad, xa.grad, **TOL)
    torch.testing.assert_close(w2.grad, w.grad, **TOL)
    if b is not None:
        torch.testing.assert_close(b2.grad, b.grad, **TOL)


@pytest.mark.parametrize("bias_shape", [(5,), (3, 5)])
def test_addmm_accumulate_matches_autograd(bias_shape: tuple[int, ...]) -> None:
    """Hugging Face's Conv1D form ``bias + x @ W`` (W: in x out), bias broadcast or full."""
    w = nn.Parameter(torch.randn(4, 5))
    b = nn.Parameter(torch.randn(*bias_shape))
    w2, b2 = nn.Parameter(w.detach().clone()), nn.Parameter(b.detach().clone())
    for _ in range(2):
        x = torch.randn(3, 4)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.addmm(b, xa, w).pow(2).sum().backward()
        addmm_accumulate(b2, xb, w2).pow(2).sum().backward()
        torch.testing.assert_close(xb.grad, xa.grad, **TOL)
    torch.testing.assert_close(w2.grad, w.grad, **TOL)
    torch.testing.assert_close(b2.grad, b.grad, **TOL)


def test_existing_grad_is_added_to_in_place() -> None:
    """The buffer a previous step (or micro-batch) left is the one that grows: no new tensor."""
    w = nn.Parameter(torch.randn(3, 4))
    linear_accumulate(torch.randn(2, 4), w).sum().backward()
    buf = w.grad
    before = buf.clone()
    x = torch.randn(2, 4)
    linear_accumulate(x, w).sum().backward()
    assert w.grad is buf
    torch.testing.assert_close(buf, before + torch.ones(2, 3).t() @ x)


def test_frozen_weight_gets_no_gradient() -> None:
    w = nn.Parameter(torch.randn(3, 4), requires_grad=False)
    x = torch.randn(2, 4, requires_grad=True)
    linear_accumulate(x, w).sum().backward()
    assert w.grad is None and x.grad is not None


def test_mixed_precision_gradient_lands_in_the_weights_dtype() -> None:
    """Under CPU autocast the output gradient is bf16; the fp32 weight's gradient stays fp32."""
    w = nn.Parameter(torch.randn(8, 8))
    ref = nn.Parameter(w.detach().clone())
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        linear_accumulate(x, w).float().sum().backward()
        nn.functional.linear(x, ref).float().sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.float32
    torch.testing.assert_close(w.grad, ref.grad, rtol=1e-2, atol=1e-2)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8, bias=False)
        self.tied = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = self.b(h)
        h = nn.functional.linear(h, self.tied.weight, self.tied.bias)
        h = h + nn.functional.linear(h, self.tied.weight)  # second use: left to autograd
        return self.frozen(h)


def test_rewrite_fuses_only_safe_layers_and_keeps_gradients() -> None:
    net = _Net()
    ref = copy.deepcopy(net)
    fused = fx.symbolic_trace(net)
    keys = list(fused.state_dict())
    # a and b; tied is used twice, frozen needs no gradient
    assert fuse_weight_grad_accumulation(fused, min_numel=1) == 2
    assert _fused_count(fused) == 2 and list(fused.state_dict()) == keys
    # the layers add their own parameters' gradients (a's bias too; b has none)
    assert [id(p) for p in fused_params(fused)] == [id(net.a.weight), id(net.a.bias), id(net.b.weight)]
    assert fuse_weight_grad_accumulation(fused, min_numel=1) == 0  # nothing left to fuse
    assert len(fused_params(fused)) == 3
    assert dict(fused.named_parameters()).keys() <= dict(net.named_parameters()).keys()
    for _ in range(2):  # accumulate over two micro-batches
        x = torch.randn(5, 6)
        fused(x).sum().backward()
        ref(x).sum().backward()
    got = dict(net.named_parameters())
    for name, prm in ref.named_parameters():
        if prm.requires_grad:
            torch.testing.assert_close(got[name].grad, prm.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_rewrite_respects_skip_threshold_and_subclasses() -> None:
    class MyLinear(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    class Leaves(fx.Tracer):  # keep MyLinear a call_module, as a user's leaf module would be
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return isinstance(m, MyLinear) or super().is_leaf_module(m, qualname)

    net = nn.Sequential(nn.Linear(4, 4), MyLinear(4, 4), nn.Linear(4, 300))

    def fused(min_numel: int = 1, skip: tuple[nn.Parameter, ...] = ()) -> int:  # on a fresh trace each time
        return fuse_weight_grad_accumulation(fx.GraphModule(net, Leaves().trace(net)), min_numel=min_numel, skip=skip)

    assert fused() == 2  # not the subclass's own forward
    assert fused(skip=(net[0].weight,)) == 1
    assert fused(min_numel=1000) == 1  # only the 4 x 300 weight
    assert fused(min_numel=10**6) == 0


def test_trainer_option_turns_fusion_off_and_split_backward_fuses_too(monkeypatch: pytest.MonkeyPatch) -> None:
    from partitioner import partition
    from partitioner.zoo import MLPChain
    from runtime import PipelineTrainer
    from runtime.execute import wgrad_fusion

    monkeypatch.setattr(wgrad_fusion, "DEFAULT_MIN_NUMEL", 1 << 16)  # parity.py lowers it
    model = MLPChain((256, 256, 256, 256, 8))  # 65,536-element weights: fused by default
    plan = partition(model, (torch.randn(2, 256),), 2, microbatches=2)
    fused = PipelineTrainer(plan, nn.functional.mse_loss, schedule="1f1b", transport="sequential")
    plain = PipelineTrainer(plan, nn.functional.mse_loss, schedule="1f1b", transport="sequential", fuse_wgrad=False)
    split = PipelineTrainer(plan, nn.functional.mse_loss, schedule="zbh1", transport="sequential")
    assert sum(_fused_count(s.module) for s in fused.stages.values()) == 3
    assert sum(_fused_count(s.module) for s in plain.stages.values()) == 0
    assert sum(_fused_count(s.module) for s in split.stages.values()) == 3
    x, y = torch.randn(4, 256), torch.randn(4, 8)
    grads = []
    for trainer in (fused, plain, split):
        trainer.zero_grad()
        trainer.forward_backward(x, y)
        grads.append({n: p.grad.clone() for n, p in trainer.named_parameters()})
    for other in grads[1:]:
        for name, g in grads[0].items():
            torch.testing.assert_close(g, other[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_trainer_state_dict_is_the_same_with_fusion(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rewrite changes only graphs: tied aliases (GPT-2's wte/lm_head) and non-persistent
    buffers stay as the plain stages have them."""
    from partitioner import partition
    from partitioner.zoo import gpt2
    from runtime import PipelineTrainer
    from runtime.execute import wgrad_fusion

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
            self.register_buffer("scale", torch.ones(16), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x) * self.scale)

    monkeypatch.setattr(wgrad_fusion, "DEFAULT_MIN_NUMEL", 1)
    model, example = gpt2(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, batch=2, seq=8)
    for m, ex in [(model, example), (Scaled(), (torch.randn(2, 16),))]:
        plan = partition(m, ex, 2, microbatches=2)
        keys = {}
        for fuse in (True, False):
            t = PipelineTrainer(plan, None, transport="sequential", fuse_wgrad=fuse)
            assert (sum(_fused_count(s.module) for s in t.stages.values()) > 0) == fuse
            keys[fuse] = sorted(t.state_dict())
        assert keys[True] == keys[False] == sorted(m.state_dict())
    # GPT-2's embedding is tied to its head on the other stage: never fused (skip=shared params)
    t = PipelineTrainer(partition(model, example, 2, microbatches=2), None, transport="sequential")
    tied = model.get_parameter("model.transformer.wte.weight")
    assert tied is model.get_parameter("model.lm_head.weight")
    assert all(id(p) != id(tied) for st in t.stages.values() for p in fused_params(st.module))
    assert sum(len(fused_params(st.module)) for st in t.stages.values()) > 0


@pytest.mark.parametrize("kind", ["linear", "addmm"])
def test_deferral_follows_the_forward_thread_not_the_backward_thread(kind: str) -> None:
    """Autograd runs the backward of CUDA ops on a worker thread of its own: a split backward's
    ``I`` set on the stage's thread must still defer the weight gradient there (it once ran at
    once, and ``W`` then added it a second time). Emulated on the CPU by running the backward on
    another thread."""
    w = nn.Parameter(torch.randn(4, 3) if kind == "linear" else torch.randn(3, 4))
    x = torch.randn(5, 3, requires_grad=True)
    out = linear_accumulate(x, w) if kind == "linear" else addmm_accumulate(torch.zeros(4), x, w)
    with deferring() as sink:
        worker = threading.Thread(target=lambda: out.sum().backward())
        worker.start()
        worker.join()
    assert w.grad is None and len(sink) == 1  # recorded for W, not run
    assert x.grad is not None  # the input gradient was computed in "I"
    accumulate_deferred(sink)
    want = torch.ones(5, 4).t() @ x.detach() if kind == "linear" else x.detach().t() @ torch.ones(5, 4)
    torch.testing.assert_close(w.grad, want, **TOL)
