"""no_grad and autocast regions in exported graphs: one node, costed like its body, safe to run."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from partitioner import partition
from partitioner.cost.costs import cost_graph
from partitioner.tracing.fingerprint import graph_fingerprint
from partitioner.tracing.hops import bodies, run_with_autocast, run_with_grad_mode
from partitioner.tracing.trace import retarget_device, trace
from rotary_case import RotaryNet
from runtime import PipelineTrainer


def _example(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 6, 8)


def _region_nodes(gm: torch.fx.GraphModule, fn: object) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn]


def test_export_regions_become_safe_calls_and_grad_mode_survives() -> None:
    t = trace(RotaryNet(), (_example(),), method="export")
    assert torch.is_grad_enabled()
    assert len(_region_nodes(t.gm, run_with_grad_mode)) == 1
    assert len(_region_nodes(t.gm, run_with_autocast)) == 1
    assert not [n for n in t.gm.graph.nodes if "higher_order" in str(n.target)]
    assert len(list(bodies(t.gm))) == 2


def test_regions_are_costed_like_their_bodies() -> None:
    t = trace(RotaryNet(), (_example(),), method="export")
    costs = cost_graph(t)
    (grad_region,) = _region_nodes(t.gm, run_with_grad_mode)
    (cast_region,) = _region_nodes(t.gm, run_with_autocast)
    # pos (6, 1) @ inv_freq (1, 4): 2 * 6 * 1 * 4 FLOPs forward; no_grad: nothing backward, nothing saved.
    assert costs[grad_region.name].fwd_flops == 2 * 6 * 4
    assert costs[grad_region.name].bwd_flops == 0
    assert costs[grad_region.name].saved_bytes == 0
    # The head Linear (2*6 rows x 8 x 8) runs with grad on inside the region: counted both ways.
    assert costs[cast_region.name].fwd_flops == 2 * 12 * 8 * 8
    assert costs[cast_region.name].bwd_flops == 2 * 2 * 12 * 8 * 8
    assert costs[cast_region.name].saved_bytes > 0
    assert torch.is_grad_enabled()


def test_a_region_that_raises_leaves_grad_mode_on() -> None:
    def broken(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("bad shapes")

    with pytest.raises(RuntimeError, match="bad shapes"):
        run_with_grad_mode(False, broken, torch.ones(1))
    assert torch.is_grad_enabled()
    with pytest.raises(RuntimeError, match="bad shapes"):
        run_with_autocast("cpu", torch.bfloat16, True, None, broken, torch.ones(1))
    assert not torch.is_autocast_enabled("cpu")


def test_a_stage_that_fails_inside_a_region_leaves_grad_mode_on() -> None:
    plan = partition(RotaryNet(), (_example(),), 2, trace_method="export")
    stages = plan.build_stages()
    with pytest.raises(RuntimeError):
        stages(torch.randn(2, 6, 5))  # the wrong width fails inside the stage
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_regions_are_never_cut_through(p: int) -> None:
    plan = partition(RotaryNet(), (_example(),), p, trace_method="export")
    stage_of = plan.stage_of()
    gm = plan.traced.gm
    for region in (*_region_nodes(gm, run_with_grad_mode), *_region_nodes(gm, run_with_autocast)):
        # The region's tuple never crosses a cut: its element reads sit in its own stage.
        assert {stage_of[u.name] for u in region.users} == {stage_of[region.name]}
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_stages_with_regions_train_exactly(schedule: str) -> None:
    model = RotaryNet()
    ref = copy.deepcopy(model)
    plan = partition(model, (_example(),), 3, microbatches=4, schedule=schedule, trace_method="export")
    trainer = PipelineTrainer(plan, nn.functional.mse_loss, transport="sequential")
    x, y = torch.randn(8, 6, 8), torch.randn(8, 6, 8)
    loss = trainer.forward_backward(x, y)
    want = nn.functional.mse_loss(ref(x), y)
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    grads = {n: prm.grad for n, prm in ref.named_parameters()}
    for name, prm in trainer.named_parameters():
        torch.testing.assert_close(prm.grad, grads[name], msg=lambda m, name=name: f"{name}: {m}")
    assert torch.is_grad_enabled()


def test_retarget_device_reaches_region_bodies() -> None:
    with torch.device("meta"):
        model = RotaryNet()
    t = trace(model, (_example(),), method="export")  # captured as if on the CPU
    (body, _) = bodies(t.gm)
    assert [n.kwargs["device"] for n in body.graph.nodes if "device" in n.kwargs] == [torch.device("cpu")]
    assert retarget_device(t.gm, "meta") >= 1
    assert [n.kwargs["device"] for n in body.graph.nodes if "device" in n.kwargs] == [torch.device("meta")]
    cos = t.gm(torch.zeros(2, 6, 8, device="meta"))[0]
    assert cos.device.type == "meta"


def test_auto_trace_takes_export_for_mode_regions() -> None:
    # fx would run the no_grad block while tracing and record none of it.
    t = trace(RotaryNet(), (_example(),))
    assert t.method == "export"
    with pytest.raises(Exception, match=r"torch\.fx cannot record"):
        trace(RotaryNet(), (_example(),), method="fx")


class OtherRegion(RotaryNet):
    """RotaryNet with another no_grad body: the same top-level graph, other angles."""

    def __init__(self) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            pos = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
            freqs = (pos[:, None] + 1.0) @ self.rotary.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        for layer in self.layers:
            x = layer(x) * cos + x * sin
        with torch.autocast("cpu", enabled=False):
            x = self.head(x.float())
        return x


def test_the_fingerprint_covers_region_bodies() -> None:
    a = trace(RotaryNet(), (_example(),), method="export")
    b = trace(OtherRegion(), (_example(),), method="export")
    assert a.fingerprint() == trace(RotaryNet(), (_example(),), method="export").fingerprint()
    assert graph_fingerprint(a.gm.graph) == graph_fingerprint(b.gm.graph)  # only the bodies differ
    assert a.fingerprint() != b.fingerprint()
