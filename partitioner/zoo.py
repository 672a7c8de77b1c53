"""Built-in example models for the CLI, the benchmarks and the tests, and ``path.py:factory`` loading.

Every factory returns ``(model, example_inputs)`` where the inputs are one micro-batch. Hugging
Face models are built from a config (never downloaded) and need ``transformers`` installed.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from partitioner.errors import (
    MissingDependencyError,
    ModelFactoryError,
    ModelFactoryNotFoundError,
    ModelFileNotFoundError,
    ModelImportError,
    ModelSpecError,
)

__all__ = ["MODELS", "load_model", "MLPChain", "ResidualCNN", "UNet", "gpt2"]

Factory = Callable[[], tuple[nn.Module, tuple[Any, ...]]]


class MLPChain(nn.Module):
    """Linear + GELU layers of uneven widths: the easy case where cost varies layer to layer."""

    def __init__(self, widths: tuple[int, ...] = (256, 1024, 128, 2048, 256, 512, 64, 1024, 256, 16)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, widths[0]) -> (B, widths[-1])
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.nn.functional.gelu(x)
        return x


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.down(x))


class ResidualCNN(nn.Module):
    """A small ResNet: stem, four stages of two residual blocks, pooled linear head."""

    def __init__(self, width: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        chans = [width, width * 2, width * 4, width * 8]
        blocks: list[nn.Module] = []
        cin = width
        for i, c in enumerate(chans):
            blocks += [_Block(cin, c, 1 if i == 0 else 2), _Block(c, c, 1)]
            cin = c
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, classes)
        x = self.blocks(self.stem(x))
        x = self.head(x.mean(dim=(2, 3)))
        return x


class UNet(nn.Module):
    """A U-Net: each encoder level's output skips across the bottleneck to its decoder level.

    Input height and width must be divisible by ``2**levels``.
    """

    def __init__(self, width: int = 16, levels: int = 4) -> None:
        super().__init__()
        chans = [width * 2**i for i in range(levels)]
        self.enc = nn.ModuleList()
        cin = 3
        for c in chans:
            self.enc.append(nn.Sequential(nn.Conv2d(cin, c, 3, 1, 1), nn.ReLU(), nn.Conv2d(c, c, 3, 1, 1), nn.ReLU()))
            cin = c
        self.mid = nn.Sequential(nn.Conv2d(cin, cin * 2, 3, 1, 1), nn.ReLU())
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        cin = cin * 2
        for c in reversed(chans):
            self.up.append(nn.ConvTranspose2d(cin, c, 2, 2))
            self.dec.append(nn.Sequential(nn.Conv2d(2 * c, c, 3, 1, 1), nn.ReLU()))
            cin = c
        self.out = nn.Conv2d(cin, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, 1, H, W)
        skips = []
        for enc in self.enc:
            x = enc(x)
            skips.append(x)  # (B, c, H / 2**i, W / 2**i): waits for its decoder level
            x = torch.nn.functional.max_pool2d(x, 2)
        x = self.mid(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips)):
            x = dec(torch.cat([up(x), skip], dim=1))
        x = self.out(x)
        return x


def gpt2(
    *, n_layer: int = 4, n_embd: int = 128, n_head: int = 4, vocab_size: int = 1024,
    n_positions: int = 128, batch: int = 4, seq: int = 64, device: str | torch.device = "cpu",
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A Hugging Face GPT-2 language model built from a config, returning logits; needs transformers.

    Dropout is off so runs are deterministic; input and output embeddings are tied.
    """
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:  # transformers is a dev/example dependency, not a runtime one
        raise MissingDependencyError(
            "the gpt2 models need Hugging Face transformers: pip install 'pipecut[dev]' "
            "(or pip install transformers)"
        ) from e
    from partitioner.tracing.trace import CausalLMLogits

    cfg = GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size, n_positions=n_positions,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
        bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1,
    )
    with torch.device(device):
        model = CausalLMLogits(GPT2LMHeadModel(cfg))
        ids = torch.randint(0, vocab_size, (batch, seq))
    return model, (ids,)


MODELS: dict[str, Factory] = {
    "mlp": lambda: (MLPChain(), (torch.randn(32, 256),)),
    "resnet": lambda: (ResidualCNN(), (torch.randn(8, 3, 32, 32),)),
    "unet": lambda: (UNet(), (torch.randn(2, 3, 64, 64),)),
    "gpt2-tiny": lambda: gpt2(),
    "gpt2-124m": lambda: gpt2(
        n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024, batch=8, seq=1024, device="meta"
    ),
    "gpt2-175b": lambda: gpt2(
        n_layer=96, n_embd=12288, n_head=96, vocab_size=50257, n_positions=2048, batch=1, seq=2048, device="meta"
    ),
}


def load_model(spec: str) -> tuple[nn.Module, tuple[Any, ...]]:
    """A built-in model by name, or ``path/to/file.py:factory`` returning ``(model, example_inputs)``.

    Example:
        >>> model, (x,) = load_model("mlp")
        >>> tuple(x.shape)
        (32, 256)
    """
    if spec in MODELS:
        return MODELS[spec]()
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise ModelSpecError(
            f"unknown model {spec!r}: use a built-in name ({', '.join(MODELS)}) or "
            "path/to/file.py:factory where factory() returns (model, example_inputs)"
        )
    file = Path(path)
    if not file.is_file():
        raise ModelFileNotFoundError(f"model file {file} does not exist (from {spec!r})")
    mod_name = f"pipecut_user_{file.stem}"
    loader = importlib.util.spec_from_file_location(mod_name, file)
    if loader is None or loader.loader is None:
        raise ModelImportError(f"cannot import {file}")
    module = importlib.util.module_from_spec(loader)
    sys.modules[mod_name] = module
    loader.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ModelFactoryNotFoundError(f"{file} has no callable {name!r}")
    result = factory()
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        raise ModelFactoryError(f"{spec}: the factory must return (model, example_inputs), got {type(result).__name__}")
    model, inputs = result
    return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
