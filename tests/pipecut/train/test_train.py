"""`pipecut train` in one process: the files a run writes, resume after a crash, the export, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipecut.cli import main
from pipecut.train import resolve, train
from pipecut.train.data import EVAL, open_tokens
from pipecut.train.loop import lm_loss
from runtime.trainer import PipelineTrainer


def _args(folder: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(folder), "--data", str(data), "--out", str(out), "--seq-len", "16",
            "--global-batch", "8", "--micro-batch-size", "2", "--pp", "2", "--checkpoint-every", "2",
            "--warmup", "1", *extra]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted((out / "final").glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def metrics(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(llama_folder: Path, token_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run") / "a"
    assert main([*_args(llama_folder, token_file, out), "--steps", "4", "--eval-every", "2"]) == 0
    return out


def test_a_run_writes_plan_metrics_checkpoints_config_and_a_loadable_export(
    uninterrupted: Path, llama_folder: Path, token_file: Path
) -> None:
    out = uninterrupted
    lines = metrics(out)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert set(lines[0]) == {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "predicted_step_s"}
    assert 0 < lines[0]["predicted_step_s"] == lines[-1]["predicted_step_s"]  # the plan's pipeline step
    assert "eval_loss" in lines[1] and "eval_loss" in lines[3] and "eval_loss" not in lines[2]
    assert lines[0]["lr"] == pytest.approx(3e-4) and lines[-1]["lr"] < lines[0]["lr"]  # warm-up 1, then decay
    assert (out / "plan.json").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]
    assert 'model = "' in (out / "config.toml").read_text() and "steps = 4" in (out / "config.toml").read_text()
    names = {p.name for p in (out / "final").iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"} <= names

    # The export loads with from_pretrained and gives the run's last evaluation loss on the same batches.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    AutoTokenizer.from_pretrained(out / "final")
    data, total = open_tokens(token_file), 0.0
    for i in range(4):
        x, y = data.batch(seed=0, step=i, rows=8, seq_len=16, stream=EVAL)
        with torch.no_grad():
            total += float(lm_loss(model(x).logits, y))
    assert total / 4 == pytest.approx(lines[-1]["eval_loss"], rel=1e-6)


def test_rerun_after_a_crash_and_with_more_steps_ends_bitwise_equal(
    uninterrupted: Path, llama_folder: Path, token_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "b"
    # A shorter run (the decay's end fixed at the final length), then the full command...
    assert main([*_args(llama_folder, token_file, out), "--steps", "2", "--decay-steps", "4", "--eval-every", "2"]) == 0
    # ...which crashes in its 4th step, after the checkpoint of step 2 and before any of step 4 ...
    real_step, calls = PipelineTrainer.step, []

    def crashing(self: PipelineTrainer, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(self.step_count)
        if self.step_count == 3:
            raise KeyboardInterrupt("simulated crash")
        return real_step(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(PipelineTrainer, "step", crashing)
    full = [*_args(llama_folder, token_file, out), "--steps", "4", "--eval-every", "2"]
    with pytest.raises(KeyboardInterrupt):
        main(full)
    assert calls == [2, 3]  # resumed at step 2
    monkeypatch.setattr(PipelineTrainer, "step", real_step)
    # ... and the same command again resumes from step-4's predecessor and ends where the uninterrupted run did.
    assert main(full) == 0
    a, b = final_weights(uninterrupted), final_weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [m["loss"] for m in metrics(out)] == [m["loss"] for m in metrics(uninterrupted)]
    # A smaller --steps than the run has done is refused, not silently exported.
    capsys.readouterr()
    assert main([*full[:-4], "--steps", "3"]) == 2
    assert "holds a checkpoint at step 4, past --steps 3" in capsys.readouterr().err


def test_config_file_with_flags_over_it_and_text_data(llama_folder: Path, tmp_path: Path) -> None:
    from conftest import TEXT

    text = tmp_path / "corpus.txt"
    text.write_text(TEXT)
    toml = tmp_path / "run.toml"
    toml.write_text(f'model = "{llama_folder}"\ndata = "{text}"\nsteps = 5\nseq_len = 8\nglobal_batch = 2\nlr = 1e-3\n')
    cfg = resolve({"out": str(tmp_path / "out"), **_toml(toml)}, {"steps": 1})
    assert (cfg.steps, cfg.seq_len, cfg.lr) == (1, 8, 1e-3)
    result = train(cfg)
    assert [m["step"] for m in result.metrics] == [1]
    assert "steps = 1" in (tmp_path / "out" / "config.toml").read_text()


def _toml(path: Path) -> dict[str, object]:
    from pipecut.train import read_toml

    return read_toml(path)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dp", "2"], "--dp 2 needs 2 processes: launch with torchrun --nproc-per-node 4"),
        (["--global-batch", "7"], "--global-batch 7 does not divide into 1 replicas of micro-batches of 2"),
        (["--seq-len", "100"], "--seq-len 100 is longer than the model's 64 positions"),
        (["--schedule", "nope"], "schedule must be one of"),
    ],
)
def test_bad_settings_are_one_line_errors(
    extra: list[str], message: str, llama_folder: Path, token_file: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*_args(llama_folder, token_file, tmp_path), *extra]) == 2
    assert message in capsys.readouterr().err


def test_only_causal_lms_train(tmp_path: Path, token_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import T5Config

    T5Config(d_model=16, num_layers=1, num_heads=2, d_ff=32, vocab_size=32).save_pretrained(tmp_path / "t5")
    assert main(_args(tmp_path / "t5", token_file, tmp_path / "o")) == 2
    assert "pipecut train supports causal language models" in capsys.readouterr().err


def test_resuming_another_models_run_is_a_one_line_error(
    uninterrupted: Path, token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The model folder changed under an --out that holds another model's checkpoints (issue 31):
    one line naming a tensor, both shapes and the likely cause, not DCP's traceback."""
    import shutil

    from tests.pipecut.conftest import write_llama

    out = tmp_path / "out"
    shutil.copytree(uninterrupted, out)
    wider = write_llama(tmp_path / "wider", hidden_size=48)
    capsys.readouterr()
    assert main([*_args(wider, token_file, out), "--steps", "6"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipecut: error: ") and "Traceback" not in err
    assert "differ in shape" in err and "(128, 48)" in err and "(128, 32)" in err and "--out" in err
