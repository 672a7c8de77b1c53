"""`pipecut calibrate` and `pipecut plan --calibrate FILE`: measure, save, reuse, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from partitioner import Plan
from partitioner.cost import calibrate
from partitioner.cost.calibrate import Calibration
from partitioner.cost.devices import Cluster
from partitioner.cost.probes import ComputeSpeed, LinearFit, Probe
from pipecut.cli import main


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


def test_calibrate_with_a_model_times_its_own_gemms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], measured: list[dict[str, Any]]
) -> None:
    assert main(["calibrate", "--devices", "2", "--model", "mlp", "--out", str(tmp_path / "c.json")]) == 0
    probe = measured[0]["probe"]
    assert probe.gemms != Probe().gemms and all(count >= 1 for _, count in probe.gemms)


def test_plan_with_a_missing_file_measures_saves_and_plans(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], measured: list[dict[str, Any]]
) -> None:
    cfile, pfile = tmp_path / "cluster.json", tmp_path / "plan.json"
    assert main(["plan", "mlp", "--stages", "2", "--calibrate", str(cfile), "--json", str(pfile)]) == 0
    assert "2 stages on 2 x cpu (measured)" in capsys.readouterr().out
    assert len(measured) == 1 and measured[0]["devices"] == 2
    assert Plan.load(pfile).cluster == Cluster.load(cfile)
    # The second plan reuses the file: nothing is measured again.
    assert main(["plan", "mlp", "--stages", "2", "--calibrate", str(cfile)]) == 0
    assert "read from" in capsys.readouterr().out and len(measured) == 1


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
