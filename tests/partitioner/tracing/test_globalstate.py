"""pipecut's entry points leave the process as they found it: modes, defaults, RNG, the model's flags."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from partitioner import Plan, partition
from partitioner.cost.costs import cost_graph
from partitioner.tracing.globalstate import GlobalState, preserved
from partitioner.tracing.trace import CausalLMLogits, trace
from partitioner.zoo import MLPChain
from rotary_case import RotaryNet


def _llama() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, attention_dropout=0.0,
    )
    return CausalLMLogits(transformers.LlamaForCausalLM(cfg)), (torch.randint(0, 64, (2, 8)),)


def _rotary() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return RotaryNet(), (torch.randn(2, 6, 8),)


def _mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return MLPChain((16, 32, 8, 4)), (torch.randn(2, 16),)


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "llama": _llama, "rotary": _rotary, "mlp": _mlp,
}

# The caller's state on entry: each as a user might have it, none of it pipecut's to change.
AMBIENT: dict[str, Callable[[], contextlib.AbstractContextManager[object]]] = {
    "plain": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "autocast_bf16": lambda: torch.autocast("cpu", torch.bfloat16),
}


def _oddly_flagged(model: nn.Module) -> nn.Module:
    """Some modules in eval, one parameter frozen: flags pipecut must not reset."""
    model.train()
    mods = list(model.modules())
    mods[len(mods) // 2].eval()
    next(iter(model.parameters())).requires_grad_(False)
    return model


@contextlib.contextmanager
def _unchanged(model: nn.Module) -> Iterator[None]:
    values = {n: t.detach().clone() for n, t in model.state_dict().items()}
    before = GlobalState.capture(model)
    yield
    assert GlobalState.capture(model).differences(before) == []
    for name, t in model.state_dict().items():
        assert torch.equal(t, values[name]), f"{name} changed"


# Every model under every state; the Llama (two traces a case, the slowest) under grad mode off and
# inference mode in the long profile only: the small models take those states by default.
_LLAMA_LONG = ("no_grad", "inference_mode")


@pytest.mark.parametrize(("name", "ambient"), [
    pytest.param(n, a, marks=[pytest.mark.long] if n == "llama" and a in _LLAMA_LONG else [])
    for n in MODELS for a in AMBIENT])
def test_partition_and_bind_change_nothing(name: str, ambient: str, tmp_path: Path) -> None:
    model, example = MODELS[name]()
    model = _oddly_flagged(model)
    if ambient == "inference_mode":
        example = tuple(x.clone() for x in example)  # inputs made outside inference mode
    with AMBIENT[ambient]():
        with _unchanged(model):
            plan = partition(model, example, 2, microbatches=2)
        with _unchanged(model):
            plan.save(tmp_path / "plan.json")
            bound = Plan.load(tmp_path / "plan.json", model, example)
        with _unchanged(model):
            stages = bound.build_stages()
    assert len(stages) == 2


@pytest.mark.parametrize("name", ["rotary", "llama"])
def test_cost_passes_and_profiler_change_nothing(name: str) -> None:
    model, example = MODELS[name]()
    model = _oddly_flagged(model)
    traced = trace(model, example)
    with _unchanged(model):
        cost_graph(traced)
    with _unchanged(model):
        # Profiling draws random inputs for every node: the caller's RNG stream must not move.
        cost_graph(traced, profile=True, device="cpu", warmup=0, repeat=1)


def test_default_dtype_and_device_are_kept() -> None:
    model, example = _rotary()
    torch.set_default_dtype(torch.float64)
    try:
        model = model.float()
        with _unchanged(model):
            partition(model, example, 2)
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(torch.float32)


def test_preserved_restores_what_a_block_changed_even_when_it_raises() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(KeyError), preserved(model):
        torch.set_grad_enabled(False)
        torch.set_autocast_enabled("cpu", True)
        torch.set_default_dtype(torch.float64)
        torch.randn(4)
        model.eval()
        model.weight.requires_grad_(False)
        raise KeyError("boom")
    assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
    assert torch.get_default_dtype() == torch.float32
    assert model.training and model.weight.requires_grad


def test_differences_name_each_item() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    before = GlobalState.capture(model)
    with preserved(model):
        model[0].eval()
        torch.rand(1)
        changed = GlobalState.capture(model).differences(before)
    assert changed == ["CPU RNG state changed", "training flipped on 1: ['0']"]
    assert GlobalState.capture(model).differences(before) == []


def test_python_and_numpy_rng_are_restored() -> None:
    np = pytest.importorskip("numpy")
    np.random.seed(3)
    py, npy = random.getstate(), np.random.get_state()
    before = GlobalState.capture()
    with preserved():
        random.random()
        np.random.rand(2)
        assert GlobalState.capture().differences(before) == [
            "Python random state changed", "numpy RNG state changed",
        ]
    assert random.getstate() == py
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
               for a, b in zip(np.random.get_state(), npy))


class _Stats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3, momentum=None)
        self.register_buffer("table", torch.arange(4.0))
        self.register_buffer("nan", torch.tensor([float("nan"), 1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x)  # type: ignore[no-any-return]


def test_buffers_written_or_reassigned_are_put_back() -> None:
    model = _Stats().train()
    table, values = model.table, {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 3)
    before = GlobalState.capture(model)
    with preserved(model):
        model(x)  # running stats and num_batches_tracked move
        model.table = torch.zeros(4)  # a forward that reassigns its buffer
        assert GlobalState.capture(model).differences(before) == [
            "buffers changed: ['table', 'bn.running_mean', 'bn.running_var', 'bn.num_batches_tracked']",
        ]
    assert model.table is table
    for name, t in model.state_dict().items():
        torch.testing.assert_close(t, values[name], rtol=0, atol=0, equal_nan=True)
    assert GlobalState.capture(model).differences(before) == []  # an untouched NaN is unchanged


def test_a_parameter_written_in_place_is_reported() -> None:
    model = nn.Linear(2, 2)
    before = GlobalState.capture(model)
    with torch.no_grad():
        model.weight.add_(1)
    assert GlobalState.capture(model).differences(before) == ["parameters written in place: ['weight']"]
