"""The layout benchmark's statistics on plain data (benchmarks/lib/layout_stats.py), and its --quick run end to
end on 4 gloo processes."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from types import ModuleType

import pytest

from bench_script import load_script, run_result

pytest.importorskip("transformers")  # the benchmark trains a GPT-2

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """``benchmarks/layout.py``."""
    return load_script("layout", "_bench_layout")


@pytest.fixture(scope="module")
def stats() -> ModuleType:
    """``benchmarks/lib/layout_stats.py``: the pure statistics."""
    return load_script("lib/layout_stats", "_bench_layout_stats")


def test_ranks_average_ties(stats: ModuleType) -> None:
    assert stats.ranks([3.0, 1.0, 2.0]) == [3.0, 1.0, 2.0]
    assert stats.ranks([0.3, 0.1, 0.2, 0.1]) == [4.0, 1.5, 3.0, 1.5]
    assert stats.ranks([5.0, 5.0, 5.0]) == [2.0, 2.0, 2.0]
    assert stats.ranks([]) == []


def test_spearman_on_known_inputs(stats: ModuleType) -> None:
    assert stats.spearman([1, 2, 3, 4, 5], [2, 4, 6, 8, 100]) == pytest.approx(1.0)  # monotone, not linear
    assert stats.spearman([1, 2, 3, 4, 5], [5, 4, 3, 2, 1]) == pytest.approx(-1.0)
    # 1 - 6 sum d^2 / (n (n^2 - 1)) without ties: d = (0, -2, 1, 1, 0), sum d^2 = 6.
    assert stats.spearman([1, 2, 3, 4, 5], [1, 4, 2, 3, 5]) == pytest.approx(1 - 6 * 6 / (5 * 24))
    # With ties: Pearson's r of the tie-averaged ranks (x: 1.5 1.5 3 4, y: 1 2 3 4).
    rx, ry = [1.5, 1.5, 3, 4], [1, 2, 3, 4]
    mx, my = sum(rx) / 4, sum(ry) / 4
    want = sum((a - mx) * (b - my) for a, b in zip(rx, ry)) / math.sqrt(
        sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    assert stats.spearman([1, 1, 2, 3], [10, 20, 30, 40]) == pytest.approx(want)
    assert math.isnan(stats.spearman([1, 1, 1], [1, 2, 3]))  # a constant side has no ranking
    with pytest.raises(ValueError, match="equal length"):
        stats.spearman([1, 2], [1, 2, 3])


def test_spearman_matches_scipy_with_ties(stats: ModuleType) -> None:
    scipy_stats = pytest.importorskip("scipy.stats")
    x = [0.1, 0.4, 0.4, 0.2, 0.9, 0.9, 0.9, 0.3]
    y = [1.0, 3.0, 2.0, 2.0, 5.0, 4.0, 6.0, 0.5]
    assert stats.spearman(x, y) == pytest.approx(float(scipy_stats.spearmanr(x, y).statistic))


def test_median_abs_error_and_targets(stats: ModuleType) -> None:
    assert stats.median_abs_error([1.1, 0.8, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0]) == pytest.approx(0.15)
    predicted = {"a": 0.10, "b": 0.20, "c": 0.30, "d": 0.40}
    measured = {"a": 0.105, "b": 0.10, "c": 0.33, "d": 0.44}
    t = stats.targets(predicted, measured, "a")
    assert t["measured_best"] == "b" and t["choice_measured_rank"] == 2 and t["layouts"] == 4
    assert t["choice_vs_best"] == pytest.approx(0.05) and t["choice_within_10pct"]
    # |pred/meas - 1|: 0.0476, 1.0, 0.0909, 0.0909 -> median 0.0909
    assert t["median_abs_error"] == pytest.approx(1 / 11) and t["median_abs_error_ok"]
    assert t["spearman"] == pytest.approx(0.8) and t["spearman_ok"]  # ranks 1234 vs 2134
    assert not stats.targets(predicted, measured, "d")["choice_within_10pct"]
    with pytest.raises(ValueError, match="same layouts"):
        stats.targets(predicted, {"a": 1.0}, "a")


def test_the_planner_prices_and_chooses_among_the_benchmarks_layouts(bench: ModuleType) -> None:
    from partitioner import Cluster, LayoutSearch

    cfg = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab": 64, "seq": 8, "batch": 8}
    model = bench._model(cfg)
    x, _ = bench._data(cfg)
    search = LayoutSearch(model, (x[:1],), cluster=Cluster.uniform(4, "cpu"), global_batch=8)
    space = bench.layouts(4, 8, [1, 2], ["1f1b", "zbh1"], tp_sizes=[1, 2])
    assert {lay.tp for lay in space} == {1, 2}
    predicted = {}
    for lay in space:
        plan = bench.layout_plan(search, lay)
        assert plan.model is not model  # every layout trains its own copy
        predicted[lay.name] = bench.predicted_step_time(plan, lay)
        assert plan.microbatches == lay.microbatches and plan.num_stages == lay.stages
        assert plan.layout is not None and plan.layout.tp == lay.tp
    choice = bench.planner_choice(search, space)  # over tp 1 and 2: the space's sizes, given explicitly
    assert choice in predicted
    assert predicted[choice] <= min(predicted.values()) * 1.01  # the fastest, up to the planner's 1% ties
    tp2 = [lay for lay in space if lay.tp == 2]
    assert bench.planner_choice(search, tp2) in {lay.name for lay in tp2}  # a space of tp 2 alone chooses tp 2


def test_layouts_cover_every_divisible_layout(bench: ModuleType) -> None:
    got = bench.layouts(4, 8, [1, 2, 4], ["1f1b", "interleaved"])
    names = {lay.name for lay in got}
    assert len(names) == len(got)
    for lay in got:
        assert lay.dp * lay.pp == 4 and lay.dp * lay.microbatch_size * lay.microbatches == 8
        assert lay.pp > 1 or lay.schedule == "1f1b"  # one rank: one schedule
        assert lay.dp > 1 or lay.zero == "none"
    # dp 1: 2 schedules x 3 b; dp 2: 2 x 3 x 2 zero; dp 4: b 1, 2 (b 4 leaves half a micro-batch) x 2 zero
    assert len(got) == 6 + 12 + 4
    assert bench.Layout(1, 4, "zbv", 2, 4).stages == 8 and bench.Layout(2, 2, "zbh1", 2, 2).stages == 2
    # With tp 2 besides: dp x pp = 2 ranks of 2 processes; dp 1 pp 2: 2 x 3 b; dp 2 pp 1: 3 b x 2 zero.
    both = bench.layouts(4, 8, [1, 2, 4], ["1f1b", "interleaved"], tp_sizes=[1, 2])
    assert [lay for lay in both if lay.tp == 1] == got
    tp2 = [lay for lay in both if lay.tp == 2]
    assert len(tp2) == 6 + 6 and all(lay.dp * lay.pp == 2 for lay in tp2)
    assert {lay.name for lay in tp2 if lay.dp == 2} >= {"dp2 pp1 tp2 1f1b b2 m2 none", "dp2 pp1 tp2 1f1b b2 m2 zero1"}


# The layouts --quick runs (a global batch of 8), and those of a batch of 4: a pipeline of 4 ranks,
# and 2 replicas of 2 ranks with and without ZeRO-1.
QUICK_LAYOUTS = {"dp1 pp4 1f1b b2 m4 none", "dp2 pp2 1f1b b2 m2 none", "dp2 pp2 1f1b b2 m2 zero1",
                 "dp4 pp1 1f1b b2 m1 none", "dp4 pp1 1f1b b2 m1 zero1"}
BATCH_4_LAYOUTS = {"dp1 pp4 1f1b b2 m2 none", "dp2 pp2 1f1b b2 m1 none", "dp2 pp2 1f1b b2 m1 zero1"}
# --tp 1,2 besides: each pipeline rank 2 processes wide (a 2-rank pipeline, or 2 replicas of one rank).
BATCH_4_TP_LAYOUTS = BATCH_4_LAYOUTS | {"dp1 pp2 tp2 1f1b b2 m2 none", "dp2 pp1 tp2 1f1b b2 m1 none",
                                        "dp2 pp1 tp2 1f1b b2 m1 zero1"}


# The default profile runs the script's default path (priced on the 'cpu' preset) on 6 layouts, 3
# of them tensor-parallel (--tp 1,2: the tp trainers, their loss check and the planner's choice over tp);
# `pipecut calibrate --model` (most of a calibrated run's time) is run by tests/pipecut/
# test_calibrate_cli.py and the in-benchmark fit by `pipecut train --layout auto`'s test. The long
# profile runs --quick's 5 layouts priced on the command line's calibration with the in-benchmark
# fit beside it on the same measured steps: one run covers both predictors.
@pytest.mark.multiprocess
@pytest.mark.parametrize(("flags", "want"), [
    (["--batch", "4", "--tp", "1,2"], BATCH_4_TP_LAYOUTS),
    pytest.param(["--cli-calibrate"], QUICK_LAYOUTS, marks=[pytest.mark.long, pytest.mark.slow]),
], ids=["batch-4-tp-preset", "quick-cli-calibrate"])
def test_layout_quick(bench: ModuleType, stats: ModuleType, tmp_path: Path, flags: list[str], want: set[str]) -> None:
    # A subprocess, as users run it: its spawned ranks re-import the script as __main__.
    out = tmp_path / "layout.json"
    argv = ["--quick", *flags, "--timeout", "400", "--out", str(out)]
    calibrated = "--cli-calibrate" in flags
    data = run_result("layout", argv, out, timeout=900)
    rows = data["layouts"]
    assert {r["name"] for r in rows} == want
    for r in rows:
        assert r["measured_s"] > 0 and r["predicted_s"] > 0 and r["n"] == 2 and r["tokens_per_s"] > 0
        assert r["pred_over_meas"] == pytest.approx(r["predicted_s"] / r["measured_s"])
        assert len(data["times_ms"][r["name"]]) == 2
    # The summary is the statistics of the rows it prints.
    s = data["summary"]
    pred = [r["predicted_s"] for r in rows]
    meas = [r["measured_s"] for r in rows]
    assert s["layouts"] == len(rows) and s["predictor"]
    assert s["median_abs_error"] == pytest.approx(statistics.median(abs(p / m - 1) for p, m in zip(pred, meas)))
    by_measured = sorted(rows, key=lambda r: r["measured_s"])
    assert s["measured_best"] == by_measured[0]["name"]
    fastest = min(r["predicted_s"] for r in rows)  # the planner's choice: the fastest, up to its 1% ties
    assert s["choice"] in {r["name"] for r in rows if r["predicted_s"] <= fastest * 1.01}
    assert s["choice_measured_rank"] == [r["name"] for r in by_measured].index(s["choice"]) + 1
    assert [r["rank_measured"] for r in by_measured] == list(range(1, len(want) + 1))
    assert [r["rank_predicted"] for r in rows] == stats.ranks(pred)
    if "--tp" in flags:  # each tp size's rows on their own
        by_tp = s["by_tp"]
        assert set(by_tp) == {"tp1", "tp2"} and by_tp["tp2"]["layouts"] == 3 and data["config"]["tp_sizes"] == [1, 2]
        tp2 = {r["name"]: r for r in rows if r["tp"] == 2}
        assert by_tp["tp2"]["measured_best"] == min(tp2, key=lambda n: tp2[n]["measured_s"])
        assert by_tp["tp2"]["median_abs_error"] == pytest.approx(
            stats.median_abs_error([r["predicted_s"] for r in tp2.values()], [r["measured_s"] for r in tp2.values()]))
    else:
        assert "by_tp" not in s
    if calibrated:
        fitted_to = data["cli_calibration"]["fitted_to"]
        assert fitted_to["model"] == "benchmarks/layout_model.py:model_quick" and fitted_to["devices"] == 4
        assert data["config"]["cluster"] == str(out.with_suffix(".cluster.json"))
        cluster = json.loads(out.with_suffix(".cluster.json").read_text())["cluster"]
        assert cluster["devices"][0]["name"] == "cpu (measured) (fitted to the model)"
        assert {"choice", "median_abs_error", "spearman"} <= data["summary"]["in_benchmark_fit"].keys()
        assert all(r["predicted_in_benchmark_fit_s"] > 0 for r in rows)
    else:  # priced on the preset, nothing fitted beside it
        assert data["config"]["cluster"] == "Cluster.uniform(4, 'cpu')" and data["cli_calibration"] is None
        assert "in_benchmark_fit" not in s and not out.with_suffix(".cluster.json").exists()
    rho = stats.spearman(pred, meas)
    assert s["spearman"] is None if math.isnan(rho) else s["spearman"] == pytest.approx(rho)
    # Every layout's first step trained the plain model on the global batch.
    check = data["check"]
    assert set(check["first_step_loss"]) == {r["name"] for r in rows}
    for loss in check["first_step_loss"].values():
        assert loss == pytest.approx(check["reference_loss"], rel=1e-4)


def test_the_benchmarks_gpt2_is_a_command_line_factory(bench: ModuleType) -> None:
    """``pipecut calibrate --model benchmarks/layout_model.py:model_quick`` fits the model the benchmark runs."""
    import torch

    import layout_model

    quick = {**layout_model.CONFIGS["model_quick"], "batch": 8}
    model, (ids,) = layout_model.model_quick()
    assert layout_model.factory_for(quick) == "model_quick" and layout_model.factory_for({**quick, "seq": 8}) is None
    assert ids.shape == (1, quick["seq"])
    mine, theirs = bench._model(quick).state_dict(), model.state_dict()
    assert mine.keys() == theirs.keys()
    for k in mine:
        torch.testing.assert_close(mine[k], theirs[k])
