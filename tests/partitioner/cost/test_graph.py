"""graph.py: units, layer depth, module ranges, and the cut positions a Problem allows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner import Cluster, partition
from partitioner.cost.costs import cost_graph
from partitioner.cost.graph import build_graph, group_units, layer_depth, module_range, to_problem
from partitioner.tracing.trace import trace
from tiny_modules import TiedLM


class Gated(nn.Module):
    """``chunk`` returns a list: it must stay with the getitems that read it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        left, right = h.chunk(2, dim=-1)
        return self.b(torch.relu(left) * torch.sigmoid(right))


def _problem(model: nn.Module, x: torch.Tensor, p: int):  # type: ignore[no-untyped-def]
    t = trace(model, (x,))
    g = build_graph(t.gm, cost_graph(t), t.module_path)
    units = group_units(g)
    numel = {n: prm.numel() for n, prm in t.gm.named_parameters(remove_duplicate=False)}
    return t, units, to_problem(
        g, units, Cluster.uniform(p, "cpu"), inflight=[1] * p, param_numel=numel, param_aliases=t.param_aliases
    )


def test_cuts_never_separate_a_list_from_its_readers() -> None:
    _, units, problem = _problem(Gated(), torch.randn(4, 8), 2)
    order = [u.nodes[0] for u in units]
    chunk = order.index("chunk")
    last_getitem = max(i for i, v in enumerate(order) if v.startswith("getitem"))
    assert problem.cuts is not None
    assert not any(chunk < k <= last_getitem for k in problem.cuts)
    assert all(1 <= k < len(units) for k in problem.cuts)


@pytest.mark.parametrize("method", ["exact", "equal_count", "balanced_params", "equal_size"])
def test_every_method_builds_runnable_stages_around_lists(method: str) -> None:
    model, x = Gated(), torch.randn(4, 8)
    for p in (2, 3, 4):
        plan = partition(model, (x,), p, method=method)
        torch.testing.assert_close(plan.build_stages()(x)[0], model(x))


def test_tied_weight_is_charged_on_both_ends() -> None:
    model = TiedLM(1000, 16)
    _, _, problem = _problem(model, torch.randint(0, 1000, (2, 3)), 2)
    per_copy = 1000 * 16 * 16.0
    charged = [s for s in problem.state_bytes if s >= per_copy]
    assert len(charged) == 2, "the tied weight needs state on both stages that hold it"
    # In the plan table a stage holding both ends counts the tensor once.
    plan = partition(model, (torch.randint(0, 1000, (2, 3)),), 1)
    assert plan.stages[0].params == sum(p.numel() for p in model.parameters())


def test_layer_depth_and_module_range() -> None:
    assert layer_depth(["transformer.wte", "transformer.h.0.attn", "transformer.h.1.mlp", "lm_head"]) == 3
    assert layer_depth(["layers.0", "layers.1", "layers.2"]) == 2
    assert module_range(["h.0", "h.0", "h.1", "h.2"]) == "h.0 … h.2"
    assert module_range(["", "head"]) == "head"  # top-level glue (size reads) is not a module
    assert module_range(["", ""]) == "<top>"
