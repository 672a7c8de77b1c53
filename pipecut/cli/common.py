"""What the ``pipecut`` subcommands share: the console they print to, their count arguments, and a
Hugging Face folder's model as ``plan`` and ``calibrate`` take it (``pipecut.cli.command``,
``pipecut.cli.calibrate``)."""

from __future__ import annotations

import os

import torch
from rich.console import Console
from torch import nn

from partitioner.errors import CliArgumentError
from partitioner.plan.render import TEXT_WIDTH
from pipecut.folder import HFFolder, max_positions

__all__ = ["make_console", "positive_count", "positive_count_or_auto", "folder_model"]


def make_console() -> Console:
    """A console as wide as the terminal (rich reads ``COLUMNS``, else asks the terminal); into a
    file or a pipe, with no ``COLUMNS``, ``str(plan)``'s fixed width rather than rich's 80, so
    saved output keeps every column."""
    console = Console(highlight=False, markup=False)  # a path or model name is shown as written
    if "COLUMNS" not in os.environ and not console.is_terminal:
        console = Console(highlight=False, markup=False, width=TEXT_WIDTH)
    return console


def folder_model(
    path: str, seq_len: int | None, rows: int, *, trust_remote_code: bool, command: str
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A Hugging Face folder's model on meta (no weight memory) and one micro-batch of token ids."""
    folder = HFFolder(path, trust_remote_code=trust_remote_code)
    config = folder.config
    folder.check_causal_lm(config, command=command)
    longest = max_positions(config)
    length = seq_len or min(1024, longest or 1024)
    if longest is not None and length > longest:
        raise CliArgumentError(f"--seq-len {length} is longer than the model's {longest} positions")
    module = folder.build(meta=True, config=config)  # partition takes the Hugging Face model as it is
    return module, folder.example_inputs(seq_len=length, micro_batch_size=rows)


def positive_count_or_auto(text: str) -> int | str:
    return text if text == "auto" else positive_count(text, "or 'auto'")


def positive_count(text: str, alternative: str = "") -> int:
    """A positive count (``--microbatches``), or a usage error saying what was given."""
    expected = f"a positive integer{' ' + alternative if alternative else ''}"
    try:
        value = int(text)
    except ValueError:
        raise CliArgumentError(f"expected {expected}, got {text!r}") from None
    if value < 1:
        raise CliArgumentError(f"expected {expected}, got {value}")
    return value
