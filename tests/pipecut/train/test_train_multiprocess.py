"""`pipecut train` as a job of several processes over gloo: torchrun 2 x 1, 2 x 2 stopped and rerun, and
2 pipeline ranks x tp 2.

The 2 x 1 run uses the real ``torchrun`` binary (``--standalone``: a local rendezvous on a free
port); the 2 x 2 run starts its 4 ranks with ``runtime.transport.launch.spawn`` and calls the
command's entry point in each. Both take the same global batch in the same data-parallel halves,
and a pipeline cut changes where a layer runs but not its arithmetic, so they end with the same
weights bit for bit; the 2 x 2 run crashes on every rank after its step-2 checkpoint and is rerun.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_train import final_weights, metrics

from runtime.transport.launch import spawn

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[3]


def _flags(folder: Path, data: Path, out: Path) -> list[str]:
    return ["--model", str(folder), "--data", str(data), "--out", str(out), "--steps", "4", "--seq-len", "16",
            "--global-batch", "8", "--micro-batch-size", "2", "--checkpoint-every", "2", "--warmup", "1"]


@pytest.fixture(scope="module")
def torchrun_2x1(llama_folder: Path, token_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("torchrun") is None:
        pytest.skip("no torchrun on PATH")
    out = tmp_path_factory.mktemp("torchrun") / "run"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "pipecut", "train",
           *_flags(llama_folder, token_file, out), "--dp", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("trained 4 steps") == 1  # rank 0 alone reports
    # ... its start-up block and, stdout being a pipe, a plain line per step (4 steps: every one is due)
    assert done.stdout.count("pipecut train: ") == 1 and "2 replica(s) x 1-rank pipeline on 2 processes" in done.stdout
    assert [s.split("  ")[0] for s in done.stdout.splitlines() if s.startswith("step ")] == [
        f"step {n}/4" for n in range(1, 5)]
    assert (out / "train.log").read_text().count("pipecut train: ") == 1
    return out


def test_torchrun_two_replicas(torchrun_2x1: Path) -> None:
    lines = metrics(torchrun_2x1)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert sorted(p.name for p in (torchrun_2x1 / "checkpoints").iterdir()) == ["step-2", "step-4"]
    assert (torchrun_2x1 / "final" / "config.json").is_file()


class _Crash(Exception):
    pass


def _crash_then_rerun(rank: int, world: int, argv: list[str]) -> list[int]:
    from pipecut.cli import main
    from runtime.trainer import PipelineTrainer

    real_step = PipelineTrainer.step
    resumed: list[int] = []

    def crashing(self: PipelineTrainer, *args: object, **kwargs: object) -> torch.Tensor:
        if self.step_count == 3:  # every rank, before step 4 sends anything
            raise _Crash
        return real_step(self, *args, **kwargs)  # type: ignore[arg-type]

    PipelineTrainer.step = crashing  # type: ignore[method-assign]
    try:
        main(argv)
    except _Crash:
        resumed.append(-1)
    finally:
        PipelineTrainer.step = real_step  # type: ignore[method-assign]
    assert main(argv) == 0
    return resumed


def test_two_by_two_stopped_after_a_checkpoint_and_rerun_ends_bitwise_equal(
    torchrun_2x1: Path, llama_folder: Path, token_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    argv = ["train", *_flags(llama_folder, token_file, out), "--dp", "2", "--pp", "2"]
    assert spawn(_crash_then_rerun, 4, argv, timeout=240) == [[-1]] * 4
    a, b = final_weights(torchrun_2x1), final_weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [m["loss"] for m in metrics(out)] == [m["loss"] for m in metrics(torchrun_2x1)]
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4]


def _main(rank: int, world: int, argv: list[str]) -> int:
    from pipecut.cli import main

    return main(argv)


def test_pp_2_by_tp_2_saves_sharded_checkpoints_and_exports_whole_weights(
    torchrun_2x1: Path, llama_folder: Path, token_file: Path, tmp_path: Path
) -> None:
    # Each stage split over 2 processes (the trainer's tests resume such checkpoints bitwise): the
    # folder's weights read shard by shard, sharded checkpoints at steps 2 and 4, final/ whole.
    out = tmp_path / "run"
    argv = ["train", *_flags(llama_folder, token_file, out), "--pp", "2", "--tp", "2"]
    assert spawn(_main, 4, argv, timeout=300) == [0] * 4
    assert "layout dp1 x pp2 x tp2" in (out / "config.toml").read_text()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]
    a, b = final_weights(torchrun_2x1), final_weights(out)
    with safe_open(str(llama_folder / "model.safetensors"), framework="pt") as f:
        assert a.keys() == b.keys() == set(f.keys())
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4]
    # The same steps on the same batches as 2 replicas of 1 rank, but for the round-off of the
    # row-parallel sums (two halves, then an all-reduce): measured 2.4e-7 at most on a weight.
    torch.testing.assert_close([m["loss"] for m in metrics(out)], [m["loss"] for m in metrics(torchrun_2x1)],
                               rtol=2e-5, atol=0)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=2e-5, atol=2e-6, msg=lambda m, k=k: f"{k}: {m}")
