"""partition() end to end: the plan's table, its file form, its stages, and every typed error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from partitioner import (
    Cluster,
    DeviceSpec,
    InfeasibleMemoryError,
    Plan,
    PlanFormatError,
    PlanMismatchError,
    SplitPointError,
    TooManyStagesError,
    partition,
)
from partitioner.zoo import MLPChain, UNet, gpt2


def _mlp_plan(**kw: object) -> tuple[nn.Module, torch.Tensor, Plan]:
    model = MLPChain((32, 64, 16, 128, 32, 48, 8))
    x = torch.randn(4, 32)
    return model, x, partition(model, (x,), kw.pop("num_stages", 3), microbatches=4, **kw)  # type: ignore[arg-type]


def test_plan_table_shows_stages_bounds_and_predictions() -> None:
    _, _, plan = _mlp_plan()
    text = str(plan)
    for word in ("stage", "modules", "params", "fwd FLOPs", "memory / usable", "sends"):
        assert word in text
    assert "bottleneck:" in text and "lower bound:" in text
    assert "gpipe" in text and "1f1b" in text and "bubble" in text
    assert len(plan.stages) == 3
    assert plan.bottleneck == pytest.approx(max(st.time for st in plan.stages))
    assert plan.lower_bound <= plan.bottleneck * (1 + 1e-9)
    # Every compute node is in exactly one stage.
    names = [v for st in plan.stages for v in st.nodes]
    assert len(names) == len(set(names))


def test_uniform_pipeline_prediction_matches_theory() -> None:
    _, _, plan = _mlp_plan()
    p, m = plan.num_stages, plan.microbatches
    for pr in plan.predictions:
        # Transfers overlap compute in the simulator; each stage's own work cannot.
        assert pr.step_time >= m * max(st.fwd_time + st.bwd_time for st in plan.stages) * (1 - 1e-9)
        assert 0 <= pr.bubble < 1
    # With equal stages the bubble would be (p - 1) / (m + p - 1); unequal stages only add idle time.
    assert plan.prediction("1f1b").bubble >= (p - 1) / (m + p - 1) - 1e-9


def test_save_load_round_trip_and_rebind(tmp_path: Path) -> None:
    model, x, plan = _mlp_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan
    assert str(loaded) == str(plan)
    with pytest.raises(PlanMismatchError, match="bind"):
        loaded.build_stages()
    bound = Plan.load(path, model, (x,))
    staged = bound.build_stages()
    y = torch.randn(4, 32)
    torch.testing.assert_close(staged(y)[0], model(y))


def test_plan_for_another_model_is_rejected(tmp_path: Path) -> None:
    _, x, plan = _mlp_plan()
    plan.save(tmp_path / "plan.json")
    other = MLPChain((32, 64, 16, 128, 32, 49, 8))  # one width differs
    with pytest.raises(PlanMismatchError, match="different graph"):
        Plan.load(tmp_path / "plan.json", other, (x,))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d["stages"][0].__setitem__("memory", 1.0), "checksum"),
        (lambda d: d.__setitem__("version", 99), "version 99"),
        (lambda d: d.__setitem__("format", "other"), "not a pipecut plan"),
    ],
)
def test_hand_edited_plan_is_rejected(tmp_path: Path, edit, match: str) -> None:  # type: ignore[no-untyped-def]
    _, _, plan = _mlp_plan()
    data = plan.to_dict()
    edit(data)
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(PlanFormatError, match=match):
        Plan.load(tmp_path / "p.json")


def test_corrupt_plan_files_are_rejected(tmp_path: Path) -> None:
    _, _, plan = _mlp_plan()
    text = json.dumps(plan.to_dict())
    (tmp_path / "cut.json").write_text(text[: len(text) // 2])
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        Plan.load(tmp_path / "cut.json")
    data = plan.to_dict()
    del data["stages"][1]["nodes"]
    from partitioner.plan.plan import _checksum

    data["checksum"] = _checksum(data)  # consistent checksum, but a field is missing
    (tmp_path / "missing.json").write_text(json.dumps(data))
    with pytest.raises(PlanFormatError, match=r"field stages\[1\].nodes is missing, expected a list, each item a str"):
        Plan.load(tmp_path / "missing.json")
    data = plan.to_dict()
    data["stages"][1]["nodes"] = data["stages"][0]["nodes"]
    data["checksum"] = _checksum(data)
    (tmp_path / "dup.json").write_text(json.dumps(data))
    with pytest.raises(PlanFormatError, match="is in stage 0 and stage 1"):
        Plan.load(tmp_path / "dup.json")


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (bytes(range(256)) * 4, r"not a text file \(byte 0x80 at offset 128"),
        ("\ufeff{}".encode("utf-16"), "not a text file"),
        (b"", "not valid JSON"),
        (b"[1, 2, 3]", "not a pipecut plan"),
        (b'"a plan"', "not a pipecut plan"),
        (b"null", "not a pipecut plan"),
        (b"[" * 100_000, "nests JSON too deeply|not valid JSON"),
    ],
    ids=["binary", "utf16", "empty", "array", "string", "null", "deep"],
)
def test_unreadable_plan_files_are_plan_format_errors(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(content)
    with pytest.raises(PlanFormatError, match=match) as info:
        Plan.load(path)
    assert str(path) in str(info.value) and "re-create" in str(info.value)


def test_more_stages_than_units() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(TooManyStagesError, match="2 node units into 3"):
        partition(model, (torch.randn(2, 4),), 3)


def test_memory_no_partition_can_fit() -> None:
    tiny = DeviceSpec("tiny", 1e12, 1e12, 1e11, memory=64 * 1024)
    model, x, _ = _mlp_plan()
    with pytest.raises(InfeasibleMemoryError, match="more stages or devices") as info:
        partition(model, (x,), 2, cluster=Cluster.uniform(2, tiny))
    assert info.value.available == [64 * 1024, 64 * 1024]
    assert all(n > a for n, a in zip(info.value.needed, info.value.available)) or max(info.value.needed) > 64 * 1024


def test_memory_steers_the_cut() -> None:
    # A big embedding (parameters, no FLOPs) then six linears: the fastest cut puts three linears
    # beside the embedding, the leanest puts none.
    model = nn.Sequential(nn.Embedding(50_000, 256), *[nn.Linear(256, 256) for _ in range(6)])
    x = torch.randint(0, 50_000, (64, 8))
    free = partition(model, (x,), 2, microbatches=4, refine=False)
    lean = partition(model, (x,), 2, microbatches=4, method="balanced_params")
    top, low = max(st.memory for st in free.stages), max(st.memory for st in lean.stages)
    assert low < top, "the test needs a model whose fastest cut is not its leanest"
    cap = (low + top) / 2
    dev = DeviceSpec("small", 50e9, 50e9, 10e9, memory=cap)
    plan = partition(model, (x,), 2, cluster=Cluster.uniform(2, dev), microbatches=4, refine=False)
    assert all(st.memory <= cap for st in plan.stages)
    assert plan.bottleneck >= free.bottleneck * (1 - 1e-9)


def test_manual_split_points_are_honoured() -> None:
    model = MLPChain((8, 8, 8, 8, 8, 8))
    plan = partition(model, (torch.randn(2, 8),), 3, split_points=["layers.2", "layers.4"])
    assert plan.method == "manual"
    assert plan.stages[1].nodes[0] == "layers_2"
    assert plan.stages[2].nodes[0] == "layers_4"


def test_bad_split_points_say_what_to_do() -> None:
    model = MLPChain((8, 8, 8, 8, 8, 8))
    with pytest.raises(SplitPointError, match=r"did you mean layers\.2"):
        partition(model, (torch.randn(2, 8),), 2, split_points=["layers.2x"])
    with pytest.raises(SplitPointError, match="not in model order"):
        partition(model, (torch.randn(2, 8),), 3, split_points=["layers.4", "layers.2"])


def test_module_granularity_cuts_only_between_layers() -> None:
    model, (ids,) = gpt2(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=16, batch=2, seq=8)
    plan = partition(model, (ids,), 3, granularity="module")
    owners: dict[str, int] = {}
    for st in plan.stages:
        for node in st.nodes:
            traced = plan._binding.traced  # type: ignore[union-attr]
            path = traced.module_path(next(n for n in traced.gm.graph.nodes if n.name == node))
            if ".h." in path:  # a transformer block: never cut inside it
                layer = ".".join(path.split(".")[:4])
                assert owners.setdefault(layer, st.index) == st.index, f"{layer} split across stages"
    assert len(owners) == 4
    staged = plan.build_stages()
    x = torch.randint(0, 64, (2, 8))  # export specialises the graph to the example's shapes
    torch.testing.assert_close(staged(x)[0], model(x))


def test_meta_model_plans_without_allocating() -> None:
    model, (ids,) = gpt2(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, batch=2, seq=16, device="meta")
    plan = partition(model, (ids,), 2, cluster=Cluster.uniform(2, "A100-80GB"))
    assert all(prm.is_meta for prm in model.parameters())
    assert sum(st.params for st in plan.stages) >= sum(p.numel() for p in model.parameters())


def test_stage_state_dicts_cover_the_model_with_tied_weights() -> None:
    model, (ids,) = gpt2(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, batch=2, seq=8)
    plan = partition(model, (ids,), 3)
    staged = plan.build_stages()
    keys = [set(m.state_dict()) for m in staged.stages]
    assert set().union(*keys) == set(model.state_dict())
    assert all(k <= set(model.state_dict()) for k in keys)
    assert plan.shared_params and plan.shared_params[0][1] == (0, 2)
    x = torch.randint(0, 64, (2, 8))  # export specialises the graph to the example's shapes
    torch.testing.assert_close(staged(x)[0], model(x))


class _Unread(nn.Module):
    """State the forward never reads: a buffer and a parameter in ``head``, a top-level buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)
        self.head.register_buffer("calibration", torch.ones(2))
        self.head.spare = nn.Parameter(torch.zeros(2))
        self.register_buffer("version", torch.tensor(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_state_the_forward_never_reads_still_lands_in_a_stage() -> None:
    model = _Unread()
    plan = partition(model, (torch.randn(2, 4),), 2, split_points=["head"])
    loaded = Plan.from_dict(plan.to_dict()).bind(model, (torch.randn(2, 4),))
    for staged in (plan.build_stages(), loaded.build_stages()):
        keys = [set(m.state_dict()) for m in staged.stages]
        assert set().union(*keys) == set(model.state_dict())
        assert {"head.calibration", "head.spare"} <= keys[1]  # beside head.weight
        assert "version" in keys[0]  # no relative: the first stage
        assert staged.stages[1].get_buffer("head.calibration") is model.head.calibration  # not a copy


def test_skip_connections_across_stages_equal_the_model() -> None:
    model = UNet(width=4, levels=3)
    x = torch.randn(1, 3, 16, 16)
    plan = partition(model, (x,), 4)
    staged = plan.build_stages()
    skips = [v for io in staged.io for v in io.outputs if len(v.consumers) and max(v.consumers) - v.producer >= 2]
    assert skips, "expected a U-Net skip to jump over a stage"
    y = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(staged(y)[0], model(y))


@pytest.mark.parametrize("method", ["equal_count", "balanced_params", "equal_size"])
def test_baselines_are_costed_and_never_beat_exact(method: str) -> None:
    model, x, best = _mlp_plan(refine=False)
    plan = partition(model, (x,), 3, method=method, microbatches=4)
    assert plan.method == method
    assert plan.bottleneck >= best.bottleneck * (1 - 1e-9)


def test_heterogeneous_cluster_gives_the_fast_device_more_work() -> None:
    model = MLPChain((1024,) * 9)
    fast = DeviceSpec("fast", 4e12, 4e12, 1e13, 1e12, op_overhead=0.0)
    slow = DeviceSpec("slow", 1e12, 1e12, 1e13, 1e12, op_overhead=0.0)
    plan = partition(model, (torch.randn(256, 1024),), 2, cluster=Cluster((fast, slow)))
    assert plan.stages[0].fwd_flops > plan.stages[1].fwd_flops


def test_dot_lists_stages_and_transfers() -> None:
    _, _, plan = _mlp_plan()
    dot = plan.to_dot()
    assert dot.startswith("digraph") and "s0 -> s1" in dot and "s1 -> s2" in dot
