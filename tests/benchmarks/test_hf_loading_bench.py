"""The Hugging Face loading benchmark (issue 30): its --quick run end to end, and the bound it checks
on one process's load of a Mixtral layer."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from bench_script import load_script, run_script

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:

    module = load_script("hf_loading")
    return module


@pytest.mark.parametrize("streaming", [True, False])
def test_one_layer_loads_within_one_source_tensor(bench: ModuleType, streaming: bool, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Layer 1 of a tiny Mixtral, as a rank holding it loads it: streaming, the host holds one expert's
    # tensor at a time; with the converter's stacking, a whole fused tensor and more.
    from transformers import MixtralForCausalLM

    import runtime.state.hf_conversion as hf_conversion
    from runtime.state.materialize import empty_weights
    from runtime.state.weights import checkpoint_index, load_weights

    cfg = bench.QUICK
    torch.manual_seed(0)
    MixtralForCausalLM(cfg.hf_config()).save_pretrained(tmp_path, max_shard_size=int(cfg.shard_mib * 2**20))
    with empty_weights():
        meta = MixtralForCausalLM(cfg.hf_config())
    into = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in meta.state_dict().items()
            if n.startswith("model.layers.1.")}
    fused = into["model.layers.1.mlp.experts.gate_up_proj"]
    index = checkpoint_index(tmp_path)
    largest = max(i.nbytes for k, i in index.items() if k.startswith("model.layers.1."))
    sizes = [f.stat().st_size for f in tmp_path.glob("*.safetensors")]
    if not streaming:
        monkeypatch.setattr(hf_conversion, "_merged_slices", lambda group, wanted: None)
    with bench._measured(sizes) as out:
        report = load_weights(tmp_path, into, names=list(meta.state_dict()), model=meta)
    assert sorted(report.names) == sorted(into) and report.converted > 0
    assert out["mapped_files_peak_bytes"] > 0  # safetensors' mappings, counted apart
    peak = out["tensor_peak_over_baseline_bytes"]
    if streaming:
        assert peak <= largest + bench.SLACK, out["tensor_live_at_peak"]
    else:
        assert peak >= fused.numel() * fused.element_size() > largest + bench.SLACK


# The default profile loads in the streaming mode only (the stacking path's larger peak is checked
# on one layer above, in this process); --quick's both modes, and their comparison, in the long one.
@pytest.mark.multiprocess
@pytest.mark.parametrize("modes", [["--modes", "streaming"], pytest.param([], marks=pytest.mark.long)],
                         ids=["streaming", "quick"])
def test_hf_loading_quick(tmp_path: Path, modes: list[str]) -> None:
    # A subprocess, as users run it: its spawned ranks re-import the script as __main__.
    out = tmp_path / "hf_loading.json"
    argv = ["--quick", *modes, "--out", str(out)]
    run = run_script("hf_loading", argv, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads(out.read_text())
    meta = data["meta"]
    assert meta["benchmark"] == "hf_loading" and meta["command"] == "python benchmarks/hf_loading.py " + " ".join(argv)
    assert {"config", "checkpoint", "rows", "from_pretrained", "checks", "phases_s"} <= data.keys()
    assert all(c["met"] for c in data["checks"].values()), data["checks"]
    ck = data["checkpoint"]
    assert len(ck["files"]) > 2 and ck["per_expert_keys"] == 2 * 4 * 3  # layers x experts x (w1, w2, w3)
    rows = data["rows"]
    both = not modes
    assert data["config"]["modes"] == (["streaming", "materialised"] if both else ["streaming"])
    assert [(r["p"], r["mode"], r["rank"]) for r in rows] == [(2, "streaming", 0), (2, "streaming", 1)] + (
        [(2, "materialised", 0), (2, "materialised", 1)] if both else [])
    assert all(r["same_stages_as_other_mode"] is (True if both else None) for r in rows)
    slack = meta["slack_bytes"]
    assert slack == 64 * 2**10
    for r in rows:
        assert r["hwm_reset"] and r["layers"] == [r["rank"]] and r["tensors_loaded"] > 0
        assert not r["foreign_keys_read"] and not r["values_wrong"]
        assert r["bytes_read"] > 0 and r["files_read"] and set(r["files_read"]) <= set(r["files"])
        assert 0 < r["largest_read_bytes"] <= ck["largest_bytes"]
        assert r["rss_over_stage_bytes"] > 0 and r["mapped_files_peak_bytes"] > 0
        # The bound: what loading adds to the stage in torch's allocator, within one source tensor
        # and the load's bookkeeping (SLACK: a few scalars and small tensors, whatever the model).
        within = r["tensor_over_stage_bytes"] <= r["largest_read_bytes"] + slack
        assert within == r["tensor_within_one_source"]
        if r["mode"] == "streaming":
            assert within, r["tensor_live_at_peak"]
    if both:  # stacking a layer's experts on the host costs more than streaming them into their slices
        by = {(r["mode"], r["rank"]): r["tensor_over_stage_bytes"] for r in rows}
        assert all(by["materialised", k] > by["streaming", k] for k in (0, 1))
    threads, sequential = data["from_pretrained"]
    assert threads["threads"] and threads["tensor_peak_over_baseline_bytes"] is None
    assert not sequential["threads"] and sequential["tensor_peak_over_baseline_bytes"] > 0
    assert threads["model_bytes"] == sequential["model_bytes"] >= ck["bytes"]


def test_hf_loading_refuses_an_unknown_mode(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:  # before anything is written or spawned
        bench.main(["--quick", "--modes", "streaming,stacked"])
    assert exit_.value.code == 2 and "--modes 'streaming,stacked'" in capsys.readouterr().err
