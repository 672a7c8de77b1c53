"""``pipecut plan`` and ``pipecut simulate`` exit 3 when a device is over capacity (the row marked
``OVER``), 2 for other errors, 0 when the plan fits (docs/reference/errors.md, "Exit codes of the command line")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partitioner import Plan
from partitioner.plan.plan import _checksum
from pipecut.cli import EXIT_ERROR, EXIT_OVER_CAPACITY, main

# 1e5 bytes of training state per parameter: the MLP's stages need GiBs on a 24 GiB device.
_HEAVY = ["mlp", "--stages", "2", "--device", "L4-24GB", "--state-bytes", "1e5"]


def test_the_codes_are_distinct() -> None:
    assert (EXIT_ERROR, EXIT_OVER_CAPACITY) == (2, 3)


def test_plan_over_capacity_exits_3_marks_the_rows_and_still_writes_the_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    js = tmp_path / "over.json"
    # equal_count cuts without looking at memory: a plan comes back, over capacity on both devices.
    assert main(["plan", *_HEAVY, "--method", "equal_count", "--json", str(js)]) == EXIT_OVER_CAPACITY
    out, err = capsys.readouterr()
    rows = [line for line in out.splitlines() if "/ 20.8 GiB" in line]  # 24 GiB less the L4's 3.2 GiB reserve
    assert len(rows) == 2 and all("OVER" in line for line in rows)
    assert "over capacity" in err and "stages 0, 1" in err
    assert Plan.load(js).num_stages == 2  # written, so that it can be read and simulated


def test_plan_that_no_cut_fits_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *_HEAVY]) == EXIT_OVER_CAPACITY  # exact: InfeasibleMemoryError
    assert "no partition into 2 stages fits device memory" in capsys.readouterr().err


def test_simulate_over_capacity_exits_3_and_marks_the_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js = tmp_path / "over.json"
    main(["plan", *_HEAVY, "--method", "equal_count", "--json", str(js)])
    capsys.readouterr()
    assert main(["simulate", str(js)]) == EXIT_OVER_CAPACITY
    out, err = capsys.readouterr()
    ranks = [line for line in out.splitlines() if line.strip()[:1] in ("0", "1") and "GiB" in line]
    assert len(ranks) == 2 and all("OVER" in line for line in ranks)
    assert "OVER" in out.splitlines()[-1]  # the fullest device's line too
    assert "rank 0" in err and "over capacity" in err


def test_simulate_of_a_plan_that_fits_exits_0_unmarked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js = tmp_path / "fits.json"
    assert main(["plan", "mlp", "--stages", "2", "--device", "cpu", "--json", str(js)]) == 0
    assert main(["simulate", str(js)]) == 0
    assert "OVER" not in capsys.readouterr().out


def test_simulate_of_a_bad_plan_file_keeps_code_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js = tmp_path / "fits.json"
    main(["plan", "mlp", "--stages", "2", "--device", "cpu", "--json", str(js)])
    data = json.loads(js.read_text())
    data["stages"][1]["capacity"] = -1  # once printed as "... of -1 B"
    data["checksum"] = _checksum(data)
    js.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["simulate", str(js)]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "field stages[1].capacity is -1" in err
