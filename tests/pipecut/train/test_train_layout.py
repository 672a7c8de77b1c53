"""`pipecut train --layout auto | --plan | --zero`: settings, the search's constraints, a saved plan's checks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from partitioner import Cluster, Plan, plan_layout
from pipecut.cli import main
from pipecut.folder import HFFolder
from pipecut.train import TrainConfig, TrainConfigError, resolve
from pipecut.train.config import read_toml, to_toml
from pipecut.train.layout_choice import (
    PlanModelError,
    PlanWorldError,
    TrainPlanError,
    bind_plan,
    choose,
    resolved,
    search_space,
)
from pipecut.train.loop import layout

REQUIRED = {"model": "m", "data": "d.bin", "out": "o"}


def test_manual_is_the_default_and_fills_in_the_flags_defaults(tmp_path: Path) -> None:
    cfg = resolve(REQUIRED, {})
    assert (cfg.layout, cfg.schedule, cfg.micro_batch_size, cfg.zero, cfg.plan) == ("manual", None, None, None, None)
    choice = choose(cfg, None, None, world=1, preset="cpu", out=tmp_path, loss_fn=None)  # type: ignore[arg-type]
    assert choice.plan is None and (choice.cfg.schedule, choice.cfg.micro_batch_size) == ("1f1b", 1)
    # What config.toml records of a --layout auto run reads back as the same settings.
    auto = resolve(REQUIRED, {"layout": "auto", "dp": 2, "pp": 2, "schedule": "zbh1", "micro_batch_size": 2,
                              "zero": "zero1"})
    (tmp_path / "config.toml").write_text(to_toml(auto) + "# layout dp2 x pp2 ...\n")
    assert resolve(read_toml(tmp_path / "config.toml"), {}) == auto


def test_the_layout_keys_given_constrain_the_search() -> None:
    auto = TrainConfig(**REQUIRED, layout="auto", global_batch=16)
    assert search_space(auto, world=4) == {
        "dp_sizes": None, "pp_sizes": None, "tp_sizes": None, "schedules": None, "microbatch_sizes": None,
        "zero": ("none", "zero1")}  # tp too: the sizes the model and the job's node take
    given = dataclasses.replace(auto, pp=4, schedule="zbv", micro_batch_size=2, zero="none")
    assert search_space(given, world=8) == {
        "dp_sizes": None, "pp_sizes": (4,), "tp_sizes": None, "schedules": ("zbv",), "microbatch_sizes": (2,),
        "zero": ("none",)}  # dp x tp = 2: dp 2, or tp 2
    assert search_space(dataclasses.replace(auto, dp=2, schedule="auto"), world=4)["schedules"] is None
    assert search_space(dataclasses.replace(auto, dp=1, tp=2), world=4)["tp_sizes"] == (2,)
    # What tp does not run with yet keeps the search at tp 1.
    assert search_space(dataclasses.replace(auto, precision="fp16"), world=4)["tp_sizes"] is None
    assert search_space(dataclasses.replace(auto, dp=2, zero="fsdp"), world=4)["tp_sizes"] == (1,)
    # In one process: one replica over --pp ranks, no tp.
    one = search_space(dataclasses.replace(auto, pp=2), world=1)
    assert (one["dp_sizes"], one["tp_sizes"]) == ((1,), (1,))


@pytest.mark.parametrize(
    ("flags", "world", "message"),
    [
        ({"layout": "auto", "plan": "p.json"}, 4, "--plan p.json and --layout auto both decide the layout"),
        ({"calibrate": "c.json"}, 4, "--calibrate c.json prices the layouts --layout auto searches"),
        ({"layout": "auto", "calibrate": "c.json", "device": "cpu"}, 4, "--calibrate c.json and --device cpu"),
        ({"zero": "fsdp2"}, 4, "zero must be one of none, zero1, fsdp, got 'fsdp2'"),
        ({"layout": "automatic"}, 4, "layout must be one of manual, auto"),
        ({"layout": "auto", "zero": "zero1"}, 1, r"--zero zero1 shards .* this job has one \(dp 1, one process\)"),
        ({"layout": "auto", "dp": 2}, 1, "--dp 2 needs 2 processes"),
        ({"layout": "auto", "pp": 3}, 4, "the job has 4 processes, which is not dp x pp"),
        ({"layout": "auto", "dp": 2, "pp": 3}, 4, "the job has 4 processes, which is not dp x pp"),
        ({"layout": "auto", "dp": 2, "pp": 2, "tp": 2}, 4, "with dp 2, pp 2, tp 2: the job has 4 processes"),
        ({"layout": "auto", "tp": 3}, 4, "which is not dp x pp x tp"),
        ({"layout": "auto", "tp": 2}, 1, "--tp 2 needs 2 processes"),
        ({"layout": "auto", "tp": 2, "zero": "fsdp"}, 4, "--zero fsdp with --tp 2: .*--zero zero1"),
    ],
)
def test_conflicting_settings_are_refused_with_the_flags_named(flags: dict[str, object], world: int,
                                                                message: str) -> None:
    with pytest.raises(TrainConfigError, match=message):
        search_space(resolve(REQUIRED, flags), world=world)


def test_the_jobs_node_is_its_processes_on_this_host(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipecut.train.layout_choice import job_nodes

    cpu, gpu = Cluster.uniform(8, "cpu"), Cluster.uniform(8, "H100-80GB")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert job_nodes(cpu, 8) is cpu and job_nodes(gpu, 8) is gpu  # no torchrun: the preset's node (8 GPUs)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun: 4 processes on each of 2 hosts
    nodes = job_nodes(gpu, 8)
    assert {d.node_size for d in nodes.devices} == {4}
    assert nodes.link_bandwidth == gpu.link_bandwidth
    assert job_nodes(gpu, 1) is gpu
    # CPU processes name no node: tp is searched there only when --tp asks (the planner's rule).
    assert job_nodes(cpu, 8) is cpu and cpu.devices[0].node_size == 0


def test_zero_by_hand_needs_replicas() -> None:
    with pytest.raises(TrainConfigError, match=r"--zero zero1 shards .* this job has one \(dp 1, pp 4\)"):
        layout(TrainConfig(**REQUIRED, zero="zero1", global_batch=8), world=4, rank=0)
    with pytest.raises(TrainConfigError, match="--zero fsdp shards"):
        layout(TrainConfig(**REQUIRED, zero="fsdp"), world=1, rank=0)
    lay = layout(TrainConfig(**REQUIRED, zero="zero1", dp=2, global_batch=8), world=4, rank=3)
    assert (lay.dp, lay.pp, lay.m, lay.dp_rank) == (2, 2, 4, 1)
    assert layout(TrainConfig(**REQUIRED, zero="none", global_batch=8), world=2, rank=0).dp == 1


def test_the_cli_refuses_before_touching_anything(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    args = ["train", "--model", "m", "--data", "d", "--out", str(out)]
    assert main([*args, "--layout", "auto", "--plan", "p.json"]) == 2
    assert "--plan p.json and --layout auto both decide the layout" in capsys.readouterr().err
    assert not out.exists()


# -- a saved plan ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(llama_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Plan:
    """The planner's layout of the tiny Llama for 4 processes and 4 sequences of 16 tokens, read back from its file."""
    folder = HFFolder(str(llama_folder))
    plan = plan_layout(folder.build(meta=True), folder.example_inputs(seq_len=16, micro_batch_size=1),
                       cluster=Cluster.uniform(4, "cpu"), global_batch=4)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(path)
    return Plan.load(path)


def _cfg(**values: object) -> TrainConfig:
    return TrainConfig(**{**REQUIRED, "plan": "plan.json", "global_batch": 4, "seq_len": 16, **values})  # type: ignore[arg-type]


def test_a_saved_plan_fills_in_its_layout(saved: Plan) -> None:
    lay = saved.layout
    assert lay is not None and lay.dp * lay.pp == 4
    cfg = resolved(_cfg(), saved, 4)
    assert (cfg.dp, cfg.pp, cfg.schedule, cfg.micro_batch_size, cfg.zero) == (
        lay.dp, lay.pp, lay.schedule, lay.microbatch_size, lay.zero)
    assert resolved(_cfg(dp=lay.dp, schedule="auto"), saved, 4) == cfg  # agreeing flags are fine
    assert layout(cfg, 4, 0).m == lay.microbatches


def test_a_saved_plan_for_another_world_or_job_is_refused_with_what_differs(saved: Plan) -> None:
    lay = saved.layout
    assert lay is not None
    world_2 = rf"runs on 4 processes \({lay.dp} replicas .* the job has 2: .* --devices 2"
    with pytest.raises(PlanWorldError, match=world_2):
        resolved(_cfg(), saved, 2)
    with pytest.raises(PlanWorldError, match="this is one process: launch it with torchrun --nproc-per-node 4"):
        resolved(_cfg(), saved, 1)
    with pytest.raises(TrainPlanError, match=rf"--dp 4 \(the plan's: {lay.dp}\)"):
        resolved(_cfg(dp=4, pp=1), saved, 4)
    with pytest.raises(TrainPlanError, match=r"--global-batch 8 \(the plan's: 4\); --seq-len 32 \(the plan's: 16\)"):
        resolved(_cfg(global_batch=8, seq_len=32), saved, 4)
    with pytest.raises(TrainPlanError, match=r"--precision bf16 \(the plan's: fp32\)"):
        resolved(_cfg(precision="bf16"), saved, 4)
    # A plain plan (pipecut plan --stages): its pipeline ranks must divide the job's processes.
    plain = dataclasses.replace(saved, layout=None, layouts=())
    with pytest.raises(PlanWorldError, match=f"a multiple of its {lay.pp} pipeline ranks, and the job has 3"):
        resolved(_cfg(), plain, 3)
    # ... times --tp's processes per rank.
    with pytest.raises(PlanWorldError, match=f"a multiple of its {lay.pp} pipeline ranks x 2 tp processes"):
        resolved(_cfg(tp=2), plain, 2 * lay.pp + 1)
    rows = 2 * plain.microbatches * (plain.microbatch_size or 1)  # 2 replicas' micro-batches
    assert resolved(_cfg(tp=2, global_batch=rows), plain, 4 * lay.pp).dp == 2


def test_a_saved_plan_with_tp_fills_in_its_tp(saved: Plan) -> None:
    lay = saved.layout
    assert lay is not None and lay.tp == 1
    # dp x pp x tp = 4, no replicas to shard over
    split = dataclasses.replace(saved, layout=dataclasses.replace(lay, dp=1, tp=lay.dp, zero="none"))
    cfg = resolved(_cfg(), split, 4)
    assert (cfg.dp, cfg.pp, cfg.tp) == (1, lay.pp, lay.dp)
    assert layout(cfg, 4, 3).tp == lay.dp
    with pytest.raises(TrainPlanError, match=rf"--tp 1 \(the plan's: {lay.dp}\)"):
        resolved(_cfg(tp=1), split, 4)
    with pytest.raises(PlanWorldError, match=rf"of {lay.dp} processes per rank \(4 processes\), and this is one"):
        resolved(_cfg(), split, 1)


def test_a_saved_plan_binds_to_its_model_and_refuses_another(saved: Plan, llama_folder: Path,
                                                               tmp_path: Path) -> None:
    from conftest import write_llama

    folder = HFFolder(str(llama_folder))
    bound = bind_plan(saved, folder, folder.config, _cfg(), source="--plan plan.json")
    assert bound.is_bound and bound.layout == saved.layout
    other = HFFolder(str(write_llama(tmp_path / "deeper", weights=False, tokenizer=False, num_hidden_layers=3)))
    with pytest.raises(PlanModelError, match=r"--plan plan.json was made for another model than m: its stages hold "
                                             r"[\d,]+ parameters, the folder's model [\d,]+"):
        bind_plan(saved, other, other.config, _cfg(), source="--plan plan.json")
