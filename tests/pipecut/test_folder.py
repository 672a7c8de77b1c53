"""Hugging Face folders: read, built on meta, planned by `pipecut plan FOLDER` at any size."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import write_llama
from partitioner import Plan
from pipecut.cli import main
from pipecut.folder import FolderError, HFFolder, UnsupportedModelError

ROOT = Path(__file__).resolve().parents[2]


def test_folder_finds_its_files_and_builds_on_meta(llama_folder: Path) -> None:
    folder = HFFolder(llama_folder)
    assert folder.weights == llama_folder / "model.safetensors"
    assert {p.name for p in folder.tokenizer_files} >= {"tokenizer.json", "tokenizer_config.json"}
    model = folder.build(meta=True)
    assert all(p.is_meta for p in model.parameters())
    (ids,) = folder.example_inputs(seq_len=16, micro_batch_size=2)
    assert tuple(ids.shape) == (2, 16)


def test_folder_errors_say_what_a_folder_needs(tmp_path: Path) -> None:
    with pytest.raises(FolderError, match="is not a directory"):
        HFFolder(tmp_path / "nope")
    with pytest.raises(FolderError, match=r"has no config\.json"):
        HFFolder(tmp_path)
    from transformers import T5Config

    T5Config(d_model=16, num_layers=1, num_heads=2, d_ff=32, vocab_size=32).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"supports causal language models .* got model_type 't5'"):
        HFFolder(tmp_path).build()


def test_without_transformers_the_error_says_how_to_install_it(
    llama_folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from partitioner.errors import MissingDependencyError

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        tomllib = pytest.importorskip("tomli")

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(MissingDependencyError, match=r'needs transformers: pip install "pipecut\[hf\]"'):
        _ = HFFolder(llama_folder).config
    assert main(["plan", str(llama_folder), "--stages", "2", "--seq-len", "16"]) == 2
    assert 'pip install "pipecut[hf]"' in capsys.readouterr().err
    # The extra named is one pyproject.toml declares, and it brings transformers (so does dev, for the tests).
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("transformers>=") for r in extras["hf"])
    assert any(r.startswith("transformers>=") for r in extras["dev"])


def test_plan_command_takes_a_folder(llama_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js = tmp_path / "plan.json"
    code = main(["plan", str(llama_folder), "--stages", "2", "--device", "cpu", "--seq-len", "16",
                 "--micro-batch-size", "2", "--json", str(js)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "pipecut plan: 2 stages" in out and "model.layers" in out
    assert Plan.load(js).num_stages == 2
    assert main(["plan", str(llama_folder), "--stages", "2", "--seq-len", "65"]) == 2
    assert "longer than the model's 64 positions" in capsys.readouterr().err


_PEAK = """
import sys, time, resource
from pipecut.cli import main
t0 = time.perf_counter()
code = main(sys.argv[1:])
usage = resource.getrusage(resource.RUSAGE_SELF)
print("SECONDS", time.perf_counter() - t0)
print("CPU_SECONDS", usage.ru_utime + usage.ru_stime)
print("PEAK_BYTES", usage.ru_maxrss * 1024)
sys.exit(code)
"""


# Llama-2-70B's shape: layers of 8192, 64 heads with 8 KV heads, 28672 MLP, 32000 tokens, 4096
# positions; the test keeps 8 of its 80 layers. Planning time grows with the layers (about 0.2 s of
# CPU each: 25 s for all 80, docs/train.md), memory on meta hardly at all, and 8 layers of these
# widths already weigh 29 GB in fp32: a peak under 2 GiB shows nothing was materialised.
_LLAMA_70B = dict(vocab_size=32000, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                  intermediate_size=28672, max_position_embeddings=4096)
_LAYERS = 8


def _llama_params(*, vocab_size: int, hidden_size: int, num_attention_heads: int, num_key_value_heads: int,
                  intermediate_size: int, layers: int, **_: object) -> int:
    h, kv = hidden_size, hidden_size // num_attention_heads * num_key_value_heads
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * intermediate_size + 2 * h  # q o, k v, MLP, 2 norms
    return 2 * vocab_size * h + layers * per_layer + h  # embedding, lm_head (untied), final norm


@pytest.mark.slow
def test_a_70b_wide_config_plans_on_meta_under_2_gib(tmp_path: Path) -> None:
    write_llama(tmp_path, weights=False, tokenizer=False, num_hidden_layers=_LAYERS, **_LLAMA_70B)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    assert _llama_params(layers=80, **_LLAMA_70B) == 68_976_648_192  # Llama-2-70B's count
    fp32_bytes = 4 * _llama_params(layers=_LAYERS, **_LLAMA_70B)
    assert fp32_bytes > 12 * 2 * 2**30  # 29 GB: materialising a single layer (3.4 GB) breaks the bound below
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _PEAK, "plan", str(tmp_path), "--stages", str(_LAYERS), "--device", "H100-80GB",
         "--seq-len", "4096", "--microbatches", "32"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env(),
    )
    wall = time.perf_counter() - t0
    assert done.returncode == 0, done.stderr[-3000:]
    values = dict(line.split() for line in done.stdout.splitlines() if line.split()[:1] in (
        ["SECONDS"], ["CPU_SECONDS"], ["PEAK_BYTES"]))
    assert f"pipecut plan: {_LAYERS} stages" in done.stdout
    # CPU time (one thread), not wall time: CI's 2 shared cores may be busy with other tests. About
    # 10 s on a quiet core (8 of those start-up, torch and transformers); the bound catches a
    # blow-up (planning that grows with the weights' size), the wall clock only a hang.
    assert float(values["CPU_SECONDS"]) < 60 and wall < 300, (values, wall)
    assert int(values["PEAK_BYTES"]) < 2 * 2**30, values


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
