"""Fixtures shared by the partitioner tests."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpt2_case import gpt2_config
from partitioner.tracing.trace import CausalLMLogits, TracedModel, trace


@pytest.fixture(scope="module")
def gpt2() -> tuple[nn.Module, TracedModel]:
    """A traced two-layer GPT-2 (eval mode) and the model, built once per test module."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = CausalLMLogits(transformers.GPT2LMHeadModel(gpt2_config())).eval()
    return model, trace(model, (torch.randint(0, 128, (2, 16)),))
