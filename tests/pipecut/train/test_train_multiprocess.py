"""`pipecut train` as a job of several processes over gloo: torchrun 2 x 1, 2 x 2 stopped and rerun, and
2 pipeline ranks x tp 2 (a Llama; a GPT-2, its packed c_attn checkpointed as its parts, resumed).

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

from rank_pool import spawn

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


def _gpt2_run_and_rerun(rank: int, world: int, argv: list[str], out: str) -> dict[str, object]:
    """Run ``argv`` to the end without its step-4 checkpoint (the run dies after step 4, before it
    is written), then rerun it: the rerun resumes from step 2. The steps each run took and the first
    one's metrics; its final/ is copied to ``out``'s sibling ``first``."""
    from pipecut.cli import main
    from runtime.trainer import PipelineTrainer

    real_step, real_save = PipelineTrainer.step, PipelineTrainer.save
    steps: list[int] = []

    def counted(self: PipelineTrainer, *args: object, **kwargs: object) -> torch.Tensor:
        steps[-1] += 1
        return real_step(self, *args, **kwargs)  # type: ignore[arg-type]

    def withheld(self: PipelineTrainer, directory: object) -> Path:
        if self.step_count == 4:  # every rank alike: no collective is left waiting
            return Path(str(directory))
        return real_save(self, directory)  # type: ignore[arg-type]

    PipelineTrainer.step, PipelineTrainer.save = counted, withheld  # type: ignore[method-assign]
    try:
        steps.append(0)
        assert main(argv) == 0
        first = metrics(Path(out))
        if rank == 0:  # before the rerun: its export needs every rank, rank 0 included, to get there
            shutil.copytree(Path(out) / "final", Path(out).parent / "first" / "final")
        PipelineTrainer.save = real_save  # type: ignore[method-assign]
        steps.append(0)
        assert main(argv) == 0
    finally:
        PipelineTrainer.step, PipelineTrainer.save = real_step, real_save  # type: ignore[method-assign]
    return {"steps": steps, "metrics": first}


def test_gpt2_pp_2_by_tp_2_checkpoints_its_packed_attention_and_resumes_bitwise(
    gpt2_folder: Path, token_file: Path, tmp_path: Path
) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import GPT2LMHeadModel

    out = tmp_path / "run"
    argv = ["train", *_flags(gpt2_folder, token_file, out), "--pp", "2", "--tp", "2"]
    runs = spawn(_gpt2_run_and_rerun, 4, argv, str(out), timeout=420)
    assert [r["steps"] for r in runs] == [[4, 2]] * 4  # the rerun took steps 3 and 4 only
    first = runs[0]
    # The same losses, bit for bit, as the run that went through (steps 1 and 2 are its own record).
    assert [(m["step"], m["loss"]) for m in metrics(out)] == [(m["step"], m["loss"]) for m in first["metrics"]]
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4]
    final, went_through = final_weights(out), final_weights(tmp_path / "first")
    assert final.keys() == went_through.keys() and all(torch.equal(final[k], went_through[k]) for k in final)
    # The packed q, k and v weight in the checkpoint: its 3 parts' halves, one chunk each.
    meta = FileSystemReader(str(out / "checkpoints" / "step-2")).read_metadata()
    assert len(meta.state_dict_metadata["model.transformer.h.0.attn.c_attn.weight"].chunks) == 6
    # final/: the folder's own keys, whole, read by from_pretrained.
    with safe_open(str(gpt2_folder / "model.safetensors"), framework="pt") as f:
        assert final.keys() == set(f.keys())
    model, info = GPT2LMHeadModel.from_pretrained(out / "final", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for k, v in model.state_dict().items():
        if k in final:
            torch.testing.assert_close(v, final[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
