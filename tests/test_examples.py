"""The examples keep working, with what their output promises (the README's demo and Training blocks run here,
handed over by `run-by`; tests/test_readme.py runs its other commands)."""

from __future__ import annotations

import importlib
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from test_readme import readme_block

ROOT = Path(__file__).resolve().parents[1]


def test_demo_runs(capsys: pytest.CaptureFixture[str]) -> None:
    # The README's first block, run here once (tests/test_readme.py checks its pip steps' form).
    *_, demo = readme_block("tests/test_examples.py::test_demo_runs").commands
    assert demo.argv == ("python", "examples/demo.py")
    runpy.run_path(str(ROOT / demo.argv[1]), run_name="__main__")  # in this process: no interpreter start
    out = capsys.readouterr().out
    assert "pipecut plan: 4 stages" in out
    diff = float(re.search(r"largest gradient difference (\S+)", out).group(1))  # type: ignore[union-attr]
    assert diff < 1e-5
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert losses[-1] < losses[0] * 0.5, "the demo's loss should fall"


def test_train_pipelined_in_one_process() -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from train_pipelined import main
    finally:
        sys.path.pop(0)
    first = main(["--stages", "2", "--steps", "1"])
    assert first == first  # not NaN
    # The first step's loss is the initial model's: under bf16 autocast with recomputation, the
    # same to bf16's rounding.
    mixed = main(["--stages", "2", "--steps", "1", "--precision", "bf16", "--recompute"])
    assert mixed == pytest.approx(first, rel=2e-2) and mixed != first


def test_train_pipelined_zbv_writes_its_trace(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from train_pipelined import main
    finally:
        sys.path.pop(0)
    trace = tmp_path / "zbv.json"
    main(["--schedule", "zbv", "--stages", "4", "--steps", "1", "--trace", str(trace)])
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 4 * 8 * 3 and {e["tid"] for e in spans} == {0, 1}  # S x m x (F, I, W), 2 ranks


# The examples under torchrun are the long profile's: the default runs each in one process
# (test_train_pipelined_in_one_process, test_train_big_loads_pretrained_weights_resumes_and_exports),
# and pipecut's own commands under torchrun (tests/test_readme.py, tests/pipecut/).
@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_readme_training_commands() -> None:
    # The README's Training block, run here once, with what its output promises: one process, a
    # stage per process, and 2 replicas x 2 stages over 4 processes all train the same model on
    # the same data. 5 steps: the script prints the loss of step 1 (the initial model's) and 5.
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    one, pp, dp_pp = readme_block("tests/test_examples.py::test_the_readme_training_commands").commands
    script = "examples/train_pipelined.py"
    assert one.argv == ("python", script)
    assert pp.argv == ("torchrun", "--standalone", "--nproc-per-node", "4", script)
    assert dp_pp.argv == ("torchrun", "--standalone", "--nproc-per-node", "4", script, "--dp", "2", "--pp", "2")
    main = _example("train_pipelined").main
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def launch(argv: tuple[str, ...], nproc: str) -> str:
        run = subprocess.run([torchrun, *argv[1:3], nproc, *argv[4:], "--steps", "5"],  # argv[3]: the README's 4
                             cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        return run.stdout

    def last_loss(out: str) -> float:
        return float(re.findall(r"step +5 +loss (\d+\.\d+)", out)[-1])

    # One process, 4 stages on threads (main() returns the last step's loss), and the same 1F1B
    # pipeline cut in 2 across 2 processes (the README says 4: each process costs 7-8 s of CPU
    # here, and the 4-process launch below already runs). A cut moves layers, not arithmetic.
    alone = main([*one.argv[2:], "--steps", "5"])
    out = launch(pp.argv, "2")
    assert "'dist' transport, torchrun, 1 x 2 (dp x pp)" in out
    assert last_loss(out) == pytest.approx(alone, rel=1e-4)
    # 2 replicas of 2 stages over 4 processes, and one process, one pipeline of 2 stages on the
    # same global batch (micro-batches twice as large): the same losses, exact either way.
    out = launch(dp_pp.argv, "4")
    assert "'dist' transport, torchrun, 2 x 2 (dp x pp)" in out
    assert last_loss(out) == pytest.approx(main([*dp_pp.argv[5:], "--steps", "5"]), rel=1e-4)


def _example(name: str) -> ModuleType:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def _train_big() -> object:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train_big
    finally:
        sys.path.pop(0)
    return train_big


def test_train_big_loads_pretrained_weights_resumes_and_exports(tmp_path: Path) -> None:
    big = _train_big()
    losses = big.main(["--out", str(tmp_path), "--stages", "2", "--steps", "2"])  # type: ignore[attr-defined]
    # The first step's loss is the pretrained model's: the meta model was loaded, not initialised.
    from transformers import LlamaForCausalLM

    pretrained = LlamaForCausalLM.from_pretrained(tmp_path / "pretrained")
    x, y = big.batch(0)  # type: ignore[attr-defined]
    with torch.no_grad():  # the model's own output, as the stages give it
        want = big.lm_loss(pretrained(x), y)  # type: ignore[attr-defined]
    assert losses[0] == pytest.approx(float(want), rel=1e-5)
    assert (tmp_path / "ckpt" / ".metadata").is_file() and (tmp_path / "hf" / "config.json").is_file()
    # The export has the model's own keys (no wrapper prefix): from_pretrained finds every weight.
    exported = LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)[1]
    assert not exported["missing_keys"] and not exported["unexpected_keys"], exported


@pytest.mark.long  # see test_the_readme_training_commands
@pytest.mark.multiprocess
def test_train_big_under_torchrun(tmp_path: Path) -> None:
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", str(ROOT / "examples" / "train_big.py"),
         "--out", str(tmp_path), "--steps", "2"],
        capture_output=True, text=True, timeout=400, env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "the same 2 losses, bitwise" in run.stdout and "from_pretrained loads it" in run.stdout


def test_tiny_hf_folder_writes_a_folder_from_pretrained_loads_and_a_token_file(tmp_path: Path) -> None:
    import numpy as np

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from tiny_hf_folder import main
    finally:
        sys.path.pop(0)
    main([str(tmp_path / "tiny"), str(tmp_path / "tokens.npy"), "--layers", "2"])
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tmp_path / "tiny")
    tokens = np.load(tmp_path / "tokens.npy")
    assert tokens.ndim == 1 and int(tokens.max()) < model.config.vocab_size
    assert (np.diff(tokens[:64].astype(int)) % model.config.vocab_size == 1).all()  # a run counts up
