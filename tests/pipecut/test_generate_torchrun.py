"""``pipecut generate`` as a job of several processes over gloo: the same JSON lines as one process, rank 0 alone
writing, and every rank ending with one line when any rank fails.

The 2-rank run (``--pp 2``, greedy) uses the real ``torchrun`` binary (``--standalone``, one thread per
process); the 4-rank run (``--pp 2 --dp 2``, sampled with a seed) calls the command's entry point on 4
ranks of the test process's pool (``rank_pool``), and with torchrun in the long profile (4 fresh
interpreters on CI's 2 cores). Each is compared, line for line but for ``"seconds"``, with the same
command in one process. The failure cases call the entry point on 2 ranks of the pool, a case per test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from gen_cli_workers import failure, generate
from test_generate_cli import PROMPTS

from conftest import prompts_fixture
from pipecut.cli import EXIT_ERROR, main
from rank_pool import Cases, spawn

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]
NEW = 6
# Five ragged prompts (1 to 9 words): with --batch-size 3, two batches, the second smaller than a replica count x 2.
MORE = [*PROMPTS, "over the", '{"prompt": "quick"}']
SAMPLED = ["--temperature", "1.3", "--top-k", "40", "--seed", "5"]


@pytest.fixture(scope="module")
def folder(generation_folder: Path) -> Path:
    return generation_folder


prompts = prompts_fixture(MORE, "torchrun-prompts")


def _flags(folder: Path, prompts: Path, *extra: str) -> list[str]:
    return ["--model", str(folder), "--prompts", str(prompts), "--max-new-tokens", str(NEW), "--batch-size", "3",
            *extra]


def _records(text: str) -> list[dict[str, object]]:
    """The JSON lines without their timing (the one field a launch may change)."""
    records = [json.loads(line) for line in text.splitlines()]
    for r in records:
        assert float(r.pop("seconds")) > 0
    return records


def _one_process(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[dict[str, object]]:
    assert main(["generate", *argv]) == 0
    return _records(capsys.readouterr().out)


def _torchrun(nproc: int, argv: list[str]) -> subprocess.Popen[str]:
    """``pipecut generate argv`` under torchrun, started (the test computes its reference meanwhile)."""
    if shutil.which("torchrun") is None:
        pytest.skip("no torchrun on PATH")
    cmd = ["torchrun", "--standalone", "--nproc-per-node", str(nproc), "-m", "pipecut", "generate", *argv]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finished(job: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    try:
        out, err = job.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        job.kill()
        out, err = job.communicate()
    done = subprocess.CompletedProcess(job.args, job.returncode, out, err)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def _summary(stderr: str, records: list[dict[str, object]]) -> None:
    """Rank 0 alone says it started and sums up; the sum counts every replica's tokens."""
    lines = stderr.splitlines()
    assert sum(line.startswith("pipecut generate: ") for line in lines) == 1
    (summary,) = [line for line in lines if line.startswith("generated ")]
    made = sum(int(r["completion_tokens"]) for r in records)  # type: ignore[call-overload]
    assert summary.startswith(f"generated {made} tokens for {len(MORE)} prompts in ") and "tokens/s" in summary
    assert "pipecut: error" not in stderr


def test_two_ranks_write_what_one_process_writes(
    folder: Path, prompts: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = _torchrun(2, _flags(folder, prompts, "--pp", "2"))
    try:
        alone = _one_process(capsys, _flags(folder, prompts, "--pp", "2"))
    except BaseException:
        job.kill()
        raise
    done = _finished(job)
    records = _records(done.stdout)  # one copy: the other rank writes nothing
    assert records == alone and len(records) == len(MORE)
    assert "2 stages x 1 replica on 2 processes" in done.stderr
    _summary(done.stderr, records)


@pytest.fixture(scope="module")
def broken(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of two shards, the head alone in the second: rank 1 alone reads it, and it is cut short."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path_factory.mktemp("broken")
    for name in os.listdir(folder):
        if name != "model.safetensors":
            shutil.copy(folder / name, broken / name)
    weights = load_file(folder / "model.safetensors")
    head = {"lm_head.weight": weights.pop("lm_head.weight")}
    save_file(weights, broken / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(head, broken / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    index = dict.fromkeys(weights, "model-00001-of-00002.safetensors")
    index["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (broken / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    data = (broken / "model-00002-of-00002.safetensors").read_bytes()
    (broken / "model-00002-of-00002.safetensors").write_bytes(data[: len(data) // 2])
    return broken


@pytest.fixture(scope="module")
def failures(folder: Path, prompts: Path, broken: Path) -> Cases:
    """The failure cases of a 2-rank job (``gen_cli_workers.failure``), run when a test asks for one."""
    good = _flags(folder, prompts, "--timeout", "60")
    return Cases(failure, 2, good, _flags(broken, prompts, "--timeout", "60"), timeout=170)


def _error_line(results: list[tuple[int, str, str]], rank: int) -> str:
    """Rank ``rank``'s one error line: it failed with the error code, wrote nothing on stdout and no traceback."""
    code, out, err = results[rank]
    assert code == EXIT_ERROR and out == "", (rank, err)
    errors = [line for line in err.splitlines() if line.startswith("pipecut: error: ")]
    assert len(errors) == 1 and "Traceback" not in err, (rank, err)
    return errors[0]


def test_any_ranks_failure_ends_every_rank_with_one_line_a_layout_not_the_worlds(failures: Cases) -> None:
    results = failures("layout")
    for rank in (0, 1):
        assert "the job has 2 processes, which is not --dp x --pp (dp 1, pp 3)" in _error_line(results, rank)


def test_any_ranks_failure_ends_every_rank_with_one_line_loading(failures: Cases, broken: Path) -> None:
    results = failures("loading")
    assert "rank 0: rank 1 failed loading its stages: WeightsSourceError" in _error_line(results, 0)
    assert _error_line(results, 1).startswith(f"pipecut: error: rank 1: WeightsSourceError: checkpoint file {broken}")


def test_any_ranks_failure_ends_every_rank_with_one_line_generating(failures: Cases) -> None:
    results = failures("generating")
    assert "rank 1: RuntimeError: injected failure in rank 1's stage" in _error_line(results, 1)
    line = _error_line(results, 0)
    assert line.startswith("pipecut: error: rank 0: ") and "rank 1" in line  # the peer that failed, named


# After the failure cases: the pool's first 2 ranks are started by then.
def test_two_replicas_of_two_ranks_sample_what_one_process_samples(
    folder: Path, prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    alone = _one_process(capsys, _flags(folder, prompts, *SAMPLED))
    out = tmp_path / "completions.jsonl"
    ranks = spawn(generate, 4, _flags(folder, prompts, *SAMPLED, "--pp", "2", "--dp", "2", "--out", str(out)),
                  timeout=600)
    assert [(code, stdout) for code, stdout, _ in ranks] == [(0, "")] * 4  # with --out, nothing on any stdout
    records = _records(out.read_text())
    assert records == alone
    stderr = "".join(err for _, _, err in ranks)  # what torchrun would show: every rank's stderr
    assert "2 stages x 2 replicas on 4 processes, sampling" in stderr
    _summary(stderr, records)


@pytest.mark.long
def test_two_replicas_of_two_ranks_sample_what_one_process_samples_under_torchrun(
    folder: Path, prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "completions.jsonl"
    job = _torchrun(4, _flags(folder, prompts, *SAMPLED, "--pp", "2", "--dp", "2", "--out", str(out)))
    try:
        alone = _one_process(capsys, _flags(folder, prompts, *SAMPLED))
    except BaseException:
        job.kill()
        raise
    done = _finished(job)
    assert done.stdout.strip() == ""  # with --out, nothing on stdout, from any rank
    records = _records(out.read_text())
    assert records == alone
    assert "2 stages x 2 replicas on 4 processes, sampling" in done.stderr
    _summary(done.stderr, records)


def test_one_process_refuses_replicas_with_the_command_to_launch(
    folder: Path, prompts: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", *_flags(folder, prompts, "--pp", "2", "--dp", "2")]) == EXIT_ERROR
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--dp 2 runs 2 replicas" in line
    assert "torchrun --standalone --nproc-per-node 4 -m pipecut generate ... --pp 2 --dp 2" in line
    assert main(["generate", *_flags(folder, prompts, "--timeout", "0")]) == EXIT_ERROR
    assert "--timeout must be a positive number of seconds, got 0.0" in capsys.readouterr().err
