"""benchmarks/memory.py's smoke runs: each rank's peak against the plan's estimate, and under each
data-parallel engine (--engines), on the smallest models that run each path (a module of its own:
its spawns are the heaviest of the benchmarks' smoke runs, and the suite's workers share modules)."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import pytest

from bench_script import load_script, run_script


# The default run: 4 layers of 512 (a MiB each, one per 1 MiB shard), where fresh processes'
# start-up is the time; the long profile's, 4 layers of 4096 (64 MiB each), where a rank's peak is
# its stages and not an idle process, so it also stays under the whole model's.
@pytest.mark.multiprocess
@pytest.mark.parametrize(("width", "shard_mib"), [(512, 1), pytest.param(4096, 64, marks=pytest.mark.long)],
                         ids=["width-512", "width-4096"])
def test_memory_quick(tmp_path: Path, width: int, shard_mib: int) -> None:
    # A subprocess, as users run it: its spawned processes re-import the script as __main__.
    out = tmp_path / "memory.json"
    argv = ["--ranks", "2", "--layers", "4", "--width", str(width), "--shard-mib", str(shard_mib),
            "--tmpdir", str(tmp_path), "--out", str(out)]
    run = run_script("memory", argv, timeout=600)
    # A model this small misses the size targets (an idle process outweighs it): 1 is a verdict, not a crash.
    assert run.returncode in (0, 1), run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["benchmark"] == "memory"
    assert data["meta"]["command"] == "python benchmarks/memory.py " + " ".join(argv)
    keys = {"config", "model", "plan", "checkpoint", "whole_model", "ranks", "summary", "checks", "phases_s"}
    assert keys <= data.keys()
    assert [r["rank"] for r in data["ranks"]] == [0, 1] and len(data["plan"]) == 2
    assert data["checkpoint"]["files"] == 4  # one layer per shard: the writer never held the model
    assert data["checkpoint"]["peak_rss_bytes"] < data["whole_model"]["measured_peak_bytes"]
    for name in ("loaded_values_match", "only_own_stages_allocated", "loss_finite"):
        assert data["checks"][name]["met"], name
    for r in data["ranks"]:
        assert r["param_bytes"] == data["model"]["bytes"] // 2 == r["grad_bytes"]
        assert r["estimate"]["memory_bytes"] > 0 and r["times_s"]["load"] > 0 and r["times_s"]["step"] > 0
        assert r["peak_bytes"] == r["rss"]["after_step"]["VmHWM"] >= r["rss"]["after_load"]["VmHWM"]
        assert r["whole_model_rank_bytes"] > 0
        if width >= 4096:  # at 512 a rank's 2 MiB of stages weigh less than what its process group adds
            assert r["peak_bytes"] < r["whole_model_rank_bytes"]
    assert not list(tmp_path.glob("pipecut-memory-*")), "the checkpoint was not removed"


# --engines --quick spawns 4 fresh processes per engine, each rank tracing the tiny GPT-2 to plan
# it (most of a spawn's time: one spawn is the smallest run of this path). The default profile runs
# two engines, each in a test of its own: FSDP, the engine the benchmark is about (its sharded
# state, the whole gradient before its reduce-scatter, the gathered units it is priced with), and
# tensor parallelism at the same pp (tp 2: 1 dp x 2 pp x 2 tp); each is checked against its own
# whole parameter count. Replicate (what the others are compared with) runs beside them in the long
# profile, as does --quick's three engines (ZeRO-1's sharded optimizer state: also checked by
# tests/runtime/parallel/test_data_parallel.py).
@pytest.mark.multiprocess
@pytest.mark.parametrize("only", [
    ["--only", "fsdp"],
    ["--only", "tp 2"],
    pytest.param(["--only", "replicate;fsdp;tp 2"], marks=pytest.mark.long),
    pytest.param([], marks=pytest.mark.long),
], ids=["fsdp", "tp", "replicate-fsdp-tp", "quick"])
def test_memory_engines_quick(tmp_path: Path, only: list[str]) -> None:
    # --engines: each rank's peak under each data-parallel engine on 2 dp x 2 pp (a tiny GPT-2).
    out = tmp_path / "memory_fsdp.json"
    argv = ["--engines", "--quick", *only, "--mmap-threshold", "131072", "--out", str(out)]
    run = run_script("memory", argv, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["benchmark"] == "memory_engines"
    assert data["meta"]["command"] == shlex.join(["python", "benchmarks/memory.py", *argv])  # --only's ; quoted
    ranks = data["ranks"]
    engines = only[1].split(";") if only else ["replicate", "replicate + ZeRO-1", "fsdp"]  # --quick: 3
    assert list(ranks) == engines
    assert data["config"]["malloc_mmap_threshold"] == data["meta"]["env"]["MALLOC_MMAP_THRESHOLD_"] == "131072"
    whole = ranks.get("replicate")
    tp = ranks.pop("tp 2", None)
    if tp is not None:  # 1 dp x 2 pp x 2 tp: ranks 0, 1 run stage 0 and 2, 3 stage 1, each holding its shards
        assert data["config"]["engines"]["tp 2"] == {"data_parallel": {}, "plan_cut_for": "none", "priced_as": "none",
                                                     "dp": 1, "pp": 2, "tp": 2}
        assert [(r["stages"], r["tp_rank"]) for r in tp] == [([0], 0), ([0], 1), ([1], 0), ([1], 1)]
        for r in tp:
            assert r["predicted_bytes"] > 0 and r["peak_bytes"] > 0 and len(set(r["losses"])) > 1
            assert 0 < r["tensor_live_at_step_start_bytes"] < r["tensor_peak_bytes"]
            # Sharded weights: a rank holds less than its stage whole (its params are DTensors of the whole shapes).
            assert r["param_bytes"] < 4 * r["param_numel_whole"] and r["optimizer_bytes"] == 2 * r["param_bytes"]
        assert tp[0]["losses"] == tp[1]["losses"] and tp[0]["param_bytes"] == tp[1]["param_bytes"]
        assert "median_step_s" in data["summary"]["tp 2"]
    for name, rows in ranks.items():
        assert [r["rank"] for r in rows] == [0, 1, 2, 3], name
        assert sorted(s for r in rows for s in r["stages"]) == [0, 0, 1, 1], name  # 2 dp x 2 pp
        for r in rows:
            assert r["peak_bytes"] > 0 and r["predicted_bytes"] > 0 and len(set(r["losses"])) > 1
            assert all(math.isfinite(v) for v in r["losses"])
            assert r["malloc_mmap_threshold"] == "131072", name  # the spawned ranks inherited it
            # Tensors: the state live as a step starts, then what the step allocates above it.
            assert 0 < r["tensor_live_at_step_start_bytes"] < r["tensor_peak_bytes"], name
            assert 0 < r["tensor_after_build_bytes"] <= r["tensor_build_peak_bytes"], name
            assert r["tensor_peak_bytes"] == max(st["peak"] for st in r["tensor_steps"]), name
            assert r["tensor_live_at_peak"] and r["tensor_live_at_peak"][0]["bytes"] > 0, name
            # FSDP's gathered units are reserved on every rank beside its stage's memory; nothing otherwise.
            assert (r["predicted_gathered_bytes"] > 0) == (name == "fsdp"), name
            whole_bytes = 4 * r["param_numel_whole"]  # fp32: the stage's weights whole
            if name.startswith("fsdp"):  # the shards at rest: half of each stage's weights (no padding here)
                assert r["param_bytes"] * 2 == whole_bytes == r["whole_grad_bytes_before_reduce"], name
                assert r["optimizer_bytes"] == 2 * r["param_bytes"], name  # AdamW's two moments, sharded
            else:
                assert r["param_bytes"] == whole_bytes and r["whole_grad_bytes_before_reduce"] is None, name
                if name == "replicate":
                    assert r["optimizer_bytes"] == 2 * r["param_bytes"], name
    for name, rows in ranks.items():  # beside replicate, when it ran: the same stages, the same model
        for r, w in zip(rows, whole or []):
            assert r["stages"] == w["stages"] and r["param_numel_whole"] == w["param_numel_whole"], name
    for r, w in zip(ranks.get("replicate + ZeRO-1", []), whole or []):
        assert r["optimizer_bytes"] < w["optimizer_bytes"] == 2 * w["param_bytes"]  # AdamW's two moments
    # No engine keeps a whole copy of its weights beside its own (FSDP's shards included).
    assert all(r["stray_param_bytes"] == 0 for rows in ranks.values() for r in rows)
    s = data["summary"]
    for name in ranks:
        assert {"max_peak_bytes", "max_predicted_bytes", "measured_over_predicted", "max_tensor_peak_bytes",
                "tensor_peak_over_predicted", "median_step_s"} <= s[name].keys(), name
        assert ("param_bytes_vs_replicate" in s[name]) == (whole is not None), name
    if whole is not None and "fsdp" in ranks:
        assert s["fsdp"]["param_bytes_vs_replicate"] == [0.5] * 4


def test_memory_engines_only_refuses_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    memory = load_script("memory")
    assert memory.main(["--engines", "--only", "fsdp;no such engine"]) == 2  # before anything is spawned
    assert "no such engine" in capsys.readouterr().err
