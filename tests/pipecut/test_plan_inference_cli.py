"""``pipecut plan FOLDER --inference --batch N --max-len L``: a plan for generation of a saved Llama folder."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipecut.cli import EXIT_ERROR, EXIT_OVER_CAPACITY, main

pytest.importorskip("transformers")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# 4 sequences of 48 positions (prompt 16) on 2 cpu stages; --precision adds to it.
_FOUR_OF_48 = ["--inference", "--batch", "4", "--max-len", "48", "--stages", "2", "--device", "cpu", "--seq-len", "16"]


@pytest.fixture(scope="module")
def fp32_plan(llama_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, str, Path]:
    """`pipecut plan FOLDER _FOUR_OF_48 --json PATH` at 200 columns: its code, stdout, stderr and PATH (made once:
    tracing the model is most of a plan's time)."""
    import contextlib
    import io

    path = tmp_path_factory.mktemp("inference") / "plan.json"
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        mp.setenv("COLUMNS", "200")
        code = main(["plan", str(llama_folder), *_FOUR_OF_48, "--json", str(path)])
    return code, out.getvalue(), err.getvalue(), path


def test_the_table_shows_what_each_stage_holds_and_the_summary_how_many_fit(
    fp32_plan: tuple[int, str, str, Path],
) -> None:
    code, out, err, path = fp32_plan
    assert code == 0, err
    for column in ("weights", "KV cache", "working", "memory / usable", "sequences", "decode step"):
        assert column in out
    assert "pipecut plan for generation: 2 stages" in out and "4 sequences of 48 positions (prompt 16)" in out
    saved = json.loads(path.read_text())
    fits = saved["inference"]["fits"]
    assert re.search(rf"^fits {fits} sequences of 48 tokens", out, flags=re.M)
    assert saved["schedule"] == "forward" and saved["inference"]["prompt_len"] == 16
    # 2 layers x 4 sequences x 48 positions x (keys, values) x 2 heads x 8 x 4 bytes, over the stages
    assert sum(st["kv_bytes"] for st in saved["stages"]) == 2 * 4 * 48 * 2 * 2 * 8 * 4


def test_bf16_halves_the_cache_and_the_weights(
    fp32_plan: tuple[int, str, str, Path], llama_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    bf16 = tmp_path / "bf16.json"
    code, _, err = _run(capsys, str(llama_folder), *_FOUR_OF_48, "--precision", "bf16", "--json", str(bf16))
    assert code == 0, err
    sizes = {}
    for precision, path in (("fp32", fp32_plan[3]), ("bf16", bf16)):  # fp32: the default precision
        stages = json.loads(path.read_text())["stages"]
        sizes[precision] = (sum(st["kv_bytes"] for st in stages), sum(st["state_bytes"] for st in stages))
    assert sizes["bf16"][0] * 2 == sizes["fp32"][0] and sizes["bf16"][1] < 0.6 * sizes["fp32"][1]


def test_a_batch_too_large_for_the_devices_exits_3_saying_how_many_fit(
    llama_folder: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = _run(capsys, str(llama_folder), "--inference", "--batch", "200000", "--max-len", "64", "--stages",
                        "2", "--device", "cpu", "--memory-reserve", "23GiB")
    assert code == EXIT_OVER_CAPACITY
    most = int(re.search(r"at most (\d+) sequences of 64 positions fit 2 stages", err).group(1))  # type: ignore[union-attr]
    assert 0 < most < 200000
    code, out, err = _run(capsys, str(llama_folder), "--inference", "--batch", str(most), "--max-len", "64",
                          "--stages", "2", "--device", "cpu", "--memory-reserve", "23GiB")
    assert code == 0, err
    assert f"fits {most} sequences of 64 tokens" in out


@pytest.mark.parametrize(("extra", "named"), [
    (["--schedule", "gpipe"], "--schedule"),
    (["--microbatches", "4", "--recompute", "on"], "--microbatches, --recompute"),
    (["--state-bytes", "8"], "--state-bytes"),
    (["--micro-batch-size", "2"], "--micro-batch-size"),
])
def test_training_flags_are_refused_by_name(
    llama_folder: Path, capsys: pytest.CaptureFixture[str], extra: list[str], named: str,
) -> None:
    code, _, err = _run(capsys, str(llama_folder), "--inference", "--batch", "2", "--max-len", "32", "--stages", "2",
                        *extra)
    assert code == EXIT_ERROR
    assert f"drop {named}" in err and "--inference plans generation" in err


def test_missing_or_misplaced_sizes_are_refused(llama_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, str(llama_folder), "--inference", "--batch", "2", "--stages", "2")
    assert code == EXIT_ERROR and "--inference needs --batch N" in err and "--max-len L" in err
    code, _, err = _run(capsys, str(llama_folder), "--batch", "2", "--max-len", "32", "--stages", "2")
    assert code == EXIT_ERROR and "add --inference" in err
    code, _, err = _run(capsys, str(llama_folder), "--inference", "--batch", "2", "--max-len", "65", "--stages", "2")
    assert code == EXIT_ERROR and "longer than the model's 64 positions" in err
    code, _, err = _run(capsys, str(llama_folder), "--inference", "--batch", "2", "--max-len", "16", "--seq-len", "20",
                        "--stages", "2")
    assert code == EXIT_ERROR and "--seq-len 20 (the prompt) is longer than --max-len 16" in err


def test_pipecut_generate_plans_its_batch_and_length_for_generation(llama_folder: Path) -> None:
    from pipecut.generate.folder_generator import build_generator, open_generation_folder

    opened = open_generation_folder(llama_folder)
    # What pipecut generate passes: --batch-size 3, the longest prompt (8 tokens) + --max-new-tokens 4.
    gen = build_generator(opened, pp=2, seq_len=12, batch=3, prompt_len=8)
    inf = gen.plan.inference
    assert inf is not None and (inf.batch, inf.max_len, inf.prompt_len, inf.dtype) == (3, 12, 8, "fp32")
    assert gen.plan.schedule == "forward" and all(st.kv_bytes > 0 for st in gen.plan.stages)
    assert len(gen.generate([[5, 6, 7]], max_new_tokens=2, eos_token_id=[]).tokens[0]) == 2
