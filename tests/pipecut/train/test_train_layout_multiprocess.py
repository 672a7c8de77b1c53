"""`pipecut train --layout auto` and `--plan` as jobs of 4 gloo processes; the calibrated path on 2.

The 4-process job trains 4 sequences of 16 tokens a step on the tiny Llama, for which the planner
(``plan_layout`` on the meta model over ``Cluster.uniform(4, 'cpu')``, run here in the test process)
chooses two replicas of a 2-rank pipeline with ZeRO-1. Every rank runs three commands one after
the other: ``--layout auto`` to step 2, the same command to step 4 (it resumes the recorded layout),
and ``--plan`` with the test's own plan to step 4 uninterrupted; the same plan, the same steps, so
the same weights bit for bit. Then ``--layout auto --tp 2`` (the search kept to tp 2: dp x pp = 2
ranks, each 2 processes wide; the planner picks 2 replicas of one rank) to step 2, and ``--plan``
with the plan it recorded, in another folder: the plan's tp is applied both times, so the two runs
are the same bit for bit, and both are the 2-replica run's steps within the round-off of the
row-parallel sums.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_train import final_weights, metrics

from partitioner import Cluster, Plan, plan_layout
from pipecut.folder import HFFolder
from pipecut.train.config import read_toml
from rank_pool import Cases, spawn

pytestmark = pytest.mark.multiprocess


def _flags(folder: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(folder), "--data", str(data), "--out", str(out), "--seq-len", "16",
            "--global-batch", "4", "--warmup", "1", "--decay-steps", "4", *extra]


def _commands(rank: int, world: int, argvs: list[list[str]]) -> list[tuple[int, bool]]:
    """Each command's exit code, and whether this rank printed the run's summary line."""
    import contextlib
    import io

    from pipecut.cli import main

    done = []
    for argv in argvs:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(argv)
        done.append((code, "trained " in out.getvalue()))
    return done


@pytest.fixture(scope="module")
def planned(llama_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Plan, Path]:
    folder = HFFolder(str(llama_folder))
    plan = plan_layout(folder.build(meta=True), folder.example_inputs(seq_len=16, micro_batch_size=1),
                       cluster=Cluster.uniform(4, "cpu"), global_batch=4)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(path)
    return plan, path


def _group(rank: int, world: int, key: str, groups: dict[str, list[list[str]]]) -> list[tuple[int, bool]]:
    return _commands(rank, world, groups[key])


class _Runs:
    """The run folders, each group of commands run on 4 ranks of the pool when a test first needs it:
    ``auto`` (2 steps of --layout auto, then resumed to 4), ``saved`` (4 steps of the planner's plan
    from a file), ``split`` (--layout auto --tp 2, then --plan of the plan that run recorded)."""

    def __init__(self, root: Path, groups: dict[str, list[list[str]]]) -> None:
        self.root, self.cases = root, Cases(_group, 4, groups, timeout=400)
        self.groups = groups

    def __getitem__(self, name: str) -> Path:
        group = {"auto": "auto", "saved": "saved", "split": "split", "replayed": "split"}[name]
        got = self.cases(group)
        # Every command exits 0; only rank 0 prints (spawn sets no RANK: the process group says who leads).
        assert got == [[(0, rank == 0)] * len(self.groups[group]) for rank in range(4)], got
        return self.root / name


@pytest.fixture(scope="module")
def runs(planned: tuple[Plan, Path], llama_folder: Path, token_file: Path,
         tmp_path_factory: pytest.TempPathFactory) -> _Runs:
    root = tmp_path_factory.mktemp("runs")
    auto, saved, split, replayed = root / "auto", root / "saved", root / "split", root / "replayed"
    return _Runs(root, {
        "auto": [_flags(llama_folder, token_file, auto, "--layout", "auto", "--device", "cpu", "--steps", "2"),
                 _flags(llama_folder, token_file, auto, "--layout", "auto", "--device", "cpu", "--steps", "4")],
        "saved": [_flags(llama_folder, token_file, saved, "--plan", str(planned[1]), "--steps", "4")],
        "split": [_flags(llama_folder, token_file, split, "--layout", "auto", "--tp", "2", "--device", "cpu",
                         "--steps", "2"),
                  _flags(llama_folder, token_file, replayed, "--plan", str(split / "plan.json"), "--steps", "2")],
    })


def test_layout_auto_trains_the_planners_layout(planned: tuple[Plan, Path], runs: _Runs) -> None:
    want = planned[0].layout
    assert want is not None and want.dp > 1 and want.zero == "zero1"  # replicas and sharding exercised
    got = Plan.load(runs["auto"] / "plan.json").layout
    assert got is not None
    fields = ("dp", "pp", "schedule", "microbatch_size", "microbatches", "zero", "stages", "step_time")
    assert [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields]
    recorded = read_toml(runs["auto"] / "config.toml")
    assert {k: recorded[k] for k in ("layout", "dp", "pp", "schedule", "micro_batch_size", "zero")} == {
        "layout": "auto", "dp": want.dp, "pp": want.pp, "schedule": want.schedule,
        "micro_batch_size": want.microbatch_size, "zero": want.zero}
    text = (runs["auto"] / "config.toml").read_text()
    assert "(recorded in" in text.splitlines()[-1]  # the rerun trained the recorded layout, not a new search
    lines = metrics(runs["auto"])
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert all(m["predicted_step_s"] == pytest.approx(want.step_time) for m in lines)


def test_a_resumed_auto_run_equals_the_saved_plan_run_uninterrupted(runs: _Runs,
                                                                    planned: tuple[Plan, Path]) -> None:
    assert Plan.load(runs["saved"] / "plan.json").layout == planned[0].layout
    a, b = final_weights(runs["auto"]), final_weights(runs["saved"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [m["loss"] for m in metrics(runs["auto"])] == [m["loss"] for m in metrics(runs["saved"])]


def test_layout_auto_and_a_plan_apply_the_plans_tp(runs: _Runs) -> None:
    lay = Plan.load(runs["split"] / "plan.json").layout
    assert lay is not None and lay.tp == 2 and lay.dp * lay.pp == 2  # --tp 2 of 4 processes
    recorded = read_toml(runs["split"] / "config.toml")
    assert (recorded["dp"], recorded["pp"], recorded["tp"]) == (lay.dp, lay.pp, 2)
    assert f"layout dp{lay.dp} x pp{lay.pp} x tp2" in (runs["split"] / "config.toml").read_text()
    assert read_toml(runs["replayed"] / "config.toml")["tp"] == 2
    a, b = final_weights(runs["split"]), final_weights(runs["replayed"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The same 2 steps on the same batches as the 2 replicas of the auto run, up to the round-off of
    # the row-parallel sums (two halves, then an all-reduce).
    torch.testing.assert_close([m["loss"] for m in metrics(runs["split"])],
                               [m["loss"] for m in metrics(runs["auto"])][:2], rtol=2e-5, atol=0)


def _calibrated(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    import runtime.overheads
    from pipecut.cli import main

    real = runtime.overheads.calibrate_job
    seen: dict[str, Any] = {"calls": 0, "cluster": None}

    def recording(*args: Any, **kwargs: Any) -> Cluster:
        seen["calls"] += 1
        seen["cluster"] = real(*args, **kwargs).to_dict()  # raises CalibrationError on a noisy host
        return Cluster.from_dict(seen["cluster"])

    runtime.overheads.calibrate_job = recording  # type: ignore[assignment]
    try:
        seen["rc"] = main(argv)
    finally:
        runtime.overheads.calibrate_job = real
    return seen


@pytest.mark.skipif(torch.cuda.is_available(), reason="--device auto is a GPU preset here: nothing is calibrated")
def test_layout_auto_on_this_cpu_calibrates_on_the_jobs_ranks(llama_folder: Path, token_file: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = _flags(llama_folder, token_file, out, "--layout", "auto", "--steps", "1")
    seen = spawn(_calibrated, 2, argv, timeout=300)
    assert [s["rc"] for s in seen] == [0, 0] and [s["calls"] for s in seen] == [1, 1]
    plan = Plan.load(out / "plan.json")
    assert plan.layout is not None and plan.layout.devices == 2
    assert seen[0]["cluster"] == seen[1]["cluster"]  # one cluster, one plan on every rank
    if seen[0]["cluster"] is not None:  # fitted: the plan was priced on it
        assert plan.cluster.devices[0].name.endswith("(fitted to the model)")
        fitted = Cluster.from_dict(seen[0]["cluster"]).devices[0]
        keys = ("peak_flops_fp32", "op_overhead", "action_overhead")
        assert [getattr(plan.cluster.devices[0], k) for k in keys] == [getattr(fitted, k) for k in keys]
        assert "calibrated on the job's ranks" in (out / "config.toml").read_text()
    assert len(metrics(out)) == 1
