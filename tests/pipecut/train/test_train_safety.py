"""`pipecut train` never loses a run and says what happened: divergence, the run folder's owner,
torn metrics, a full disk, an unwritable ``--out``, bad token data (issue 31)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipecut.cli import main


def _args(folder: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(folder), "--data", str(data), "--out", str(out), "--seq-len", "16",
            "--global-batch", "4", "--micro-batch-size", "2", "--pp", "2", *extra]


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


# -- 1. finite training -----------------------------------------------------------------------------

# With this rate step 1 is finite and step 2's gradient norm is NaN (its loss still finite).
_DIVERGE = ("--lr", "1e30", "--warmup", "4", "--steps", "4", "--checkpoint-every", "1", "--keep", "2")


def test_divergence_stops_the_run_and_keeps_the_newest_finite_checkpoint(
    llama_folder: Path, token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(_args(llama_folder, token_file, out, *_DIVERGE)) == 2
    err = capsys.readouterr().err
    assert "step 2" in err and "gradient norm is nan" in err and "--lr" in err
    assert f"{out / 'checkpoints' / 'step-1'}" in err  # where to resume from
    assert _checkpoints(out) == ["step-1"]  # no non-finite checkpoint, none of the finite ones rotated away
    assert not (out / "final").exists()


def test_check_finite_stops_at_a_nonfinite_loss_before_the_optimizer_step(
    llama_folder: Path, token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    import pipecut.train.loop as loop

    real = loop.lm_loss
    monkeypatch.setattr(loop, "lm_loss", lambda output, targets: real(output, targets) * torch.nan)
    out = tmp_path / "run"
    assert main(_args(llama_folder, token_file, out, "--steps", "2", "--check-finite")) == 2
    err = capsys.readouterr().err
    assert "step 1" in err and "check_finite=True" in err and "No optimizer step was taken" in err
    assert "no checkpoint yet" in err
    assert not (out / "checkpoints").exists()


def test_allow_nonfinite_loss_runs_on_but_writes_no_nonfinite_checkpoint_or_export(
    llama_folder: Path, token_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "run"
    assert main(_args(llama_folder, token_file, out, *_DIVERGE, "--allow-nonfinite-loss")) == 0
    assert _steps(out) == [1, 2, 3, 4]
    assert _checkpoints(out) == ["step-1"]
    assert not (out / "final").exists()
    assert "not finite: checkpoint step-2 not written" in caplog.text


def test_check_finite_and_allow_nonfinite_loss_contradict(
    llama_folder: Path, token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_args(llama_folder, token_file, tmp_path, "--check-finite", "--allow-nonfinite-loss")) == 2
    assert "--check-finite and --allow-nonfinite-loss" in capsys.readouterr().err


# -- 2. the run folder is owned ---------------------------------------------------------------------


def test_a_second_run_on_a_held_folder_is_refused_with_the_owner_named(
    llama_folder: Path, token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import os
    import socket

    from pipecut.train.runfolder import hold

    out = tmp_path / "run"
    out.mkdir()
    with hold(out):  # the first run, as far as the second can tell
        assert main(_args(llama_folder, token_file, out, "--steps", "1")) == 2
    err = capsys.readouterr().err
    assert f"{out} is in use by another pipecut train run (pid {os.getpid()} on {socket.gethostname()}" in err
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # the refused run wrote nothing
    assert main(_args(llama_folder, token_file, out, "--steps", "1")) == 0  # released: the folder is free again
    with hold(out):  # and the run released it when it ended
        pass


def test_a_torn_last_metrics_line_is_dropped_with_a_warning_and_the_run_resumes(
    llama_folder: Path, token_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "run"
    assert main(_args(llama_folder, token_file, out, "--steps", "2", "--checkpoint-every", "1")) == 0
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "loss": 4.8')  # killed while appending step 3's line
    assert main(_args(llama_folder, token_file, out, "--steps", "3", "--checkpoint-every", "1")) == 0
    assert f"{out / 'metrics.jsonl'}:3 is cut short" in caplog.text
    assert _steps(out) == [1, 2, 3]


def test_the_metrics_rewrite_on_resume_is_atomic(
    llama_folder: Path, token_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    assert main(_args(llama_folder, token_file, out, "--steps", "2", "--checkpoint-every", "1")) == 0
    before = (out / "metrics.jsonl").read_text()
    real = Path.write_text

    def killed(self: Path, data: str, *args: object, **kwargs: object) -> int:
        if "metrics.jsonl" not in self.name:
            return real(self, data, *args, **kwargs)  # type: ignore[arg-type]
        real(self, data[: len(data) // 2])
        raise KeyboardInterrupt("killed while rewriting metrics.jsonl")

    monkeypatch.setattr(Path, "write_text", killed)
    with pytest.raises(KeyboardInterrupt):
        main(_args(llama_folder, token_file, out, "--steps", "3", "--checkpoint-every", "1"))
    assert (out / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in out.iterdir() if "metrics" in p.name) == ["metrics.jsonl"]  # no temp file left


def test_a_damaged_metrics_line_before_the_last_is_named(tmp_path: Path) -> None:
    from pipecut.train.metrics_log import MetricsFileError, cut_back

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(MetricsFileError, match=rf"{path}:2 is not a metrics line .*delete that line"):
        cut_back(path, 3)
