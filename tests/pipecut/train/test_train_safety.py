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


@pytest.fixture(scope="module")
def two_steps(llama_folder: Path, token_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run, checkpointed at each step; a test resumes a copy of it."""
    out = tmp_path_factory.mktemp("two-steps") / "run"
    assert main(_args(llama_folder, token_file, out, "--steps", "2", "--checkpoint-every", "1")) == 0
    return out


def _copy(run: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run, to)
    return to


def test_a_torn_last_metrics_line_is_dropped_with_a_warning_and_the_run_resumes(
    two_steps: Path, llama_folder: Path, token_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = _copy(two_steps, tmp_path / "run")
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "loss": 4.8')  # killed while appending step 3's line
    assert main(_args(llama_folder, token_file, out, "--steps", "3", "--checkpoint-every", "1")) == 0
    assert f"{out / 'metrics.jsonl'}:3 is cut short" in caplog.text
    assert _steps(out) == [1, 2, 3]


def test_the_metrics_rewrite_on_resume_is_atomic(
    two_steps: Path, llama_folder: Path, token_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _copy(two_steps, tmp_path / "run")
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


# -- 3. every error says what happened --------------------------------------------------------------


def test_a_full_disk_during_a_checkpoint_says_where_and_how_much(
    llama_folder: Path, token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import errno
    import os
    import shutil

    import torch.distributed.checkpoint.filesystem as fs

    def full(transforms: object, stream: object, *args: object, **kwargs: object) -> object:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fs, "_write_item", full)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1000, 999, 1))  # type: ignore[attr-defined]
    out = tmp_path / "run"
    assert main(_args(llama_folder, token_file, out, "--steps", "1")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"no space left on the device of {out / 'checkpoints' / 'step-1'}" in err
    assert "1 B free" in err and "needs about" in err and "free space" in err


def test_no_space_for_any_other_file_of_the_run_is_the_same_error(
    llama_folder: Path, token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import errno

    import pipecut.train.metrics_log as metrics_log

    def full(path: Path, line: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(metrics_log, "append", full)
    out = tmp_path / "run"
    assert main(_args(llama_folder, token_file, out, "--steps", "1")) == 2
    assert f"no space left on the device of {out / 'metrics.jsonl'}" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["file", "under a file", "read-only"])
def test_an_out_that_cannot_hold_the_run_is_named(
    kind: str, llama_folder: Path, token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import errno

    (tmp_path / "f").write_text("a file")
    out = {"file": tmp_path / "f", "under a file": tmp_path / "f" / "run", "read-only": tmp_path / "ro" / "run"}[kind]
    if kind == "read-only":  # the tests run as root, for whom permission bits do not stop a write

        def refuse(self: Path, *args: object, **kwargs: object) -> None:
            raise OSError(errno.EROFS, "Read-only file system", str(self))

        monkeypatch.setattr(Path, "mkdir", refuse)
    assert main(_args(llama_folder, token_file, out, "--steps", "1")) == 2
    err = capsys.readouterr().err
    assert f"--out {out}" in err and "Traceback" not in err
    assert {"file": "is a file, not a folder", "under a file": "is under a file",
            "read-only": "cannot be written (read-only file system"}[kind] in err


@pytest.mark.parametrize(
    ("name", "write", "message"),
    [
        ("empty.bin", lambda p: p.write_bytes(b""), "holds no tokens"),
        ("empty.npy", lambda p: __import__("numpy").save(p, __import__("numpy").zeros(0, "int64")), "holds no tokens"),
        # The same check as negative.bin's (a step's batch, after planning), read from another format.
        pytest.param("negative.npy", lambda p: __import__("numpy").save(p, __import__("numpy").full(200, -3)),
                     "token id -3", marks=pytest.mark.long),
        ("negative.bin", lambda p: p.write_bytes(__import__("numpy").full(200, -3, "int32").tobytes()), "token id -3"),
    ],
)
def test_empty_or_negative_token_data_is_named(
    name: str, write: object, message: str, llama_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / name
    write(data)  # type: ignore[operator]
    extra = ("--data-dtype", "int32") if name.endswith(".bin") else ()
    assert main(_args(llama_folder, data, tmp_path / "run", "--steps", "1", *extra)) == 2
    err = capsys.readouterr().err
    assert str(data) in err and message in err and "Traceback" not in err
