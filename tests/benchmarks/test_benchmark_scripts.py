"""The partitioning benchmarks run end to end on tiny configurations and write what they promise."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from bench_script import load_script, read_result

pytest.importorskip("transformers")  # both scripts plan a GPT-2

ROOT = Path(__file__).resolve().parents[2]
MODELS_QUICK = ("mlp", "gpt2", "resnet", "unet")  # partition_quality.py --quick's models, in its order


@pytest.fixture(scope="module")
def quality() -> ModuleType:
    return load_script("partition_quality")


@pytest.fixture(scope="module")
def scale() -> ModuleType:
    return load_script("plan_scale")


# The script's path is the same for every model (trace and cost once, cut per stage count, one
# partition() call): the default profile runs it on the tiny MLP chain and the tiny U-Net (whose
# skips cross every boundary), the long one on --quick's four models (GPT-2's trace, twice, is
# most of that run's time).
@pytest.mark.parametrize("models", [["mlp", "unet"], pytest.param(list(MODELS_QUICK), marks=pytest.mark.long)],
                         ids=["mlp-unet", "quick"])
def test_partition_quality_quick(quality: ModuleType, tmp_path: Path, models: list[str]) -> None:
    out = tmp_path / "pq.json"
    chosen = ["--models", ",".join(models)] if models != list(MODELS_QUICK) else []
    argv = ["--quick", *chosen, "--stages", "2,4", "--repeat", "1", "--out", str(out)]
    assert quality.main(argv) == 0
    data = read_result("partition_quality", argv, out)
    assert {"config", "env", "models", "results", "checks"} <= data.keys()
    assert data["config"]["stages"] == [2, 4]
    assert [m["model"] for m in data["models"]] == models
    for info in data["models"]:
        assert {"trace_s", "cost_s", "partition_call_s", "nodes", "units", "params"} <= info.keys()
        assert info["partition_call_stages"] == 2
    rows = data["results"]
    assert len(rows) == len(models) * 2 * len(quality.METHODS)
    for r in rows:
        assert {"bottleneck_s", "lower_bound_s", "ratio_to_lower_bound", "ratio_to_exact", "bytes_cut",
                "planning_s", "fits_memory", "splits"} <= r.keys()
        assert r["bottleneck_s"] >= r["lower_bound_s"] * (1 - 1e-9)
        assert len(r["boundary_bytes"]) == r["stages"] - 1
        assert math.isclose(r["bytes_cut"], sum(r["boundary_bytes"]))
    by = {(r["model"], r["stages"], r["method"]): r for r in rows}
    for model, p, method in by:
        exact = by[(model, p, "exact")]["bottleneck_s"]
        assert by[(model, p, "exact+refine")]["bottleneck_s"] <= exact * (1 + 1e-9)
        if method in quality.BASELINES and by[(model, p, method)]["fits_memory"]:
            assert exact <= by[(model, p, method)]["bottleneck_s"] * (1 + 1e-9), (model, p, method)
    for info in data["models"]:  # partition() keeps the better of exact and exact+refine
        p0 = info["partition_call_stages"]
        best = min(by[(info["model"], p0, m)]["bottleneck_s"] for m in ("exact", "exact+refine"))
        assert math.isclose(info["partition_call_bottleneck_s"], best, rel_tol=1e-9)


def test_partition_quality_raises_when_exact_loses(quality: ModuleType) -> None:
    def row(method: str, bottleneck: float) -> dict[str, object]:
        return {"model": "m", "stages": 2, "method": method, "bottleneck_s": bottleneck, "fits_memory": True}

    results = {m: row(m, 2.0) for m in quality.METHODS}
    quality._check_and_relate(results)  # ties are fine
    assert results["equal_size"]["ratio_to_exact"] == 1.0
    results["equal_count"] = row("equal_count", 1.0)
    with pytest.raises(AssertionError, match="worse than equal_count"):
        quality._check_and_relate(results)
    results["equal_count"]["fits_memory"] = False  # a plan that does not fit proves nothing
    quality._check_and_relate(results)


# --quick's 2-layer toy in the default profile (a GPT-2's trace, run twice, is the time: it grows
# with the layers); 4 layers, as many blocks as devices, in the long one.
@pytest.mark.parametrize("n_layer", [2, pytest.param(4, marks=pytest.mark.long)], ids=["quick", "4-layers"])
def test_plan_scale_small_gpt2(scale: ModuleType, tmp_path: Path, n_layer: int) -> None:
    out = tmp_path / "ps.json"
    argv = ["--quick", *(["--n-layer", str(n_layer)] if n_layer != 2 else []), "--out", str(out)]
    assert scale.main(argv) == 0
    data = read_result("plan_scale", argv, out)
    cfg = data["config"]
    assert (cfg["n_layer"], cfg["n_embd"], cfg["devices"], cfg["microbatches"]) == (n_layer, 256, 4, 4)
    assert {"build_s", "trace_s", "cost_s", "partition_call_s", "script_s"} <= data["times_s"].keys()
    assert data["rss_gib"]["peak_gib"] > 0
    assert set(data["cuts"]) == {"node", "module"}
    for cut in data["cuts"].values():
        assert cut["fits"] and len(cut["memory_gib"]) == 4
        parts = ("build_graph_s", "group_units_s", "to_problem_s", "exact_s", "refine_s")
        assert math.isclose(cut["partition_step_s"], sum(cut[k] for k in parts))
        assert cut["bottleneck_s"] >= cut["lower_bound_s"] * (1 - 1e-9)
    # The module cut is a node cut too, so the node cut is never worse.
    assert data["cuts"]["node"]["bottleneck_s"] <= data["cuts"]["module"]["bottleneck_s"] * (1 + 1e-9)
    call = data["partition_call"]
    assert call["error"] is None and len(call["stages"]) == 4
    assert math.isclose(call["bottleneck_s"], data["cuts"]["node"]["bottleneck_s"], rel_tol=1e-9)
    assert [r["microbatches"] for r in data["sweep"]] == [2, 4, 8]
    targets = {"partition_call_s", "peak_rss_gib", "partition_step_s[node]", "partition_step_s[module]"}
    assert targets == set(data["targets"])
    assert data["memory_model"]["inflight_per_stage"] == [4, 3, 2, 1]


# One family runs the script's path (plan, one step of each schedule against the plain model); a
# decoder and an encoder side by side in the long profile. tests/test_families.py checks every
# family's gradients (bert's among them) in the default profile.
@pytest.mark.parametrize("names", [["gpt_neox"], pytest.param(["gpt_neox", "bert"], marks=pytest.mark.long)],
                         ids=["gpt_neox", "gpt_neox-bert"])
def test_model_families_quick(tmp_path: Path, names: list[str]) -> None:
    families = load_script("model_families")
    out = tmp_path / "mf.json"
    assert families.main(["--families", ",".join(names), "--stages", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["benchmark"] == "model_families"
    rows = data["results"]
    assert [(r["family"], r["stages"]) for r in rows] == [(n, 2) for n in names]
    for r in rows:
        assert r["ok"] and r["grad_mode_kept"] and r["ratio"] >= 1.0
        assert all(r[s]["ok"] and r[s]["grad_rel_diff"] < 1e-4 for s in families.SCHEDULES)


@pytest.mark.multiprocess
def test_sync_vs_ps_quick(tmp_path: Path) -> None:
    # A subprocess: the spawned ranks must import the script's worker by its module name.
    out = tmp_path / "svp.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sync_vs_ps.py"), "--quick", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [r["world"] for r in data["measured"]] == [2] and data["measured"][0]["all_reduce_s"] > 0
    one = {(m["n"], m["servers"]): m["ratio"] for m in data["model"]}
    assert one[(64, 1)] == pytest.approx(64.0) and one[(64, 64)] == pytest.approx(64 / 63)


def _check_cuda_memory(data: dict[str, Any], argv: list[str], *, measured: bool) -> None:
    meta, rows = data["meta"], data["results"]
    assert meta["benchmark"] == "cuda_memory"
    assert meta["command"] == "python benchmarks/cuda_memory.py " + " ".join(argv)
    assert {"device", "device_name", "torch", "transformers", "cuda", "wall_s"} <= meta.keys()
    cfg = data["config"]
    want = [(m, p, s, prec) for m in cfg["models"] for p in cfg["stages"] for s in cfg["schedules"]
            for prec in cfg["precisions"]]
    assert [(r["model"], r["stages"], r["schedule"], r["precision"]) for r in rows] == want and rows
    for r in rows:
        pred, ms = r["predicted"], r["measured"]
        assert len(pred["stages"]) == r["stages"] and r["losses_finite"]
        assert r["compared"] == ("per rank" if r["stages"] == 1 else "device peak vs sum of 2 stages")
        # No recomputation: each stage's estimate is its state plus its activations x micro-batches in flight.
        assert math.isclose(pred["memory_bytes"], pred["state_bytes"] + pred["act_bytes"], rel_tol=1e-9)
        assert math.isclose(pred["memory_bytes"], sum(s["memory_bytes"] for s in pred["stages"]), rel_tol=1e-9)
        want = [2, 2] if r["schedule"] == "gpipe" else [2, 1]  # m = 2: GPipe holds m, 1F1B p - s
        assert [s["inflight"] for s in pred["stages"]] == want[2 - r["stages"]:] and not any(
            s["recompute"] for s in pred["stages"])
        assert r["trainer_params"] == sum(s["params"] for s in pred["stages"])
        keys = ("after_build_bytes", "at_rest_bytes", "peak_bytes", "peak_reserved_bytes")
        if measured:
            assert 0 < ms["after_build_bytes"] < ms["at_rest_bytes"] <= ms["peak_bytes"]
            assert r["peak_over_predicted"] == ms["peak_bytes"] / pred["memory_bytes"]
        else:
            assert all(ms[k] is None for k in keys) and r["peak_over_predicted"] is None


# Without a GPU the script runs its code paths and predictions only: in the default profile on
# configurations that hold every value of each axis (GPT-2, which a plan takes seconds to trace,
# once: its embedding tied across 2 stages), the whole --quick matrix in the long profile.
@pytest.mark.parametrize("axes", [
    ["--models", "gpt2", "--stages", "2", "--schedules", "1f1b", "--precisions", "bf16"],
    ["--models", "mlp", "--stages", "1,2", "--schedules", "gpipe,1f1b", "--precisions", "fp32"],
    pytest.param([], marks=[pytest.mark.long, pytest.mark.slow]),
], ids=["gpt2-p2-1f1b-bf16", "mlp-fp32", "quick"])
def test_cuda_memory_quick_on_cpu(tmp_path: Path, axes: list[str]) -> None:
    cm = load_script("cuda_memory")
    out = tmp_path / "cm.json"
    argv = ["--quick", "--device", "cpu", *axes, "--out", str(out)]
    assert cm.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["device_name"] == "cpu" and data["config"]["quick"]
    if not axes:
        assert (data["config"]["stages"], data["config"]["precisions"]) == ([1, 2], ["fp32", "bf16"])
    _check_cuda_memory(data, argv, measured=False)


def test_cuda_memory_refuses_an_unknown_axis_value(capsys: pytest.CaptureFixture[str]) -> None:
    assert load_script("cuda_memory").main(["--quick", "--device", "cpu", "--stages", "1,3"]) == 2
    assert "--stages '1,3': choose from 1, 2" in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_memory_quick_on_cuda(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cm = load_script("cuda_memory")
    out = tmp_path / "cm.json"
    argv = ["--quick", "--out", str(out)]
    assert cm.main(argv) == 0
    _check_cuda_memory(json.loads(out.read_text()), argv, measured=True)


def test_cuda_memory_refuses_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    assert load_script("cuda_memory").main(["--quick", "--out", "/nonexistent/cm.json"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_cuda_reserve_refuses_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    assert load_script("cuda_reserve").main(["--quick", "--out", "/nonexistent/cr.json"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_reserve_quick_on_cuda(tmp_path: Path) -> None:
    # The readings are the driver's; the default reserve of this GPU's preset must cover them.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = tmp_path / "cr.json"
    assert load_script("cuda_reserve").main(["--quick", "--out", str(out)]) == 0
    got = json.loads(out.read_text())["results"]
    assert got["context_bytes"] > 0 and got["allocator_slack_bytes"] >= 0
    assert got["needed_reserve_bytes"] < got["capacity_bytes"] / 4
