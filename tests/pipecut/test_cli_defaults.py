"""What ``pipecut plan`` assumes unless told, and says it does: this machine's device, its memory
reserve (``--memory-reserve``), the precision, estimates labelled by what they rest on; a job too
big for its devices refused with the bound and what would fit (exit 3)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from partitioner import Plan
from partitioner.cost.devices import DeviceSpec, default_device
from partitioner.plan.units import fmt_bytes, fmt_count
from partitioner.zoo import load_model
from pipecut.cli import EXIT_ERROR, EXIT_OVER_CAPACITY, build_parser, main


def test_plan_defaults_to_this_machines_device_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "mlp", "--stages", "2"]) == 0
    out = capsys.readouterr().out
    here = default_device()
    said = f"planning for {here}: this machine's device (the default; --device NAME plans for another)"
    assert out.splitlines()[0] == said
    assert f"2 stages on 2 x {here}," in out
    assert main(["plan", "mlp", "--stages", "2", "--device", "cpu"]) == 0
    assert "planning for" not in capsys.readouterr().out  # named: nothing to say
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "this machine's" in capsys.readouterr().out


def test_memory_reserve_flag_sets_what_each_device_keeps(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "mlp", "--stages", "2", "--device", "H100-80GB"]) == 0
    default = capsys.readouterr().out
    assert "memory per device: 80.0 GiB less a 6.0 GiB reserve (--memory-reserve) = 74.0 GiB usable" in default
    assert "/ 74.0 GiB" in default and "times estimated from the H100-80GB preset (roofline)" in default
    assert main(["plan", "mlp", "--stages", "2", "--device", "H100-80GB", "--memory-reserve", "10%"]) == 0
    out = capsys.readouterr().out
    assert "80.0 GiB less a 8.0 GiB reserve (--memory-reserve) = 72.0 GiB usable" in out and "/ 72.0 GiB" in out
    assert main(["plan", "mlp", "--stages", "2", "--device", "H100-80GB", "--memory-reserve", "0"]) == 0
    assert "80.0 GiB, no reserve: the plan may fill it all" in capsys.readouterr().out
    assert main(["plan", "mlp", "--stages", "2", "--memory-reserve", "2"]) == EXIT_ERROR
    assert "memory reserve '2' is not a size: give it with its unit" in capsys.readouterr().err


def test_the_layout_says_its_precision_and_what_its_estimate_rests_on(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "mlp", "--devices", "2", "--global-batch", "4", "--device", "H100-80GB"]
    assert main([*argv, "--precision", "bf16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("pipecut layout: 2 devices")
    text = "\n".join(lines)
    first = " ".join(text.split("\nestimated from")[0].split())  # the layout's first line, unwrapped
    assert first.endswith("precision bf16 autocast over fp32 weights")
    assert "estimated from the H100-80GB preset (roofline): step " in text
    assert "usable per device" in text and "80.0 GiB less a 6.0 GiB reserve" in text
    assert main(argv) == 0
    assert capsys.readouterr().out.split("\nestimated from")[0].endswith("precision fp32")


@pytest.mark.parametrize("how", [["--stages", "2"], ["--devices", "2", "--global-batch", "4"]])
def test_a_job_too_big_exits_3_with_the_bound_and_the_options(how: list[str],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # 1e5 bytes of training state per parameter: the MLP's needs terabytes; two L4s hold 41.6 GiB.
    assert main(["plan", "mlp", *how, "--device", "L4-24GB", "--state-bytes", "1e5"]) == EXIT_OVER_CAPACITY
    err = capsys.readouterr().err
    model, _ = load_model("mlp")
    p = sum(x.numel() for x in model.parameters())
    assert (f"The training state alone needs {fmt_bytes(p * 1e5)} ({fmt_count(p)} parameters x 100000 bytes) and "
            "the 2 x L4-24GB hold 41.6 GiB usable (20.8 GiB each: 24.0 GiB less a 3.2 GiB reserve)") in err
    assert (f"with --state-bytes 8 (bf16 weights, gradients and Adam moments, or fp32 SGD without momentum): "
            f"{fmt_bytes(p * 8 / 2)} per device of 20.8 GiB (dp1 x pp2: fits the state)") in err
    k = math.ceil(p * 1e5 / DeviceSpec.preset("L4-24GB").usable_memory)
    assert f"with more devices: at least {k} x L4-24GB" in err
    if "--devices" in how:
        assert err.startswith("pipecut: error: No layout fits 2 x L4-24GB") and "with --zero fsdp" in err
    else:
        assert "no partition into 2 stages fits" in err


def test_train_takes_the_reserve_as_a_setting() -> None:
    from pipecut.train.config import TrainConfigError, resolve

    args = build_parser().parse_args(["train", "--model", "m", "--data", "d.bin", "--out", "o",
                                      "--memory-reserve", "3GiB"])
    cfg = resolve({}, {k: v for k, v in vars(args).items() if k in ("model", "data", "out", "memory_reserve")})
    assert cfg.memory_reserve == "3GiB" and cfg.device == "auto"
    assert resolve({"model": "m", "data": "d", "out": "o"}, {}).memory_reserve is None  # the device's own
    with pytest.raises(TrainConfigError, match="memory_reserve: memory reserve '3 bananas' is not a size"):
        resolve({"model": "m", "data": "d", "out": "o", "memory_reserve": "3 bananas"}, {})


def test_train_plans_for_the_same_default_device_with_the_reserve_given(
    llama_folder: Path, token_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--model", str(llama_folder), "--data", str(token_file), "--out", str(out), "--seq-len", "16",
            "--global-batch", "2", "--pp", "2", "--steps", "1", "--memory-reserve", "1GiB"]
    assert main(argv) == 0
    devices = Plan.load(out / "plan.json").cluster.devices
    assert {d.name for d in devices} == {default_device()}  # what `pipecut plan` defaults to
    assert {d.memory_reserve for d in devices} == {2**30}
