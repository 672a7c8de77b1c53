"""Tests of partitioner.tracing.trace: both tracers, fake shapes, meta models, aliases, fingerprints, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpt2_case import gpt2_config
from partitioner.errors import TraceError, TraceOptionError
from partitioner.tracing.trace import CausalLMLogits, TracedModel, retarget_device, trace

# --- small models --------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) + x


class Tower(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # control flow on a tensor's value: neither fx nor export can capture it
            return self.fc(x)
        return -x


class WrapsDataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.odd = DataDependent()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.odd(self.pre(x))


class Positions(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.arange(x.shape[1], device=x.device)




def _vals_everywhere(t: TracedModel) -> None:
    for node in t.gm.graph.nodes:
        assert "val" in node.meta, f"{node.op} {node.name} has no meta['val']"


# --- fx ------------------------------------------------------------------------------------------


def test_fx_path_flat_io_and_shapes() -> None:
    model = Tower()
    x = torch.randn(5, 16)
    t = trace(model, (x,))
    assert t.method == "fx"
    assert t.input_names == ("x",)
    assert [(m.name, m.shape, m.dtype) for m in t.example_inputs] == [("x", (5, 16), "torch.float32")]
    out = t.gm(x)
    assert isinstance(out, tuple) and len(out) == 1
    torch.testing.assert_close(out[0], model(x))
    torch.testing.assert_close(t.unflatten_outputs(out), model(x))
    _vals_everywhere(t)
    assert t.gm.graph.output_node().meta["val"][0].shape == (5, 4)
    assert t.param_aliases == {}


def test_module_path_from_fx_stack() -> None:
    t = trace(Tower(), (torch.randn(2, 16),))
    paths = {n.name: t.module_path(n) for n in t.gm.graph.nodes}
    assert paths["blocks_0_fc"] == "blocks.0.fc"  # call_module: its target
    assert paths["relu"] == "blocks.0"  # a function called inside Block 0
    assert paths["add_2"] == "blocks.2"
    assert paths["x"] == "" and paths["output"] == ""


def test_leaf_modules_by_class_and_by_name() -> None:
    t = trace(Tower(), (torch.randn(2, 16),), leaf_modules=[Block])
    calls = [n for n in t.gm.graph.nodes if n.op != "placeholder" and n.op != "output"]
    assert [(n.op, n.target) for n in calls] == [
        ("call_module", "blocks.0"), ("call_module", "blocks.1"), ("call_module", "blocks.2"),
        ("call_module", "head"),
    ]
    t = trace(Tower(), (torch.randn(2, 16),), leaf_modules=["blocks.1"])
    targets = [n.target for n in t.gm.graph.nodes if n.op == "call_module"]
    assert targets == ["blocks.0.fc", "blocks.1", "blocks.2.fc", "head"]
    t = trace(Tower(), (torch.randn(2, 16),), leaf_modules=["blocks.*"])
    assert [n.target for n in t.gm.graph.nodes if n.op == "call_module"] == [
        "blocks.0", "blocks.1", "blocks.2", "head"
    ]
    assert t.gm.graph.output_node().meta["val"][0].shape == (2, 4)


def test_unknown_leaf_name_is_reported() -> None:
    with pytest.raises(TraceError, match=r"'blocks\.9'.*matches no submodule"):
        trace(Tower(), (torch.randn(2, 16),), leaf_modules=["blocks.9"])


def test_dict_output_kwargs_and_specialised_scalars() -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0):  # type: ignore[no-untyped-def]
            y = self.a(x) * scale
            if mask is not None:
                y = y + mask
            return {"y": y, "pair": (x, y.sum())}

    model = TwoHeads()
    x, mask = torch.randn(3, 4), torch.randn(3, 4)
    t = trace(model, (x,), example_kwargs={"mask": mask, "scale": 2.0})
    assert t.method == "fx"
    assert t.input_names == ("x", "mask")
    flat = t.gm(x, mask)
    assert len(flat) == 3
    rebuilt = t.unflatten_outputs(flat)
    expected = model(x, mask, 2.0)
    torch.testing.assert_close(rebuilt["y"], expected["y"])
    torch.testing.assert_close(rebuilt["pair"][1], expected["pair"][1])
    _vals_everywhere(t)


def test_meta_model_gets_shapes_without_weights() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8192, 8192), nn.GELU(), nn.Linear(8192, 8192))  # 1 GiB if real
    t = trace(model, (torch.randn(4, 8192),))
    assert t.method == "fx"
    assert all(p.is_meta for p in t.gm.parameters())
    vals = [n.meta["val"] for n in t.gm.graph.nodes if n.op == "call_module"]
    assert [tuple(v.shape) for v in vals] == [(4, 8192)] * 3
    assert all(isinstance(v, torch._subclasses.FakeTensor) for v in vals)


# --- export --------------------------------------------------------------------------------------


def test_gpt2_goes_through_export_and_equals_the_model(gpt2: tuple[nn.Module, TracedModel]) -> None:
    model, t = gpt2
    assert t.method == "export"
    assert t.input_names == ("input_ids",)
    ids = torch.randint(0, 128, (2, 16))
    out = t.gm(ids)
    assert len(out) == 1
    torch.testing.assert_close(out[0], model(ids))
    _vals_everywhere(t)
    assert t.gm.graph.output_node().meta["val"][0].shape == (2, 16, 128)


def test_export_keeps_original_parameter_names_and_ties(gpt2: tuple[nn.Module, TracedModel]) -> None:
    model, t = gpt2
    originals = dict(model.named_parameters(remove_duplicate=False))
    originals.update(model.named_buffers(remove_duplicate=False))
    attrs = [str(n.target) for n in t.gm.graph.nodes if n.op == "get_attr"]
    assert attrs and all(a in originals for a in attrs)
    for name, p in t.gm.named_parameters():
        assert p is originals[name]  # the same tensors, not copies
    # GPT-2 ties the input embedding to the LM head; the graph reads it once, under one name.
    assert t.param_aliases == {
        "model.lm_head.weight": ("model.lm_head.weight", "model.transformer.wte.weight")
    }
    assert "model.transformer.wte.weight" not in attrs


def test_export_module_paths(gpt2: tuple[nn.Module, TracedModel]) -> None:
    _, t = gpt2
    paths = {t.module_path(n) for n in t.gm.graph.nodes if n.op == "call_function"}
    assert "model.transformer.h.0.attn.c_attn" in paths
    assert "model.transformer.h.1.mlp.c_fc" in paths
    assert "model.lm_head" in paths


def test_gpt2_built_on_meta_traces_to_the_real_models_graph(gpt2: tuple[nn.Module, TracedModel]) -> None:
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = CausalLMLogits(transformers.GPT2LMHeadModel(gpt2_config())).eval()
    t = trace(model, (torch.randint(0, 128, (2, 16)),))
    assert t.method == "export"
    assert t.gm.graph.output_node().meta["val"][0].shape == (2, 16, 128)
    _vals_everywhere(t)
    # The model keeps its meta tensors, the graph holds those same tensors, ties included.
    assert all(p.is_meta for p in model.parameters())
    assert t.gm.get_parameter("model.lm_head.weight") is model.model.lm_head.weight
    assert t.param_aliases == gpt2[1].param_aliases
    # Captured as if on the CPU: the same nodes as the real model, so a plan made on meta binds.
    _, real = gpt2
    assert [n.name for n in t.gm.graph.nodes] == [n.name for n in real.gm.graph.nodes]
    assert t.fingerprint() == real.fingerprint()


def test_nested_inputs_are_flattened() -> None:
    class Pair(nn.Module):
        def forward(self, xy: tuple[torch.Tensor, torch.Tensor], z: torch.Tensor) -> torch.Tensor:
            return xy[0] * xy[1] + z

    x, y, z = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    t = trace(Pair(), ((x, y), z))
    assert t.method == "export"
    assert len(t.input_names) == 3
    torch.testing.assert_close(t.gm(x, y, z)[0], x * y + z)


def _device_constants(t: TracedModel) -> list[torch.device]:
    return [n.kwargs["device"] for n in t.gm.graph.nodes if isinstance(n.kwargs.get("device"), torch.device)]


def test_retarget_device_moves_factory_calls() -> None:
    # Captured from meta inputs as if on the CPU: the position ids are made on the CPU.
    t = trace(Positions(), (torch.zeros(2, 5, device="meta"),), method="export")
    assert _device_constants(t) == [torch.device("cpu")]
    x = torch.randn(2, 5)
    torch.testing.assert_close(t.gm(x)[0], x + torch.arange(5))
    with pytest.raises(RuntimeError):  # CPU position ids do not mix with tensors on meta
        t.gm(x.to("meta"))
    assert retarget_device(t.gm, "meta") == 1
    assert _device_constants(t) == [torch.device("meta")]
    assert t.gm(x.to("meta"))[0].shape == (2, 5)
    assert retarget_device(t.gm.graph, torch.device("cpu")) == 1  # graphs are accepted too
    t.gm.recompile()
    torch.testing.assert_close(t.gm(x)[0], x + torch.arange(5))
    assert retarget_device(t.gm, "cpu") == 0


# --- fingerprint ---------------------------------------------------------------------------------


def test_fingerprint_is_stable_and_sees_widths() -> None:
    a = trace(Tower(16), (torch.randn(2, 16),)).fingerprint()
    b = trace(Tower(16), (torch.randn(2, 16),)).fingerprint()
    assert a == b and len(a) == 64
    assert trace(Tower(32), (torch.randn(2, 32),)).fingerprint() != a
    assert trace(Tower(16, depth=4), (torch.randn(2, 16),)).fingerprint() != a


def test_fingerprint_of_export_traces(gpt2: tuple[nn.Module, TracedModel]) -> None:
    model, t = gpt2
    again = trace(model, (torch.randint(0, 128, (2, 16)),))
    assert again.fingerprint() == t.fingerprint()


# --- errors --------------------------------------------------------------------------------------


def test_trace_error_names_both_tracers_the_line_and_the_fix() -> None:
    with pytest.raises(TraceError) as info:
        trace(DataDependent(), (torch.randn(2, 8),))
    msg = str(info.value)
    assert "torch.fx.symbolic_trace failed" in msg
    assert "torch.export.export(strict=False) failed" in msg
    assert "control flow" in msg  # fx's own explanation
    assert "test_trace.py" in msg and "if x.sum() > 0" in msg  # where it broke
    assert "leaf_modules=" in msg and "method='export'" in msg  # what to do


def test_marking_the_offending_module_a_leaf_fixes_it() -> None:
    model = WrapsDataDependent()
    with pytest.raises(TraceError):
        trace(model, (torch.randn(2, 8),))
    t = trace(model, (torch.randn(2, 8),), leaf_modules=[DataDependent])
    assert t.method == "fx"
    assert [n.target for n in t.gm.graph.nodes if n.op == "call_module"] == ["pre", "odd"]
    x = torch.randn(2, 8)
    torch.testing.assert_close(t.gm(x)[0], model(x))


def test_method_fx_only_reports_fx(gpt2: tuple[nn.Module, TracedModel]) -> None:
    model, _ = gpt2
    with pytest.raises(TraceError) as info:
        trace(model, (torch.randint(0, 128, (2, 16)),), method="fx")
    assert "torch.fx.symbolic_trace failed" in str(info.value)
    assert "torch.export" not in str(info.value).split("To fix")[0]


def test_bad_method_is_rejected() -> None:
    with pytest.raises(ValueError, match="method must be") as info:
        trace(Tower(), (torch.randn(2, 16),), method="jit")  # type: ignore[arg-type]
    assert isinstance(info.value, TraceOptionError)


class MakesAConstant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * torch.tensor([1.0, 2.0, 3.0])


def test_fx_constants_live_on_the_graph_not_the_model() -> None:
    model = MakesAConstant()
    x = torch.randn(2, 3)
    first = trace(model, (x,), method="fx")
    assert not [k for k in vars(model) if k.startswith("_tensor_constant")]
    again = trace(model, (x,), method="fx")
    assert first.fingerprint() == again.fingerprint()  # the constant keeps its name
    torch.testing.assert_close(first.gm(x)[0], model(x))
