"""The small Hugging Face GPT-2 config the trace and cost tests share (transformers is optional)."""

from __future__ import annotations

from typing import Any

import pytest


def gpt2_config() -> Any:
    """Two layers, width 64, no dropout; skips the calling test when transformers is missing."""
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
