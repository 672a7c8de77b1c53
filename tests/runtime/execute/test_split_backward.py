"""Split backward: I gives exactly the input gradients, W exactly the weight gradients, without re-walking."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from runtime.execute.split_backward import backward_input, backward_weight


class _Count(torch.autograd.Function):
    """Identity whose backward counts its calls: a probe on the input path."""

    calls = 0

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        _Count.calls += 1
        return g


class Probed(nn.Module):
    """Linear, probe, GELU, Linear: the probe sits between the output and the first weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(nn.functional.gelu(_Count.apply(self.a(x))))


class Reuse(nn.Module):
    """One Linear used twice, the first use feeding the second (two branch nodes, one above the other)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.unused = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.a(h) * 2 + x.sum()


class TwoOut(nn.Module):
    """Two outputs, and a parameter reached only from a graph input (no branch node)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.emb = nn.Linear(8, 8), nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(self.a(x) + self.emb(ids))
        return h, h.chunk(2, dim=-1)[1] * 3


class BiasOut(nn.Module):
    """T5's shape: a position bias added on the input path and also handed on as an output of its
    own, so part of its gradient reaches it through no branch node."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.bias = nn.Parameter(torch.randn(3, 8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = self.bias.sum(0) * 2
        return self.a(x) + pos, pos * 5


def _inputs(model: nn.Module) -> tuple[torch.Tensor, ...]:
    if isinstance(model, TwoOut):
        return torch.randn(5, 8), torch.randint(0, 10, (5,))
    return (torch.randn(5, 6 if isinstance(model, Probed) else 8),)


CASES: dict[str, Callable[[], nn.Module]] = {
    "chain": lambda: nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(8, 8), nn.GELU())]),
    "probed": Probed,
    "reuse": Reuse,
    "two-outputs": TwoOut,
    "bias-output": BiasOut,
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("grad_input", [True, False])
def test_split_backward_equals_fused_backward(name: str, grad_input: bool) -> None:
    model = CASES[name]()
    twin = copy.deepcopy(model)
    ins = _inputs(model)
    ref_ins = [x.clone().requires_grad_(grad_input and x.is_floating_point()) for x in ins]
    outs = model(*ref_ins)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)

    sp_ins = [x.clone().requires_grad_(grad_input and x.is_floating_point()) for x in ins]
    sp_outs = twin(*sp_ins)
    sp_outs = sp_outs if isinstance(sp_outs, tuple) else (sp_outs,)
    params = list(twin.parameters())
    needs = [x for x in sp_ins if x.requires_grad]
    in_grads, pending = backward_input(sp_outs, grads, needs, params)
    assert all(p.grad is None for p in params), "I must not touch weight gradients"
    for x, g in zip([x for x in ref_ins if x.requires_grad], in_grads):
        torch.testing.assert_close(g, x.grad)
    del sp_outs  # W must not need the outputs
    backward_weight(pending)
    for (pname, want), got in zip(model.named_parameters(), params):
        if want.grad is None:
            assert got.grad is None, pname
        else:
            torch.testing.assert_close(got.grad, want.grad, msg=lambda m, n=pname: f"{n}: {m}")


def test_w_runs_only_the_weight_branches() -> None:
    # The probe is on the path from the output to the stage input: I runs it once, and W, which
    # starts at the Linear nodes and asks only for weights, must not run it again (a re-walk
    # from the outputs would).
    model = Probed()
    x = torch.randn(5, 6, requires_grad=True)
    y = model(x)
    _Count.calls = 0
    _, pending = backward_input([y], [torch.ones_like(y)], [x], list(model.parameters()))
    assert _Count.calls == 1
    assert len(pending.groups) == 2 and pending.fallback is None
    backward_weight(pending)
    assert _Count.calls == 1
    assert all(p.grad is not None for p in model.parameters())


def test_without_input_gradients_w_does_the_whole_backward() -> None:
    model = Probed()
    y = model(torch.randn(5, 6))
    _Count.calls = 0
    in_grads, pending = backward_input([y], [torch.ones_like(y)], [], list(model.parameters()))
    assert in_grads == () and _Count.calls == 0 and not pending.groups
    backward_weight(pending)
    assert _Count.calls == 1


# -- fused layers (runtime.execute.wgrad_fusion) ---------------------------------------------------------


class _FusedNet(nn.Module):
    """Two fused linears (biases too) on the input path, one fused linear off it (fed by a
    constant; its bias left to autograd), a plain parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 4)
        self.side = nn.Linear(3, 4)
        self.shift = nn.Parameter(torch.randn(4))
        self.register_buffer("const", torch.randn(5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from runtime.execute.wgrad_fusion import linear_accumulate

        h = nn.functional.gelu(linear_accumulate(x, self.a.weight, self.a.bias, True))
        h = linear_accumulate(h, self.b.weight, self.b.bias, True)
        return h * linear_accumulate(self.const, self.side.weight, self.side.bias) + self.shift


@pytest.mark.parametrize("input_grad", [True, False])
def test_fused_layers_defer_their_weight_gemm_to_w(input_grad: bool) -> None:
    """I records the fused GEMMs (no weight gradient yet); W runs them; each weight gets its
    gradient once, including the fused layer that I never reached; equal to a plain backward."""
    net = _FusedNet()
    ref = copy.deepcopy(net)
    x = torch.randn(5, 6, requires_grad=input_grad)
    g = torch.randn(5, 4)
    ref_x = x.detach().clone().requires_grad_(input_grad)
    ref(ref_x).backward(g)

    out = net(x)
    params = list(net.parameters())
    fused = [net.a.weight, net.a.bias, net.b.weight, net.b.bias, net.side.weight]
    in_grads, pending = backward_input([out], [g], [x] if input_grad else [], params, fused)
    assert all(w.grad is None for w in fused)  # I did none of their parameter work
    if input_grad:
        deferred = (net.b.weight, net.b.bias, net.a.weight, net.a.bias)
        assert [id(w) for w, _ in pending.deferred] == [id(p) for p in deferred]
        assert [id(w) for w in pending.owed] == [id(net.side.weight)]  # off the input path
        torch.testing.assert_close(in_grads[0], ref_x.grad)
    backward_weight(pending)
    want = dict(ref.named_parameters())
    for name, prm in net.named_parameters():
        torch.testing.assert_close(prm.grad, want[name].grad, msg=lambda m, name=name: f"{name}: {m}")
