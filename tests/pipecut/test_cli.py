"""The pipecut command line: prints the plan table, writes JSON and DOT, fails with a clear message."""

from __future__ import annotations

from pathlib import Path

import pytest

from partitioner import Plan
from pipecut.cli import main


def test_plan_command_prints_and_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js, dot = tmp_path / "plan.json", tmp_path / "plan.dot"
    code = main(["plan", "mlp", "--stages", "3", "--device", "cpu", "--json", str(js), "--dot", str(dot)])
    out = capsys.readouterr().out
    assert code == 0
    assert "pipecut plan: 3 stages" in out and "bottleneck:" in out
    assert Plan.load(js).num_stages == 3
    assert dot.read_text().startswith("digraph")


@pytest.fixture(scope="module")
def gpt2_tiny_fp32() -> str:
    """What `pipecut plan gpt2-tiny --stages 2` prints (tracing gpt2-tiny is most of a plan's time: done once)."""
    import contextlib
    import io

    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()) as out:
        mp.delenv("COLUMNS", raising=False)  # as the tests' own autouse fixture does, which a module's runs before
        assert main(["plan", "gpt2-tiny", "--stages", "2"]) == 0
    return out.getvalue()


def test_gpt2_tiny_by_name(gpt2_tiny_fp32: str) -> None:
    out = gpt2_tiny_fp32
    assert "transformer.h" in out and "shared parameters" in out


def test_factory_from_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "mymodel.py"
    src.write_text(
        "import torch\n"
        "def build():\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))\n"
        "    return m, (torch.randn(3, 4),)\n"
    )
    assert main(["plan", f"{src}:build", "--stages", "2", "--device", "cpu", "--method", "equal_count"]) == 0
    assert "method equal_count" in capsys.readouterr().out


def test_errors_are_one_line_with_a_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "no-such-model", "--stages", "2"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "path/to/file.py:factory" in err
    assert main(["plan", "mlp", "--stages", "99"]) == 2
    assert "ask for at most" in capsys.readouterr().err


def test_a_bad_model_file_is_an_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Every error pipecut raises is a PipecutError, so the CLI reports each as one line, no traceback.
    src = tmp_path / "empty.py"
    src.write_text("def build():\n    return 3\n")
    assert main(["plan", f"{src}:nope", "--stages", "2"]) == 2
    assert f"{src} has no callable 'nope'" in capsys.readouterr().err
    assert main(["plan", f"{src}:build", "--stages", "2"]) == 2
    assert "the factory must return (model, example_inputs), got int" in capsys.readouterr().err
    assert main(["plan", f"{tmp_path / 'missing.py'}:build", "--stages", "2"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_simulate_command_prints_per_rank_and_writes_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    js, trace = tmp_path / "plan.json", tmp_path / "trace.json"
    assert main(["plan", "mlp", "--stages", "4", "--device", "cpu", "--json", str(js)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(js), "--schedule", "zbv", "--microbatches", "16", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "4 stages on 2 ranks, schedule zbv, 16 micro-batches" in out
    assert "0,3" in out and "1,2" in out  # the V placement
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    assert len(spans) == 4 * 16 * 3  # F, I and W of every stage and micro-batch
    assert main(["simulate", str(js)]) == 0  # the plan's own schedule by default


def test_plan_command_with_auto_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "mlp", "--stages", "2", "--schedule", "auto", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "schedule choice" in out and "<- chosen" in out and "chose " in out
    with pytest.raises(SystemExit):  # argparse rejects it with a usage message
        main(["plan", "mlp", "--stages", "2", "--microbatches", "0"])
    assert "expected a positive integer or 'auto'" in capsys.readouterr().err


def test_plan_command_recompute_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "mlp", "--stages", "2", "--device", "cpu", "--recompute", "on"]) == 0
    out = capsys.readouterr().out
    assert "recompute" in out and "activation recomputation on 2 of 2 stages (0-1)" in out
    assert main(["plan", "mlp", "--stages", "2", "--device", "cpu"]) == 0
    assert "activation recomputation" not in capsys.readouterr().out  # memory does not bind


def test_plan_command_precision_flag(gpt2_tiny_fp32: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "gpt2-tiny", "--stages", "2", "--precision", "bf16"]) == 0
    bf16 = capsys.readouterr().out
    fp32 = gpt2_tiny_fp32
    # The plan's title (after the line naming this machine's device, the default) says the precision.
    bf16_title, fp32_title = (next(line for line in out.splitlines() if line.startswith("pipecut plan:"))
                              for out in (bf16, fp32))
    assert "precision bf16 autocast over fp32 weights" in bf16_title and fp32_title.endswith("precision fp32")
    assert bf16 != fp32  # 16-bit matmuls and halved activations change the times and memory


def test_python_dash_m_pipecut_runs_the_same_command_line() -> None:
    import subprocess
    import sys

    from partitioner.schedule.registry import TRAINING_SCHEDULES

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "pipecut", "plan", "--help"], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "--schedule" in done.stdout
    for name in TRAINING_SCHEDULES:  # the choices come from the schedule registry
        assert name in done.stdout



def test_version_is_the_distributions(capsys: pytest.CaptureFixture[str]) -> None:
    import re

    import pipecut
    from pipecut.cli import version

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE).group(1)  # type: ignore[union-attr]
    assert pipecut.__version__ == declared  # the fallback for a source tree that is not installed
    assert version() == declared
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"pipecut {declared}\n"


def test_version_falls_back_to_the_package_when_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    import pipecut
    from pipecut.cli import version

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    monkeypatch.setattr(pipecut, "__version__", "9.9.9")
    assert version() == "9.9.9"


@pytest.mark.parametrize("columns", [80, 200])
def test_plan_table_fits_the_terminal_width(
    columns: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", str(columns))  # what a terminal of that width sets; rich reads it
    argv = ["plan", "mlp", "--stages", "3", "--device", "cpu", "--recompute", "on", "--schedule", "auto"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= columns, out
    header = next(line for line in lines if "memory / usable" in line)
    assert "stage" in header and "modules" in header and "time" in header and "schedule choice" in out
    if columns == 80:  # the least read columns leave, and a line says which
        assert "fwd FLOPs" not in header and "left out at 80 columns: fwd FLOPs" in out
    else:
        assert "fwd FLOPs" in header and "left out" not in out


def test_output_to_a_file_keeps_every_column(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # not a terminal and no width: str(plan)'s, not rich's 80
    assert main(["plan", "mlp", "--stages", "3", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "fwd FLOPs" in out and "left out" not in out and max(len(line) for line in out.splitlines()) > 80


def test_str_plan_keeps_its_fixed_width_whatever_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from partitioner import partition
    from partitioner.plan.render import TEXT_WIDTH, render_text

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    plan = partition(model, (torch.randn(2, 8),), 2)
    monkeypatch.setenv("COLUMNS", "40")
    text = str(plan)
    assert text == render_text(plan, width=TEXT_WIDTH) and "fwd FLOPs" in text and "left out" not in text
    assert all(line == line.rstrip() for line in text.splitlines())  # no padding to the width
    narrow = render_text(plan, width=60)
    assert max(len(line) for line in narrow.splitlines()) <= 60 and "memory / usable" in narrow


def test_plan_devices_searches_the_shardings_named_by_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --zero: FSDP2 is searched when named (the default space is none and ZeRO-1); a name the search
    # does not know is an error line that lists the ones it does.
    js = tmp_path / "plan.json"
    base = ["plan", "gpt2-tiny", "--devices", "4", "--global-batch", "16", "--top", "2"]
    assert main([*base, "--zero", "fsdp", "--json", str(js)]) == 0
    layout = Plan.load(js).layout
    assert layout is not None and layout.dp > 1 and layout.zero == "fsdp"
    out = capsys.readouterr().out
    assert "sharded over the replicas (FSDP)" in out
    # What each device keeps for the gathered weights, and so why the stages' capacity is lower.
    kept = out.split("FSDP keeps ")[1].split(" of each device")[0]
    assert kept.endswith("MiB") and float(kept.split()[0]) > 0
    assert main([*base, "--zero", "none,ddp"]) == 2
    assert "zero must list some of none, zero1, fsdp, got ['none', 'ddp']" in capsys.readouterr().err


def test_train_with_a_dead_peer_exits_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    # What a surviving rank of `pipecut train` meets when a peer is killed (runtime.transport.liveness;
    # the multi-process case is tests/runtime/transport/test_bounded_collectives.py).
    from pipecut.cli import command as cli
    from runtime.transport.p2p import PeerGone

    line = ("rank 0: rank 1 (process 4242 on host) is gone (its process exited), so the broadcast of the loss "
            "from rank 1 over ranks [0, 1] failed after 0.1 s; restart the job (from its last checkpoint), and "
            "read that rank's log or exit code for why it died")

    def dead_peer(args: object) -> int:
        raise PeerGone(line, ranks=[1])

    monkeypatch.setattr(cli, "_train", dead_peer)
    assert cli.main(["train", "--model", "model.py", "--data", "tokens.bin"]) == 2
    assert capsys.readouterr().err == f"pipecut: error: {line}\n"
