"""`pipecut calibrate` and `pipecut plan --calibrate FILE`: measure, fit to a model, save, reuse, and clear errors."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from partitioner import Plan
from partitioner.cost import calibrate
from partitioner.cost.calibrate import Calibration
from partitioner.cost.devices import Cluster
from partitioner.cost.probes import ComputeSpeed, LinearFit, Probe
from partitioner.search import with_fit
from partitioner.zoo import load_model
from pipecut.cli import main
from runtime import calibration
from runtime.calibration import FITTED_TO, ModelFit
from runtime.overheads import with_action_overhead

TINY_LM = f"{Path(__file__).with_name('tiny_lm.py')}:build"


def _fake(devices: int) -> Calibration:
    speed = ComputeSpeed({"float32": 8e10, "bfloat16": 4e10}, LinearFit(0.0, 2e10), 5e-6)
    return Calibration(devices, devices, "gloo", speed, LinearFit(1e-4, 2e9), LinearFit(3e-5, 1e9), wall_s=0.1)


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replace the measurement (spawning processes is tested in tests/partitioner/cost) by a fixed
    one; the list records each call's arguments."""
    calls: list[dict[str, Any]] = []

    def fake_measure(devices: int, **kwargs: Any) -> Calibration:
        calls.append({"devices": devices, **kwargs})
        return _fake(devices)

    monkeypatch.setattr(calibrate, "measure", fake_measure)
    return calls


def _fitted(host: Cluster, model: str = "mlp", *, action: float = 1e-3, parameters: int = 10) -> ModelFit:
    cluster = replace(with_action_overhead(with_fit(host, 0.5, 3e-5), action), cores=2)
    return ModelFit(cluster, model, model, len(host), 4, calibration.OUTPUT_LOSS, parameters, 0.1)


@pytest.fixture
def fitted(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replace the fit to the model (spawning processes is tested below, once) by a fixed one."""
    calls: list[dict[str, Any]] = []

    def fake_fit(build: Any, host: Cluster, **kwargs: Any) -> ModelFit:
        calls.append({"devices": len(host), "build": build, **kwargs})
        return _fitted(host, kwargs["model"], parameters=sum(p.numel() for p in build()[0].parameters()))

    monkeypatch.setattr(calibration, "fit_model", fake_fit)
    return calls


def test_calibrate_prints_a_table_and_writes_a_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], measured: list[dict[str, Any]]
) -> None:
    out = tmp_path / "cluster.json"
    assert main(["calibrate", "--devices", "3", "--quick", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "matmul fp32" in text and "80.0 GFLOP/s" in text and "all-reduce bus bandwidth" in text
    assert f"cluster written to {out}" in text
    assert Cluster.load(out) == Cluster.from_calibration(_fake(3))
    assert json.loads(out.read_text())["details"]["devices"] == 3
    assert measured[0]["devices"] == 3 and measured[0]["probe"] == Probe.tiny()


def test_calibrate_with_a_model_measures_its_gemms_then_fits_the_host_to_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], measured: list[dict[str, Any]], fitted: list[dict[str, Any]]
) -> None:
    out = tmp_path / "c.json"
    args = ["calibrate", "--devices", "2", "--model", "mlp", "--global-batch", "8", "--out", str(out)]
    assert main(args) == 0
    probe = measured[0]["probe"]
    assert probe.gemms != Probe().gemms and all(count >= 1 for _, count in probe.gemms)
    # The fit starts from the measured host (its links and all-reduce), for the job's global batch.
    assert fitted[0]["devices"] == 2 and fitted[0]["global_batch"] == 8 and fitted[0]["repeat"] == 7
    assert Cluster.load(out) == _fitted(Cluster.from_calibration(_fake(2))).cluster
    details = json.loads(out.read_text())["details"]
    assert details[FITTED_TO]["model"] == "mlp" and details[FITTED_TO]["action_overhead"] == 1e-3
    assert details["flops"] == {"float32": 8e10, "bfloat16": 4e10}  # the host's raw numbers are kept too
    text = capsys.readouterr().out
    assert "fitted to mlp" in text and "action overhead" in text and "1.00 ms" in text


def test_plan_with_a_missing_file_fits_saves_and_plans(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], measured: list[dict[str, Any]], fitted: list[dict[str, Any]]
) -> None:
    cfile, pfile = tmp_path / "cluster.json", tmp_path / "plan.json"
    assert main(["plan", "mlp", "--stages", "2", "--calibrate", str(cfile), "--json", str(pfile)]) == 0
    assert "2 stages on 2 x cpu (measured) (fitted to the model)" in capsys.readouterr().out
    assert len(measured) == 1 and measured[0]["devices"] == 2 and fitted[0]["model"] == "mlp"
    assert Plan.load(pfile).cluster == Cluster.load(cfile)
    # The second plan reuses the file: nothing is measured again, and it was fitted on this job.
    assert main(["plan", "mlp", "--stages", "2", "--calibrate", str(cfile)]) == 0
    out, err = capsys.readouterr()
    assert "read from" in out and len(measured) == 1 and len(fitted) == 1 and err == ""


def test_plan_uses_the_first_devices_of_a_larger_saved_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfile, pfile = tmp_path / "cluster.json", tmp_path / "plan.json"
    Cluster.from_calibration(_fake(4)).save(cfile)
    assert main(["plan", "mlp", "--stages", "2", "--calibrate", str(cfile), "--json", str(pfile)]) == 0
    cluster = Plan.load(pfile).cluster
    assert len(cluster) == 2 and cluster.collective_bandwidth == 1e9


@pytest.mark.parametrize(
    ("setup", "args", "says"),
    [
        (lambda p: Cluster.from_calibration(_fake(2)).save(p), ["--stages", "3"],
         "describes 2 devices but the plan needs 3; measure again"),
        (lambda p: p.write_text("{oops"), ["--stages", "2"], "is not JSON"),
        (lambda p: Cluster.from_calibration(_fake(2)).save(p), ["--stages", "2", "--link-bandwidth", "1e9"],
         "both set the links"),
    ],
)
def test_plan_calibrate_errors_are_one_line_with_a_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: Any, args: list[str], says: str
) -> None:
    cfile = tmp_path / "cluster.json"
    setup(cfile)
    assert main(["plan", "mlp", *args, "--calibrate", str(cfile)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipecut: error: ") and says in err


def test_a_file_fitted_on_another_model_or_device_count_is_used_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfile = tmp_path / "cluster.json"
    fit = _fitted(Cluster.from_calibration(_fake(4)), model="gpt2-tiny")
    fit.cluster.save(cfile, details=fit.details())
    assert main(["plan", "mlp", "--devices", "2", "--global-batch", "4", "--calibrate", str(cfile)]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"pipecut: warning: {cfile}: it was fitted on model gpt2-tiny, not mlp; on 4 devices, not 2")
    assert f"pipecut calibrate --model mlp --devices 2 --out {cfile}" in err
    # A host measured alone is read as before, with a note on what fitting adds.
    Cluster.from_calibration(_fake(2)).save(cfile)
    assert main(["plan", "mlp", "--devices", "2", "--global-batch", "4", "--calibrate", str(cfile)]) == 0
    assert "measured this host alone, not fitted to a model" in capsys.readouterr().err


def test_plan_prices_with_every_fitted_field_of_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The fitted speed, per-op and per-action overheads and cores survive the file and move the step."""
    host = Cluster.from_calibration(_fake(2))
    steps = {}
    for action in (0.0, 0.05):
        cfile, pfile = tmp_path / f"c{action}.json", tmp_path / f"p{action}.json"
        fit = _fitted(host, action=action, parameters=sum(p.numel() for p in load_model("mlp")[0].parameters()))
        fit.cluster.save(cfile, details=fit.details())
        args = ["plan", "mlp", "--devices", "2", "--global-batch", "4", "--schedule", "1f1b"]
        assert main([*args, "--calibrate", str(cfile), "--json", str(pfile)]) == 0
        plan = Plan.load(pfile)
        assert capsys.readouterr().err == ""  # fitted on this model and device count: no warning
        assert plan.cluster.devices[0] == fit.cluster.devices[0] and plan.cluster.cores == 2
        assert plan.layout is not None
        assert plan.cluster.devices[0].op_overhead == 3e-5 and plan.cluster.devices[0].action_overhead == action
        steps[action] = plan.layout.step_time
    # Every rank runs at least a forward and a backward action on the step's path.
    assert steps[0.05] >= steps[0.0] + 2 * 0.05


@pytest.mark.multiprocess
def test_calibrate_fits_a_model_on_two_processes_and_plan_uses_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], measured: list[dict[str, Any]]
) -> None:
    """The real fit (the host measurement faked): two gloo processes train a tiny language model."""
    cfile, pfile, preset = tmp_path / "cluster.json", tmp_path / "plan.json", tmp_path / "preset.json"
    assert main(["calibrate", "--model", TINY_LM, "--devices", "2", "--global-batch", "4", "--quick",
                 "--timeout", "300", "--out", str(cfile)]) == 0
    cluster, host = Cluster.load(cfile), Cluster.from_calibration(_fake(2))
    dev = cluster.devices[0]
    assert dev.name == "cpu (measured) (fitted to the model)" and cluster.cores == os.cpu_count()
    # fitted: the speed, or where noise swamps the tiny model's compute, the per-op overhead alone
    assert (dev.peak_flops_fp32, dev.op_overhead) != (host.devices[0].peak_flops_fp32, host.devices[0].op_overhead)
    assert dev.action_overhead >= 0 and cluster.link_bandwidth == host.link_bandwidth  # the host's links kept
    fitted_to = Cluster.load_details(cfile)[FITTED_TO]
    assert fitted_to["devices"] == 2 and fitted_to["loss"] == "next-token cross-entropy"
    assert fitted_to["model_id"] == calibration.model_id(TINY_LM) and fitted_to["parameters"] > 0
    plan_args = ["plan", TINY_LM, "--devices", "2", "--global-batch", "4"]
    assert main([*plan_args, "--calibrate", str(cfile), "--json", str(pfile)]) == 0
    assert capsys.readouterr().err == ""  # fitted on this model and device count: no warning
    assert main([*plan_args, "--device", "cpu", "--json", str(preset)]) == 0
    plan, on_preset = Plan.load(pfile), Plan.load(preset)
    assert plan.cluster.devices[0] == dev and plan.layout is not None and on_preset.layout is not None
    assert plan.layout.step_time != on_preset.layout.step_time
