"""What pipecut prints of a plan escapes the user's module names: DOT strings stay well formed, an ANSI
sequence never reaches the terminal through ``str(plan)``, rich markup in a name is shown, not applied."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

from partitioner import Plan, partition

# Names nn.Module accepts and torch.fx traces (a quote or newline breaks fx's code generation).
ODD_NAMES = ["a\\b", "\x1b[31mred", "[bold]loud[/bold]", "bell\x07", "rtl\u202eevil"]


def _plan(names: list[str], *, dict_keys: bool = False) -> Plan:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(4, 4)
            self.blocks = nn.ModuleDict({n: nn.Linear(4, 4) for n in names})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.first(x)
            for block in self.blocks.values():
                h = block(h)
            return h

    if dict_keys:
        model: nn.Module = Net()
    else:
        model = nn.Sequential()
        model.add_module("first", nn.Linear(4, 4))
        for n in names:
            model.add_module(n, nn.Linear(4, 4))
    return partition(model, (torch.randn(2, 4),), len(names) + 1, microbatches=len(names) + 1)


def _dot_strings(dot: str) -> list[str]:
    """Every double-quoted string of a DOT text, read as Graphviz reads it (``\\"`` and ``\\\\`` inside)."""
    return re.findall(r'"((?:[^"\\]|\\.)*)"', dot)


@pytest.mark.parametrize("dict_keys", [False, True], ids=["add_module", "ModuleDict"])
def test_str_plan_prints_no_control_characters_and_no_markup(dict_keys: bool) -> None:
    plan = _plan(ODD_NAMES, dict_keys=dict_keys)
    assert any("\x1b" in st.modules for st in plan.stages)  # the name does reach the plan
    text = str(plan)
    assert not any(not (ch.isprintable() or ch == "\n") for ch in text), repr(text)
    assert "\\x1b[31mred" in text and "bell\\x07" in text and "rtl\\u202eevil" in text
    assert "[bold]loud[/bold]" in text  # shown as written, not made bold and dropped
    assert "a\\b" in text


def test_dot_escapes_backslashes_quotes_and_control_characters() -> None:
    plan = _plan(ODD_NAMES)
    # A quote cannot come through tracing (fx's generated code breaks on it); a stage's module
    # summary is free text all the same.
    plan = dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(st, modules=st.modules + ' "q" \\') for st in plan.stages
    ))
    dot = plan.to_dot()
    assert not any(not (ch.isprintable() or ch == "\n") for ch in dot), repr(dot)
    labels = [s for s in _dot_strings(dot) if s.startswith("stage ")]
    assert len(labels) == len(plan.stages)
    # Each label's body parts, split at DOT's own line breaks, unescaped, are the names as printed.
    bodies = [re.sub(r"\\(.)", r"\1", label.split("\\n")[1]) for label in labels]
    assert bodies == ["".join(c if c.isprintable() else ascii(c)[1:-1] for c in st.modules) for st in plan.stages]
    assert any("a\\b" in b for b in bodies) and any('"q"' in b for b in bodies)
    assert any("\\x1b[31mred" in b for b in bodies)


def test_printable_keeps_ordinary_names() -> None:
    from partitioner.plan.render import printable

    for name in ("h.0.attn", "blocks.é", "layers.3 [x]", "日本"):
        assert printable(name) == name
    assert printable("\x1b[2J\t\n") == "\\x1b[2J\\t\\n"
