"""Split points by the end of a module's name: ``h.4`` for ``model.transformer.h.4``, in the API and the CLI."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner import partition
from partitioner.algorithms import resolve_split_point
from partitioner.errors import AmbiguousSplitPointError, PartitionOptionError, SplitPointError
from pipecut.cli import main
from test_readme import readme_block

MODULES = ["model", "model.transformer", "model.transformer.h", "model.transformer.h.4",
           "model.transformer.h.4.attn", "model.transformer.hh.4", "model.lm_head"]


def test_a_full_name_is_itself() -> None:
    assert resolve_split_point("model.transformer.h.4", MODULES) == "model.transformer.h.4"


def test_a_suffix_matches_at_a_dot_boundary_only() -> None:
    assert resolve_split_point("h.4", MODULES) == "model.transformer.h.4"  # not ...hh.4
    assert resolve_split_point("transformer.h.4", MODULES) == "model.transformer.h.4"
    assert resolve_split_point("lm_head", MODULES) == "model.lm_head"


def test_an_ambiguous_suffix_lists_its_candidates() -> None:
    with pytest.raises(AmbiguousSplitPointError) as e:
        resolve_split_point("4", MODULES)
    assert e.value.candidates == ("model.transformer.h.4", "model.transformer.hh.4")
    assert "model.transformer.h.4, model.transformer.hh.4" in str(e.value)
    assert isinstance(e.value, SplitPointError)


def test_an_unknown_name_lists_close_ones() -> None:
    with pytest.raises(SplitPointError, match=r"'h\.5' names no module.*did you mean model\.transformer\.h\.4"):
        resolve_split_point("h.5", MODULES)
    with pytest.raises(SplitPointError, match="names no module") as e:
        resolve_split_point("4.attn.x", MODULES)
    assert not isinstance(e.value, AmbiguousSplitPointError)


class _Twin(nn.Module):
    """Two branches whose blocks end the same way: ``enc.blocks.1`` and ``dec.blocks.1``."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Module()
        self.enc.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.dec = nn.Module()
        self.dec.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in [*self.enc.blocks, *self.dec.blocks]:
            x = torch.relu(b(x))
        return x


def test_partition_takes_a_suffix_and_counts_the_stages() -> None:
    model = _Twin()
    plan = partition(model, (torch.randn(2, 4),), split_points=["enc.blocks.1", "dec.blocks.1"])
    assert plan.num_stages == 3  # no num_stages: one more than the split points
    full = partition(model, (torch.randn(2, 4),), 3, split_points=["enc.blocks.1", "dec.blocks.1"])
    assert [st.nodes for st in plan.stages] == [st.nodes for st in full.stages]
    with pytest.raises(AmbiguousSplitPointError, match=r"dec\.blocks\.1, enc\.blocks\.1"):
        partition(model, (torch.randn(2, 4),), split_points=["blocks.1"])


def test_partition_without_stages_or_split_points_still_asks_for_them() -> None:
    with pytest.raises(PartitionOptionError, match="give num_stages or a cluster"):
        partition(_Twin(), (torch.randn(2, 4),))


def test_cli_suffixes_on_gpt2_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "gpt2-tiny", "--split-points", "h.1,h.3"]) == 0
    out = capsys.readouterr().out
    assert "pipecut plan: 3 stages" in out and "method manual" in out
    assert "model.transformer.h.1" in out and "model.transformer.h.3" in out


def test_cli_refuses_split_points_with_devices(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "gpt2-tiny", "--split-points", "h.1", "--devices", "2", "--global-batch", "8"])
    assert code != 0
    assert "--split-points cuts a pipeline of --stages N" in capsys.readouterr().err


def test_readme_split_points(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's `pipecut plan gpt2-124m --split-points h.4,h.8`, as written, through the console entry point."""
    (cmd,) = readme_block("tests/pipecut/test_split_points.py::test_readme_split_points").commands
    assert cmd.argv[0] == "pipecut" and "h.4,h.8" in cmd.argv
    assert main(list(cmd.argv[1:])) == 0
    out = capsys.readouterr().out
    assert "pipecut plan: 3 stages" in out and "method manual" in out
    lines = out.splitlines()
    starts = [ln.split()[1] for ln in lines if ln.strip()[:2] in ("1 ", "1*", "2 ", "2*")]
    assert starts == ["model.transformer.h.4", "model.transformer.h.8"], out
