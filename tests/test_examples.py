"""The examples keep working, with what their output promises (tests/test_readme.py runs the README's commands)."""

from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_demo_runs(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(ROOT / "examples" / "demo.py"), run_name="__main__")
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


@pytest.mark.multiprocess
def test_train_pipelined_under_torchrun() -> None:
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "4", str(ROOT / "examples" / "train_pipelined.py"),
         "--dp", "2", "--pp", "2", "--steps", "5"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "'dist' transport, torchrun, 2 x 2 (dp x pp)" in run.stdout
    # One process, one pipeline of 2 stages on the same global batch (micro-batches twice as large).
    one = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_pipelined.py"), "--dp", "2", "--pp", "2", "--steps", "5"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    # The same losses in one process and across 2 replicas of 2 ranks: exact either way.
    def last_loss(out: str) -> float:
        return float(re.findall(r"loss (\d+\.\d+)", out)[-1])

    assert last_loss(run.stdout) == pytest.approx(last_loss(one.stdout), rel=1e-4)


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
