"""weights.py, weight_sources.py, weight_export.py: per-stage loading from every checkpoint layout,
name mapping, every refusal, and exports that load back (here and in transformers).

A toy model of two stages stands for a pipeline: each "rank" loads only its stage's names and
must touch only the files holding them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from runtime.state import weight_errors as errors
from runtime.state import weight_export, weight_sources
from runtime.state import weights as weights_module
from runtime.state.weight_export import save_safetensors
from runtime.state.weights import PrefixMap, checkpoint_index, detect_prefix, load_weights

# --- a two-stage toy ----------------------------------------------------------------------------


def _toy_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shapes = {
        "embed.weight": (10, 4), "layers.0.weight": (4, 4), "layers.0.bias": (4,),
        "layers.1.weight": (4, 4), "layers.1.bias": (4,), "head.weight": (10, 4),
    }
    return {k: torch.randn(*s, generator=g) for k, s in shapes.items()}


STAGE_OF = {"embed.weight": 0, "layers.0.weight": 0, "layers.0.bias": 0,
            "layers.1.weight": 1, "layers.1.bias": 1, "head.weight": 1}
RANKS = {s: [n for n, st_ in STAGE_OF.items() if st_ == s] for s in (0, 1)}


def _dests(names: list[str], ref: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    return {prefix + n: torch.zeros_like(ref[n]) for n in names}


def _write_shards(folder: Path, shards: list[dict[str, torch.Tensor]]) -> Path:
    """Hugging Face's layout, written independently of save_safetensors."""
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        safetensors.torch.save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _source(kind: str, folder: Path, state: dict[str, torch.Tensor]) -> Path:
    if kind == "safetensors":
        safetensors.torch.save_file(state, str(folder / "weights.safetensors"))
        return folder / "weights.safetensors"
    if kind == "shards":  # stage 0 in shard 1; stage 1 split over shards 2 and 3
        groups = [RANKS[0], ["layers.1.weight", "layers.1.bias"], ["head.weight"]]
        return _write_shards(folder, [{k: state[k] for k in g} for g in groups])
    if kind == "torch":
        torch.save(state, folder / "state.pt")
        return folder / "state.pt"
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning, match="single process"):
        dcp.save(dict(state), checkpoint_id=str(folder / "dcp"), no_dist=True)
    return folder / "dcp"


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the safetensors files opened (by safe_open) during the test."""
    calls: list[str] = []
    real = weight_sources.safe_open

    def spy(path: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(weight_sources, "safe_open", spy)
    return calls


# --- every source, per rank ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["safetensors", "shards", "torch", "dcp"])
def test_each_rank_loads_exactly_its_stage(kind: str, tmp_path: Path) -> None:
    ref = _toy_state()
    source = _source(kind, tmp_path, ref)
    for rank, mine in RANKS.items():
        into = _dests(mine, ref)
        report = load_weights(source, into, names=ref, stage_of=STAGE_OF)
        assert sorted(report.names) == sorted(mine), rank
        for n in mine:
            assert torch.equal(into[n], ref[n]), (kind, n)
        assert report.bytes_read == sum(ref[n].numel() * 4 for n in mine)
        assert report.prefix == PrefixMap() and report.detected and report.seconds >= 0
        assert "loaded" in str(report) and report.kind


def test_shards_without_a_rank_key_are_never_opened(tmp_path: Path, opened: list[str]) -> None:
    ref = _toy_state()
    source = _source("shards", tmp_path, ref)
    load_weights(source, _dests(RANKS[0], ref), names=ref)
    # Its shard only, twice: the header, then the data through a handle closed once read.
    assert opened == ["model-00001-of-00003.safetensors"] * 2
    opened.clear()
    report = load_weights(source / "model.safetensors.index.json", _dests(["head.weight"], ref), names=ref)
    assert opened == ["model-00003-of-00003.safetensors"] * 2
    assert [Path(f).name for f in report.files] == opened[:1]


def test_dcp_reads_only_the_rank_keys_with_and_without_a_process_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    ref = _toy_state()
    source = _source("dcp", tmp_path, ref)
    asked: list[str] = []
    real = FileSystemReader.read_data

    def spy(self: FileSystemReader, plan: Any, planner: Any) -> Any:
        asked.extend(item.storage_index.fqn for item in plan.items)
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", spy)
    into = _dests(RANKS[1], ref)
    load_weights(source, into, names=ref)
    assert sorted(asked) == sorted(RANKS[1])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        into = _dests(RANKS[0], ref)
        load_weights(source, into, names=ref)
        assert all(torch.equal(into[n], ref[n]) for n in RANKS[0])
    finally:
        dist.destroy_process_group()


def test_dcp_nested_state_detects_the_model_prefix(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    ref = _toy_state()
    with pytest.warns(UserWarning):
        dcp.save({"model": dict(ref), "step": 3}, checkpoint_id=str(tmp_path), no_dist=True)
    into = _dests(RANKS[1], ref)
    report = load_weights(tmp_path, into, names=ref)
    assert report.prefix == PrefixMap(checkpoint="model.")
    assert all(torch.equal(into[n], ref[n]) for n in RANKS[1])


@pytest.mark.parametrize("kind", ["safetensors", "shards", "torch", "dcp"])
def test_checkpoint_index_reads_headers_only(kind: str, tmp_path: Path) -> None:
    ref = _toy_state()
    index = checkpoint_index(_source(kind, tmp_path, ref))
    assert {k: (i.shape, i.dtype) for k, i in index.items()} == {
        k: (tuple(t.shape), t.dtype) for k, t in ref.items()
    }
    assert all(i.files and i.nbytes == ref[k].numel() * 4 for k, i in index.items())


def test_stages_of_a_meta_model_load_and_run(tmp_path: Path) -> None:
    """docs/reference/weights.md's flow: plan a meta model, allocate each stage, load it, run the stages."""
    from partitioner import partition

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))

    pretrained = build()
    safetensors.torch.save_file(pretrained.state_dict(), str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        model = build()
    plan = partition(model, (torch.randn(2, 4, device="meta"),), num_stages=2)
    staged = plan.build_stages()
    for s, stage in enumerate(staged):  # each rank, its stage
        stage.to_empty(device="cpu")
        mine = stage.state_dict()
        report = load_weights(tmp_path, mine, names=list(model.state_dict()),
                              aliases=plan.param_aliases, stage_of=dict.fromkeys(mine, s))
        assert set(report.names) == set(mine)
    x = torch.randn(3, 4)
    torch.testing.assert_close(staged(x)[0], pretrained(x))


# --- names: prefixes and tied weights, on a real Hugging Face model -----------------------------


def _llama(tie: bool = False, seed: int = 0) -> Any:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def _tied_aliases(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """name -> every name of its tensor, for tensors with several (what plan.param_aliases holds)."""
    by_ptr: dict[int, list[str]] = {}
    for n, t in module.state_dict(keep_vars=True).items():
        by_ptr.setdefault(t.data_ptr(), []).append(n)
    return {g[0]: tuple(g) for g in by_ptr.values() if len(g) > 1}


def _stage(name: str) -> int:
    return 0 if "embed_tokens" in name or ".layers.0." in name else 1


@pytest.mark.parametrize("tie", [False, True])
def test_hf_checkpoint_loads_into_wrapped_stages(tie: bool, tmp_path: Path, opened: list[str]) -> None:
    from partitioner.tracing.trace import CausalLMLogits

    pretrained = _llama(tie, seed=0)
    pretrained.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()  # transformers 5 writes safetensors
    assert ("lm_head.weight" in checkpoint_index(tmp_path)) is not tie  # tied: stored once
    wrapped = CausalLMLogits(_llama(tie, seed=1))
    names = list(wrapped.state_dict())
    aliases = _tied_aliases(wrapped)
    assert bool(aliases) is tie
    stage_of = {n: _stage(n) for n in names}
    for rank in (0, 1):
        into = {n: t for n, t in wrapped.state_dict().items() if stage_of[n] == rank}
        report = load_weights(tmp_path, into, names=names, aliases=aliases, stage_of=stage_of)
        assert report.prefix == PrefixMap("model.") and report.detected
    expected = CausalLMLogits(pretrained).state_dict()
    for n, t in wrapped.state_dict().items():
        assert torch.equal(t, expected[n]), n
    assert set(opened) == {"model.safetensors"}


def test_wrapped_checkpoint_loads_into_plain_names(tmp_path: Path) -> None:
    """The reverse mapping: a checkpoint of CausalLMLogits(model), the plain model's names."""
    from partitioner.tracing.trace import CausalLMLogits

    state = CausalLMLogits(_llama(seed=0)).state_dict()
    safetensors.torch.save_file(dict(state), str(tmp_path / "model.safetensors"))
    plain = _llama(seed=1)
    into = {n: t for n, t in plain.state_dict().items() if _stage(n) == 1}
    report = load_weights(tmp_path, into, names=list(plain.state_dict()))
    assert report.prefix == PrefixMap(checkpoint="model.")
    assert torch.equal(plain.lm_head.weight, _llama(seed=0).lm_head.weight)


def test_detect_prefix() -> None:
    assert detect_prefix(["x.a", "x.b"], ["a", "b"]) == PrefixMap("x.")
    assert detect_prefix(["a"], ["zzz"]) == PrefixMap()  # nothing matches: names as they are


def test_explicit_prefix_loads(tmp_path: Path) -> None:
    ref = _toy_state()
    source = _source("safetensors", tmp_path, ref)
    into = _dests(RANKS[0], ref, prefix="net.")
    report = load_weights(source, into, names=[f"net.{n}" for n in ref], prefix="net.")
    assert not report.detected and report.prefix == PrefixMap("net.")
    assert torch.equal(into["net.embed.weight"], ref["embed.weight"])


# --- refusals ----------------------------------------------------------------------------------


def test_missing_key_names_stage_and_close_match(tmp_path: Path) -> None:
    ref = _toy_state()
    state = dict(ref)
    state["layers.1.weights"] = state.pop("layers.1.weight")
    source = _source("safetensors", tmp_path, state)
    into = _dests(RANKS[1], ref)
    with pytest.raises(errors.MissingWeightsError) as info:
        load_weights(source, into, names=ref, stage_of=STAGE_OF, prefix="", strict=False)
    msg = str(info.value)
    assert "'layers.1.weight' (stage 1)" in msg and "close keys: 'layers.1.weights'" in msg
    assert str(source) in msg and "prefix=" in msg and "aliases=" in msg
    assert info.value.keys == ("layers.1.weight",) and info.value.problems[0].stage == 1
    assert not into["layers.1.bias"].any()  # nothing copied


def test_tied_weight_without_aliases_is_missing(tmp_path: Path) -> None:
    pretrained = _llama(tie=True)
    pretrained.save_pretrained(tmp_path)
    into = {"lm_head.weight": torch.zeros(64, 32)}
    with pytest.raises(errors.MissingWeightsError, match=r"aliases=plan.param_aliases"):
        load_weights(tmp_path, into, names=list(pretrained.state_dict()))
    pairs = tuple(_tied_aliases(pretrained).items())  # the form of plan.param_aliases
    load_weights(tmp_path, into, names=list(pretrained.state_dict()), aliases=pairs)
    assert torch.equal(into["lm_head.weight"], pretrained.model.embed_tokens.weight)


def test_unexpected_key_error_and_strict_false(tmp_path: Path) -> None:
    ref = _toy_state()
    state = {**ref, "rotary_emb.inv_freq": torch.ones(2)}
    source = _source("shards", tmp_path, ref)
    safetensors.torch.save_file({"rotary_emb.inv_freq": torch.ones(2)}, str(tmp_path / "extra.safetensors"))
    index = json.loads((source / "model.safetensors.index.json").read_text())
    index["weight_map"]["rotary_emb.inv_freq"] = "extra.safetensors"
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    into = _dests(RANKS[0], ref)
    with pytest.raises(errors.UnexpectedWeightsError) as info:
        load_weights(source, into, names=ref)
    msg = str(info.value)
    assert "'rotary_emb.inv_freq'" in msg and "extra.safetensors" in msg
    assert "strict=False" in msg and "inv_freq" in msg.split("Fix:")[1]
    assert info.value.keys == ("rotary_emb.inv_freq",)
    report = load_weights(source, into, names=ref, strict=False)
    assert report.ignored == ("rotary_emb.inv_freq",)
    assert torch.equal(into["embed.weight"], state["embed.weight"])


def test_shape_mismatch(tmp_path: Path) -> None:
    ref = _toy_state()
    source = _source("shards", tmp_path, {**ref, "head.weight": torch.zeros(12, 4)})
    with pytest.raises(errors.WeightShapeError) as info:
        load_weights(source, _dests(RANKS[1], ref), names=ref, stage_of=STAGE_OF)
    msg = str(info.value)
    assert "'head.weight' (stage 1)" in msg and "model-00003-of-00003.safetensors" in msg
    assert "model has shape (10, 4), checkpoint has shape (12, 4)" in msg and "config" in msg


def test_dtype_mismatch_and_cast(tmp_path: Path) -> None:
    ref = _toy_state()
    half = {k: t.to(torch.bfloat16) for k, t in ref.items()}
    source = _source("dcp", tmp_path, half)
    into = _dests(RANKS[0], ref)
    with pytest.raises(errors.WeightDtypeError) as info:
        load_weights(source, into, names=ref, stage_of=STAGE_OF)
    msg = str(info.value)
    assert "torch.float32, checkpoint has torch.bfloat16" in msg and "cast=True" in msg
    assert "(stage 0)" in msg and "__0_0.distcp" in msg
    report = load_weights(source, into, names=ref, cast=True)
    assert sorted(report.cast) == sorted(RANKS[0])
    assert torch.equal(into["embed.weight"], half["embed.weight"].float())


def test_nonfinite_values_are_counted_exactly(tmp_path: Path) -> None:
    # Bad values in several of the pieces the count walks, one in the last, partial piece.
    n = 3 * weights_module._NONFINITE_PIECE + 5
    bad = torch.zeros(n)
    bad[[0, weights_module._NONFINITE_PIECE + 1, n - 1]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    big = torch.full((4096,), 60000.0, dtype=torch.float16)  # finite, but its fp16 sum is inf
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"bad": bad, "big": big, "ok": torch.ones(3)}, path)
    into = {"bad": torch.empty(n), "big": torch.empty(4096, dtype=torch.float16), "ok": torch.empty(3)}
    with pytest.raises(errors.NonFiniteWeightsError) as info:
        load_weights(path, into, names=into)
    msg = str(info.value)
    assert f"3 of {n} NaN or infinite" in msg and "1 weight(s)" in msg and "allow_nonfinite" in msg
    assert torch.equal(into["big"], big)  # written, and its overflowing sum was no false alarm
    report = load_weights(path, into, names=into, allow_nonfinite=("ba*",))
    assert sorted(report.names) == ["bad", "big", "ok"]


def test_nonfinite_check_allocates_no_copy_of_the_tensor() -> None:
    # A load promises one checkpoint tensor at a time on the host: the check must not add a mask of
    # the destination's size (9 bytes per element with its int64 sum).
    from torch.profiler import ProfilerActivity, profile

    t = torch.randn(1 << 20)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        assert weights_module._nonfinite(t) == 0
    allocated = sum(e.cpu_memory_usage for e in prof.key_averages() if e.cpu_memory_usage > 0)
    assert allocated < 1024, prof.key_averages().table(sort_by="cpu_memory_usage", row_limit=5)


def test_errors_say_what_else_is_wrong(tmp_path: Path) -> None:
    ref = _toy_state()
    state = {**ref, "head.weight": torch.zeros(3)}
    del state["layers.1.bias"]
    source = _source("torch", tmp_path, state)
    with pytest.raises(errors.MissingWeightsError, match="Also found: 1 shape"):
        load_weights(source, _dests(RANKS[1], ref), names=ref)


def test_ambiguous_prefix(tmp_path: Path) -> None:
    source = _source("safetensors", tmp_path, {"p.x.weight": torch.ones(1), "q.y.weight": torch.ones(1)})
    with pytest.raises(errors.AmbiguousPrefixError) as info:
        load_weights(source, {"x.weight": torch.zeros(1)}, names=["x.weight", "y.weight"], strict=False)
    msg = str(info.value)
    assert "PrefixMap(model='', checkpoint='p.')" in msg and "checkpoint='q.'" in msg
    assert "1 of 2 names" in msg and "load_weights(prefix=...)" in msg
    assert len(info.value.candidates) == 2


def test_destination_refusals(tmp_path: Path) -> None:
    ref = _toy_state()
    source = _source("safetensors", tmp_path, ref)
    with pytest.raises(errors.WeightsDestinationError, match=r"meta device.*to_empty"):
        load_weights(source, {"embed.weight": torch.empty(10, 4, device="meta")}, names=ref)
    with pytest.raises(errors.WeightsDestinationError, match="not among the model's names: 'nope'"):
        load_weights(source, {"nope": torch.zeros(1)}, names=ref)
    with pytest.raises(errors.WeightsDestinationError, match="must be tensors"):
        load_weights(source, {"embed.weight": [0.0]}, names=ref)  # type: ignore[dict-item]


def test_source_refusals(tmp_path: Path) -> None:
    with pytest.raises(errors.WeightsSourceError, match="does not exist"):
        load_weights(tmp_path / "nope.safetensors", {}, names=[])
    with pytest.raises(errors.WeightsSourceError, match="no checkpoint pipecut reads"):
        load_weights(tmp_path, {}, names=[])
    (tmp_path / "junk.pt").write_bytes(b"not a pickle")
    with pytest.raises(errors.WeightsSourceError, match=r"torch.save"):
        checkpoint_index(tmp_path / "junk.pt")
    ref = _toy_state()
    source = _source("shards", tmp_path, ref)
    os.remove(source / "model-00003-of-00003.safetensors")
    with pytest.raises(errors.WeightsSourceError, match=r"model-00003-of-00003.safetensors does not exist"):
        load_weights(source, _dests(["head.weight"], ref), names=ref)


def test_partial_load_names_what_was_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _toy_state()
    source = _source("safetensors", tmp_path, ref)
    real = weight_sources.safe_open

    class Flaky:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inner = real(*args, **kwargs)

        def __enter__(self) -> Any:
            self.f = self.inner.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.inner.__exit__(*exc)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

        def get_tensor(self, key: str) -> torch.Tensor:
            if key == "layers.0.weight":
                raise OSError("Input/output error")
            return self.f.get_tensor(key)  # type: ignore[no-any-return]

    monkeypatch.setattr(weight_sources, "safe_open", Flaky)
    into = _dests(RANKS[0], ref)
    with pytest.raises(errors.PartialLoadError) as info:
        load_weights(source, into, names=ref)
    err = info.value
    assert isinstance(err.__cause__, OSError) and "Input/output error" in str(err)
    assert "after 2 of 3" in str(err) and err.loaded == ("embed.weight", "layers.0.bias")
    assert err.pending == ("layers.0.weight",) and "call load_weights again" in str(err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["shards", "torch", "dcp"])
def test_loads_into_cuda_destinations(kind: str, tmp_path: Path) -> None:
    ref = _toy_state()
    source = _source(kind, tmp_path, {k: t.to(torch.bfloat16) for k, t in ref.items()})
    into = {n: torch.zeros_like(ref[n], device="cuda") for n in RANKS[1]}
    load_weights(source, into, names=ref, cast=True)
    for n in RANKS[1]:
        assert into[n].device.type == "cuda"
        assert torch.equal(into[n].cpu(), ref[n].to(torch.bfloat16).float())


# --- exports -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shard_bytes", [10**9, 200])
def test_save_then_load_round_trip(shard_bytes: int, tmp_path: Path) -> None:
    ref = _toy_state()
    report = save_safetensors(ref, tmp_path, max_shard_bytes=shard_bytes, metadata={"by": "test"})
    files = sorted(p.name for p in tmp_path.iterdir())
    if shard_bytes > 1000:
        assert files == ["model.safetensors"]
    else:
        assert "model.safetensors.index.json" in files and len(files) > 3
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == report.total_bytes == sum(t.numel() * 4 for t in ref.values())
    for mine in RANKS.values():
        into = _dests(mine, ref)
        load_weights(tmp_path, into, names=ref)
        assert all(torch.equal(into[n], ref[n]) for n in mine)


@settings(max_examples=15, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    limit=st.integers(1, 400),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
)
def test_round_trip_any_shard_size(sizes: list[int], limit: int, dtype: torch.dtype) -> None:
    import tempfile

    tensors = {f"t.{i}": torch.arange(n).to(dtype) for i, n in enumerate(sizes)}
    with tempfile.TemporaryDirectory() as out:
        report = save_safetensors(tensors, out, max_shard_bytes=limit)
        per_file: dict[str, list[int]] = {}
        for info in checkpoint_index(out).values():
            per_file.setdefault(info.files[0], []).append(info.nbytes)
        assert len(per_file) == len(report.files) - (len(report.files) > 1)  # shards, then the index
        assert all(sum(sizes) <= limit or len(sizes) == 1 for sizes in per_file.values())
        back = {k: torch.full_like(t, 7) for k, t in tensors.items()}
        load_weights(out, back, names=tensors)
        assert all(torch.equal(back[k], tensors[k]) for k in tensors)
        assert not [p for p in os.listdir(out) if p.startswith(".pipecut")]


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("shard_bytes", [10**9, 20_000])
def test_export_loads_in_transformers(tie: bool, shard_bytes: int, tmp_path: Path) -> None:
    from partitioner.tracing.trace import CausalLMLogits

    transformers = pytest.importorskip("transformers")
    model = _llama(tie, seed=3)
    model.config.save_pretrained(tmp_path)
    report = save_safetensors(CausalLMLogits(model).state_dict(), tmp_path, prefix="model.",
                              max_shard_bytes=shard_bytes)
    assert dict(report.tied) == ({"model.lm_head.weight": "model.model.embed_tokens.weight"} if tie else {})
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_export_is_atomic_and_refuses_to_overwrite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _toy_state()
    save_safetensors(ref, tmp_path)
    with pytest.raises(errors.WeightsError, match=r"already holds a checkpoint.*overwrite=True"):
        save_safetensors(ref, tmp_path)
    real = os.replace

    def crash_on_index(src: Any, dst: Any) -> None:
        if str(dst).endswith(".index.json"):
            raise OSError("disk full")
        real(src, dst)

    monkeypatch.setattr(weight_export.os, "replace", crash_on_index)
    with pytest.raises(OSError, match="disk full"):
        save_safetensors(ref, tmp_path, max_shard_bytes=200, overwrite=True)
    # The shards are in place, but without their index nothing loads as a whole checkpoint.
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".pipecut")]
    with pytest.raises(errors.WeightsSourceError, match="no index: an interrupted export"):
        load_weights(tmp_path, {}, names=ref)
    monkeypatch.setattr(weight_export.os, "replace", real)
    save_safetensors(ref, tmp_path, max_shard_bytes=200, overwrite=True)
    assert set(checkpoint_index(tmp_path)) == set(ref)


def test_export_refusals(tmp_path: Path) -> None:
    with pytest.raises(errors.WeightsError, match=r"lacking the prefix 'model.'"):
        save_safetensors({"x": torch.ones(1)}, tmp_path, prefix="model.")
    with pytest.raises(errors.WeightsError, match="meta device"):
        save_safetensors({"x": torch.empty(1, device="meta")}, tmp_path)


def test_export_views_of_one_buffer(tmp_path: Path) -> None:
    """Slices and transposes of one tensor share memory, which safetensors refuses; they are copied."""
    base = torch.arange(12.0).reshape(3, 4)
    tensors = {"a": base[0], "b": base[1:], "c": base.t()}
    save_safetensors(tensors, tmp_path)
    back = {k: torch.zeros_like(t) for k, t in tensors.items()}
    load_weights(tmp_path, back, names=tensors)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)

