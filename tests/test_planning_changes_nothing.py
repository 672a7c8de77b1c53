"""Planning changes nothing: ``partition``, ``Plan.load``/``bind`` and ``PipelineTrainer(...)`` leave
the model (every parameter and buffer bitwise, every ``training`` flag, a Hugging Face model's
config: its cache is turned off for the trace only) and the process (grad mode, autocast, RNG
streams, default dtype and device) exactly as they found them.

Models with running statistics are the ones that used to change: a leaf fake tensors cannot run
(``BatchNorm`` with ``momentum=None`` reads ``num_batches_tracked``) was run on the real buffers.
The snapshot here is the test's own, independent of ``partitioner.tracing.globalstate``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from partitioner import Plan, partition
from runtime import PipelineTrainer

# The model, its positional example inputs and, for some, keyword ones.
Case = tuple[nn.Module, tuple[torch.Tensor, ...]] | tuple[nn.Module, tuple[torch.Tensor, ...], dict[str, Any]]


class _BN1d(nn.Module):
    def __init__(self, momentum: float | None) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=momentum), nn.Linear(8, 8)
        self.bn2, self.c = nn.BatchNorm1d(8, momentum=momentum), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.bn2(self.b(self.bn(self.a(x)))))  # type: ignore[no-any-return]


class _BN2d(nn.Module):
    def __init__(self, momentum: float | None) -> None:
        super().__init__()
        self.a, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=momentum)
        self.b, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=momentum)
        self.head = nn.Linear(4 * 6 * 6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn2(self.b(torch.relu(self.bn(self.a(x)))))
        return self.head(h.flatten(1))  # type: ignore[no-any-return]


class _Counting(nn.Module):
    """Keeps its own statistics in registered buffers, updated in place by every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.calls.add_(1)
        self.ema.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return self.c(torch.relu(self.b(h)))  # type: ignore[no-any-return]


def _dropout() -> Case:
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 4))
    return model, (torch.randn(4, 8),)


def _family(name: str) -> Callable[[], Case]:
    def build() -> Case:
        pytest.importorskip("transformers")
        from families import FAMILIES, MB

        fam = FAMILIES[name]
        x, _ = fam.batch(MB, torch.Generator().manual_seed(1))
        (_, first), *rest = x.items()
        return fam.build(), (first,), dict(rest)  # the raw Hugging Face model, no wrapper

    return build


def _gpt2() -> Case:
    transformers = pytest.importorskip("transformers")
    from partitioner.tracing.trace import CausalLMLogits

    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=32)
    return CausalLMLogits(transformers.GPT2LMHeadModel(cfg)).train(), (torch.randint(0, 64, (2, 8)),)


CASES: dict[str, Callable[[], Case]] = {
    "bn1d_momentum_none": lambda: (_BN1d(None), (torch.randn(4, 8),)),
    "bn1d_momentum_0.1": lambda: (_BN1d(0.1), (torch.randn(4, 8),)),
    "bn2d_momentum_none": lambda: (_BN2d(None), (torch.randn(2, 3, 6, 6),)),
    "bn2d_momentum_0.1": lambda: (_BN2d(0.1), (torch.randn(2, 3, 6, 6),)),
    "buffer_updated_in_forward": lambda: (_Counting(), (torch.randn(4, 8),)),
    "dropout": _dropout,
    "gpt2": _gpt2,  # dropout on: resid, embd and attention dropout at 0.1
    "llama": _family("llama"),
    "bert": _family("bert"),
    "t5": _family("t5"),  # decoder_input_ids as a keyword input
}


def _process_state() -> dict[str, Any]:
    return {
        "grad mode": torch.is_grad_enabled(),
        "autocast": [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")],
        "torch rng": torch.get_rng_state().tolist(),
        "random": random.getstate(),
        "numpy rng": repr(np.random.get_state()),
        "default dtype": torch.get_default_dtype(),
        "default device": torch.get_default_device(),
    }


class _Snapshot:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.training = {n: m.training for n, m in model.named_modules()}
        self.config = _config(model)
        self.process = _process_state()

    def check(self, after: str) -> None:
        state = self.model.state_dict()
        assert state.keys() == self.state.keys(), after
        changed = [k for k, v in state.items() if not torch.equal(v, self.state[k])]
        assert changed == [], f"{after} changed {changed}"
        assert {n: m.training for n, m in self.model.named_modules()} == self.training, after
        assert _config(self.model) == self.config, after
        process = _process_state()
        assert [k for k in process if process[k] != self.process[k]] == [], after


def _config(model: nn.Module) -> dict[str, Any] | None:
    """A Hugging Face model's config as a dict (``use_cache``, ``return_dict``...), else ``None``."""
    config = getattr(model, "config", None)
    return config.to_dict() if config is not None else None


def _loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return out.logits.float().pow(2).mean() if hasattr(out, "logits") else out.float().pow(2).mean()


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def test_batchnorm_buffers_are_untouched_by_partition() -> None:
    model = _BN1d(None).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    partition(model, (torch.randn(4, 8),), 2, microbatches=2)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), f"{name}: {before[name]} -> {value}"
    assert int(model.bn.num_batches_tracked) == 0


@pytest.mark.parametrize("name", list(CASES))
def test_planning_binding_and_building_a_trainer_change_nothing(name: str, tmp_path: Path) -> None:
    model, x, *more = CASES[name]()
    kw: dict[str, Any] = more[0] if more else {}
    model.train()
    np.random.seed(7)  # a numpy stream in use, as in a user's script
    snap = _Snapshot(model)
    plan = partition(model, x, 2, microbatches=2, example_kwargs=kw)
    snap.check("partition()")
    PipelineTrainer(plan, _loss, _sgd)
    snap.check("PipelineTrainer(plan)")
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json", model, x, example_kwargs=kw)  # binds: plan.bind(model, x, ...)
    snap.check("Plan.load(path, model, inputs)")
    PipelineTrainer(loaded, _loss, _sgd)
    snap.check("PipelineTrainer(loaded plan)")
