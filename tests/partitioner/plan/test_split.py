"""split.py: stages run in order equal the model; names are the original model's."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from partitioner.errors import InputCountError, PartitionError, PipecutError, StageIndexError
from partitioner.plan.split import StagedModel, split_graph
from tiny_modules import TiedLM


class SkipNet(nn.Module):
    """Two inputs, a skip from the first layer to the last, two outputs, a size() that crosses."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)
        self.d = nn.Linear(16, 8)
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("scratch", torch.zeros(1), persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h0 = torch.relu(self.a(x))
        n = h0.size(0)
        h1 = torch.relu(self.b(h0))
        h2 = torch.tanh(self.c(h1)) + h0 * self.scale  # h0 skips stage 1
        out = self.d(h2).reshape(n, -1) + y
        return out, h1.sum(dim=1)


def _traced(model: nn.Module, *inputs: torch.Tensor) -> fx.GraphModule:
    """Symbolic trace with ``meta['val']`` on every node, as partitioner.tracing.trace provides."""
    gm = fx.symbolic_trace(model)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*(mode.from_tensor(t) for t in inputs))
    return gm


def _compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def _even_assignment(gm: fx.GraphModule, p: int) -> dict[str, int]:
    nodes = _compute_nodes(gm)
    return {n.name: min(i * p // len(nodes), p - 1) for i, n in enumerate(nodes)}


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_stages_in_order_equal_model_with_skip_and_two_outputs(p: int) -> None:
    model = SkipNet()
    gm = _traced(model, torch.randn(5, 8), torch.randn(5, 8))
    staged = split_graph(gm, _even_assignment(gm, p), p, persistent_buffers=set(model.state_dict()))
    x, y = torch.randn(5, 8), torch.randn(5, 8)
    want = model(x, y)
    got = staged(x, y)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    keys = [set(m.state_dict()) for m in staged.stages]
    assert set().union(*keys) == set(model.state_dict())
    for k in keys:
        assert k <= set(model.state_dict())


def test_skip_goes_straight_to_its_consumer() -> None:
    model = SkipNet()
    gm = _traced(model, torch.randn(5, 8), torch.randn(5, 8))
    stage_of = {n.name: 0 for n in _compute_nodes(gm)}
    for n in _compute_nodes(gm):
        if n.name.startswith(("b", "relu_1")):
            stage_of[n.name] = 1
        elif n.name not in ("a", "relu", "size") and not n.name.startswith(("b", "relu_1")):
            stage_of[n.name] = 2
    staged = split_graph(gm, stage_of, 3)
    h0 = [v for v in staged.io[0].outputs if v.name == "relu"]
    assert h0 and h0[0].consumers == (1, 2)  # stage 0 -> stage 2 directly, skipping stage 1
    assert any(v.name == "relu" for v in staged.io[2].inputs)
    n = [v for v in staged.io[0].outputs if v.name == "size"]
    assert n and n[0].kind == "int"
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    torch.testing.assert_close(staged(x, y)[0], model(x, y)[0])


def test_tied_parameters_are_listed_and_names_cover_the_model() -> None:
    model = TiedLM(32, 8)
    gm = fx.symbolic_trace(model)
    staged = split_graph(
        gm,
        {"emb": 0, "mid": 0, "relu": 1, "head": 1},
        2,
        param_aliases={"emb.weight": ("emb.weight", "head.weight")},
        persistent_buffers=set(model.state_dict()),
    )
    assert list(staged.shared_params) == ["emb.weight"]
    assert staged.shared_params["emb.weight"] == (0, 1)
    keys = [set(m.state_dict()) for m in staged.stages]
    assert set().union(*keys) == set(model.state_dict())
    ids = torch.randint(0, 32, (4, 6))
    torch.testing.assert_close(staged(ids)[0], model(ids))


def test_backward_flow_is_rejected_with_node_names() -> None:
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(PartitionError, match=r"'_1'.*stage 0.*reads '_0'.*stage 1"):
        split_graph(gm, {"_0": 1, "_1": 0}, 2)


def test_empty_stage_and_missing_node_are_rejected() -> None:
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(PartitionError, match=r"stages \[2\] hold no compute node"):
        split_graph(gm, {"_0": 0, "_1": 1}, 3)
    with pytest.raises(PartitionError, match="no stage"):
        split_graph(gm, {"_0": 0}, 1)


def _three_stages() -> StagedModel:
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 4), nn.Linear(4, 1)))
    return split_graph(gm, {"_0": 0, "_1": 0, "_2": 1, "_3": 2}, 3)


def test_staged_model_is_the_sequence_of_its_stage_modules() -> None:
    staged = _three_stages()
    mods = staged.stages
    assert isinstance(staged, Sequence)
    assert len(staged) == 3
    assert list(staged) == mods and all(a is b for a, b in zip(staged, mods))
    assert [staged[s] for s in range(3)] == mods
    assert staged[-1] is mods[2] and staged[-3] is mods[0]
    assert list(reversed(staged)) == mods[::-1]
    assert mods[1] in staged and nn.Linear(1, 1) not in staged
    assert staged.index(mods[2]) == 2 and staged.count(mods[0]) == 1
    assert [sum(p.numel() for p in m.parameters()) for m in staged] == [9, 16, 5]


def test_staged_model_slices_are_lists_of_modules() -> None:
    staged = _three_stages()
    mods = staged.stages
    assert staged[1:] == mods[1:] and type(staged[1:]) is list
    assert staged[::-1] == mods[::-1]
    assert staged[5:] == []
    head = staged[:2]
    head.clear()  # a copy: the staged model keeps its stages
    assert len(staged) == 3


@pytest.mark.parametrize("index", [3, -4, 100])
def test_staged_model_index_out_of_range_says_how_many_stages(index: int) -> None:
    staged = _three_stages()
    want = rf"stage index {index} is out of range: this model has 3 stages \(0\.\.2, or -3\.\.-1 "
    with pytest.raises(IndexError, match=want) as info:
        staged[index]
    assert isinstance(info.value, StageIndexError)


def test_staged_model_counts_its_inputs() -> None:
    with pytest.raises(TypeError, match=r"the model takes 1 inputs \['input_1'\], got 2") as info:
        _three_stages()(torch.randn(2, 2), torch.randn(2, 2))
    assert isinstance(info.value, InputCountError) and isinstance(info.value, PipecutError)


def test_staged_model_rejects_a_non_integer_index() -> None:
    with pytest.raises(TypeError):
        _three_stages()["0"]  # type: ignore[call-overload]
