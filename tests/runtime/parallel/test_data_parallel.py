"""Data x pipeline parallelism: 2 replicas of a 2-rank pipeline on 4 gloo processes train exactly
as the unpartitioned model on the global batch (loss, every gradient, clipped steps, checkpoints)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partitioner.search import LayoutSearch
from profiles import LONG, in_profile
from rank_pool import Cases, spawn
from runtime.execute.accumulation import add_back, set_aside
from runtime.parallel.data_parallel import GradAverager
from runtime.transport.placement import PlacementError
from tests.runtime.parity import (
    TOL,
    _fresh,
    _fresh_y,
    backward_against_plain,
    case,
    check_grads,
    make_trainer,
    plan_once,
    reference_grads,
    step_failure,
)

SCHEDULES = ["gpipe", "1f1b", "zbh1"]


def _dp_case(name: str, schedule: str, dp: int, pp: int, tmp: str | None, overlap: bool,
             shard: bool = False, *, searches: dict[tuple[str, int], LayoutSearch] | None = None) -> dict[str, Any]:
    """One (model, schedule) on this rank: forward_backward, then 2 clipped SGD steps, then a
    checkpoint loaded into the plain model; each compared with the unpartitioned model.
    ``searches``: GPT-2 traced once per process (``parity.plan_once``)."""
    import torch.distributed as dist

    c = case(name, pp)
    if searches is not None:
        plan_once(c, name, pp, schedule, searches)
    ref = copy.deepcopy(c["model"])
    opt = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    trainer = make_trainer(c, pp, schedule, transport="dist", optimizer=opt, data_parallel=dp,
                           overlap_grad_reduce=overlap, record=True, shard_optimizer=shard)
    gen = torch.Generator().manual_seed(7)  # the same global batch on every rank
    rows = dp * c["x"].shape[0]
    fresh = lambda: (_fresh({"x": c["x"].new_empty(rows, *c["x"].shape[1:])}, gen),  # noqa: E731
                     _fresh_y({"y": c["y"].new_empty(rows, *c["y"].shape[1:])}, gen))
    x, y = fresh()
    loss = trainer.forward_backward(*trainer.local_batch(x, y))
    want_loss, want = reference_grads(c, ref, x, y)
    torch.testing.assert_close(loss, want_loss, **TOL)
    if shard:  # each parameter's gradient is kept by its owner only
        owned = {id(p) for p in trainer._replicas.owned}
        held = {n for n, p in trainer.named_parameters() if p.grad is not None}
        assert held == {n for n, p in trainer.named_parameters() if id(p) in owned}
        checked = sorted(held)
        for n in checked:
            torch.testing.assert_close(dict(trainer.named_parameters())[n].grad, want[n], **TOL)
    else:
        checked = check_grads(trainer, want)

    ref_opt = opt(list(ref.parameters()))
    norms = []
    for _ in range(2):
        x, y = fresh()
        trainer.step(*trainer.local_batch(x, y), max_norm=0.5)
        ref_opt.zero_grad()
        c["loss"](ref(x), y).backward()
        norms.append((float(trainer.last_grad_norm), float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))))
        ref_opt.step()
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for pname, prm in trainer.named_parameters():
        torch.testing.assert_close(prm.detach(), ref_params[pname].detach(), **TOL,
                                   msg=lambda m, pname=pname: f"{pname}: {m}")
    state = sum(t.numel() for st in trainer.optimizer.state.values() for t in st.values()
                if isinstance(t, torch.Tensor)) if trainer.optimizer is not None else 0
    out: dict[str, Any] = {"checked": checked, "loss": float(loss), "norms": norms, "state": state,
                           "params": sum(p.numel() for p in trainer.parameters()),
                           "dp_rank": trainer.mesh.dp_rank, "pp_rank": trainer.mesh.pp_rank,
                           "tied_groups": len(trainer._tied)}
    if tmp is not None:
        trainer.save(Path(tmp) / "ckpt")
        trainer.export_safetensors(Path(tmp) / "hf")
        out["trace"] = trainer.save_trace(Path(tmp) / "trace.json") is not None
        if dist.get_rank() == 0:
            from runtime.state.checkpoint import load_model

            plain = copy.deepcopy(c["model"])
            load_model(plain, Path(tmp) / "ckpt")
            for n, prm in plain.named_parameters():
                torch.testing.assert_close(prm, ref_params[n].detach(), **TOL)
        if shard:  # a sharded save resumes unsharded: every rank gets every parameter's momentum
            # (partitioned anew: its own tensors, not the traced-once model the trainer above holds)
            full = make_trainer(case(name, pp), pp, schedule, transport="dist", optimizer=opt, data_parallel=dp)
            full.load(Path(tmp) / "ckpt")
            assert full.optimizer is not None and trainer.optimizer is not None
            mine = {id(p): n for n, p in trainer.named_parameters()}
            theirs = dict(full.named_parameters())
            assert len(full.optimizer.state) == len(list(full.parameters()))
            for p, st in trainer.optimizer.state.items():
                loaded = full.optimizer.state[theirs[mine[id(p)]]]["momentum_buffer"]
                torch.testing.assert_close(loaded, st["momentum_buffer"], rtol=0, atol=0)
            for n, p in theirs.items():
                torch.testing.assert_close(p.detach(), ref_params[n].detach(), **TOL)
    return out


# Every data-parallel run of this file, each on 4 ranks of the pool (2 replicas x 2 stages):
# label: (model, schedule, all-reduce overlapped with the drain, optimizer state sharded, writes
# a checkpoint, an export and a trace into its own folder).
_RUNS: dict[str, tuple[str, str, bool, bool, bool]] = {
    **{f"gpt2/{s}": ("gpt2", s, True, False, s == SCHEDULES[0]) for s in SCHEDULES},
    "mlp/1f1b": ("mlp", "1f1b", True, False, False),
    "after the step/gpt2/1f1b": ("gpt2", "1f1b", False, False, True),
    "sharded/gpt2/zbh1": ("gpt2", "zbh1", True, True, True),
}
# The replicated runs the default profile checks: GPT-2 under GPipe (which writes the files) and 1F1B;
# ZB-H1's deferred weight gradients with replicas are checked sharded in the default profile, and
# these two replicated in the long one.
_REPLICATED_LONG = ["gpt2/zbh1", "mlp/1f1b"]
_REPLICATED = list(in_profile(dict.fromkeys(label for label, (*_, overlap, shard, _files) in _RUNS.items()
                                            if overlap and not shard), _REPLICATED_LONG))


def _folder(tmp: Path, label: str) -> Path:
    return tmp / label.replace("/", "-").replace(" ", "-")


_SEARCHES: dict[tuple[str, int], LayoutSearch] = {}  # GPT-2 traced once per part, for each run in it


def _dp_part(rank: int, world: int, key: str, tmp: str) -> Any:
    """One part of the file's matrix on this rank: a run of ``_RUNS``, the refusal, or
    ``_combined_worker``'s runs (each asked for by the tests that check it)."""
    _SEARCHES.clear()  # a part is a process group of its own: nothing of the last one's trainers is kept
    if key in _RUNS:
        name, schedule, overlap, shard, files = _RUNS[key]
        where = str(_folder(Path(tmp), key)) if files else None
        return _dp_case(name, schedule, 2, world // 2, where, overlap, shard, searches=_SEARCHES)
    if key == "refused":
        try:
            make_trainer(case("mlp", 2), 2, "1f1b", transport="dist", data_parallel=3)
            return ""
        except PlacementError as e:
            return str(e)
    assert key == "combined", key
    return _combined_worker(rank, world, _SEARCHES)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> tuple[Cases, Path]:
    """The file's runs (``_dp_part``), each run on 4 ranks of the test process's pool when a test
    first asks for it, and the folder the runs write into."""
    tmp = tmp_path_factory.mktemp("dp")
    for label, (*_, files) in _RUNS.items():
        if files:
            _folder(tmp, label).mkdir()
    return Cases(_dp_part, 4, str(tmp), timeout=600), tmp


@pytest.mark.multiprocess
def test_two_replicas_of_a_two_rank_pipeline_equal_the_plain_model(replicas: tuple[Cases, Path]) -> None:
    cases, tmp = replicas
    results = cases.ranks(["gpt2/1f1b", *_REPLICATED, "refused"])
    assert [(r["gpt2/1f1b"]["dp_rank"], r["gpt2/1f1b"]["pp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert ["gpt2/gpipe", "gpt2/1f1b", *(_REPLICATED_LONG if LONG else [])] == _REPLICATED
    for key in _REPLICATED:
        # The same loss and norms everywhere; both ranks of each replica checked their stages.
        assert len({round(r[key]["loss"], 6) for r in results}) == 1, key
        for r in results:
            for got, want in r[key]["norms"]:
                assert got == pytest.approx(want, rel=1e-5), key
        assert set(results[0][key]["checked"]) | set(results[1][key]["checked"]) == \
            set(results[2][key]["checked"]) | set(results[3][key]["checked"])
    # GPT-2's tied embedding spans both ranks of each replica: one group per process.
    assert [r["gpt2/gpipe"]["tied_groups"] for r in results] == [1, 1, 1, 1]
    assert [r["gpt2/gpipe"]["trace"] for r in results] == [True, False, False, False]
    tmp_path = _folder(tmp, "gpt2/gpipe")
    assert (tmp_path / "trace.json").is_file() and (tmp_path / "ckpt" / ".metadata").is_file()
    # The first replica's two ranks write the export; the copies in the second are not written again.
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
        "pipecut-manifest.json"]
    assert "--nproc-per-node 6" in results[0]["refused"] and "4 processes" in results[0]["refused"]


@pytest.mark.multiprocess
def test_all_reduce_after_the_step_gives_the_same_gradients(replicas: tuple[Cases, Path]) -> None:
    cases, tmp = replicas
    assert len({round(r["loss"], 6) for r in cases("after the step/gpt2/1f1b")}) == 1
    assert (_folder(tmp, "after the step/gpt2/1f1b") / "ckpt" / ".metadata").is_file()


@pytest.mark.multiprocess
def test_sharded_optimizer_state_steps_exactly_and_halves_the_state(replicas: tuple[Cases, Path]) -> None:
    # ZeRO-style: the two replicas' ranks of each stage split its parameters; each keeps the
    # momentum of its share, the gradients of its share, and broadcasts its new values.
    r = replicas[0]("sharded/gpt2/zbh1")
    for pp in (0, 1):  # ranks pp and 2 + pp hold the same stages
        a, b = r[pp], r[2 + pp]
        assert a["params"] == b["params"] and a["state"] + b["state"] == a["params"]
        assert max(a["state"], b["state"]) <= 0.75 * a["params"]
        assert not set(a["checked"]) & set(b["checked"])  # each gradient kept by one owner


def test_data_parallel_in_one_process_is_refused_with_the_equivalent() -> None:
    with pytest.raises(PlacementError, match="microbatches=8"):
        make_trainer(case("mlp", 2), 2, "1f1b", data_parallel=2)


@pytest.mark.parametrize("overlap", [True, False])
def test_averager_waits_for_every_holder_and_buckets_by_size(overlap: bool) -> None:
    # One replica: the bucketing, the order and the accumulation are what is tested.
    a, b, shared = (nn.Parameter(torch.ones(n)) for n in (4, 300, 2))
    a.grad = torch.full_like(a, 10.0)  # from an earlier forward_backward: set aside, added back
    avg = GradAverager({0: [a, shared], 1: [b, shared]}, None, 1, bucket_bytes=64 * 4, overlap=overlap)
    aside = set_aside([a, b, shared])  # what the trainer does around every call
    assert a.grad is None
    for prm, g in ((a, 2.0), (b, 3.0), (shared, 5.0)):
        prm.grad = torch.full_like(prm, g)
    avg.stage_done(0)  # the shared weight waits for stage 1
    assert [p for bucket, _, _, _ in avg._sent for p in bucket] == ([a] if overlap else [])
    avg.stage_done(1)
    assert len(avg._sent) == (3 if overlap else 0)  # b alone exceeds the bucket
    avg.finish()
    add_back(aside)
    assert a.grad.tolist() == [12.0] * 4 and b.grad.eq(3.0).all() and shared.grad.tolist() == [5.0, 5.0]
    assert avg._sent == [] and avg._left == {id(a): 1, id(shared): 2, id(b): 1}  # ready for the next step


def test_owners_are_balanced_and_the_same_everywhere() -> None:
    from hypothesis import given
    from hypothesis import strategies as st

    from runtime.parallel.zero import assign_owners

    @given(st.lists(st.integers(1, 1000), max_size=40), st.integers(1, 6))
    def check(sizes: list[int], dp: int) -> None:
        owners = assign_owners(sizes, dp)
        assert owners == assign_owners(list(sizes), dp) and all(0 <= d < dp for d in owners)
        loads = [sum(n for n, d in zip(sizes, owners) if d == k) for k in range(dp)]
        if sizes:  # longest-processing-time-first: no load exceeds the mean by more than the largest
            assert max(loads) <= sum(sizes) / dp + max(sizes)

    check()


# Every feature combined with data parallelism: (schedule, trainer options, autocast dtype).
COMBINED = [
    ("zbv", {"recompute": True, "shard_optimizer": True}, None),
    ("interleaved", {"recompute": True, "precision": "bf16-uncast"}, torch.bfloat16),
    ("1f1b", {"shard_optimizer": True, "precision": "fp16-uncast"}, torch.float16),
]


def _combined_worker(
    rank: int, world: int, searches: dict[tuple[str, int], LayoutSearch] | None = None
) -> list[float]:
    from runtime.precision import MixedPrecision

    errors = []
    for schedule, opts, dtype in COMBINED:
        kw = dict(opts)
        if str(kw.get("precision", "")).endswith("-uncast"):  # the wire keeps autocast's dtypes
            kw["precision"] = MixedPrecision(kw["precision"].split("-")[0], cast_activations=False)
        pp = world // 2
        stages = 2 * pp if schedule in ("zbv", "interleaved") else pp
        c = case("gpt2", stages)
        if searches is not None:
            plan_once(c, "gpt2", stages, schedule, searches)
        ref = copy.deepcopy(c["model"])
        trainer = make_trainer(c, stages, schedule, transport="dist", data_parallel=2,
                               optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), **kw)
        want = backward_against_plain(trainer, c, ref, dtype)
        worst = 0.0
        held = [(n, p) for n, p in trainer.named_parameters() if p.grad is not None]
        assert held, "this rank kept no gradient"
        for n, p in held:
            worst = max(worst, float((p.grad - want[n]).abs().max() / want[n].abs().max()))
        errors.append(worst)
    return errors


@pytest.mark.multiprocess
def test_data_parallel_with_recomputation_sharding_and_mixed_precision(
    replicas: tuple[Cases, Path]
) -> None:
    # ZB-V and interleaved (two stages per rank) with recomputation, sharded optimizer state, bf16
    # and fp16 with loss scaling: each rank's kept gradients equal the plain model's (under the
    # same autocast, over the same micro-batches) on the global batch. In the shared spawn.
    results = replicas[0]("combined")
    assert len(results) == 4
    for errors in results:
        assert errors[0] < 1e-5  # fp32
        assert errors[1] < 1e-5 and errors[2] < 1e-5  # wire in the autocast dtypes: round-off only


def _one_replica_fails(rank: int, world: int) -> dict[str, str]:
    c = case("mlp", 2)
    trainer = make_trainer(c, 2, "1f1b", transport="dist", data_parallel=2, timeout=60)
    x, y = torch.randn(16, 16), torch.randn(16, 8)
    x, y = trainer.local_batch(x, y)
    if rank == 3:  # replica 1's last stage: targets of the wrong width fail in its loss
        y = y[:, :3]
    return step_failure(trainer, x, y)


@pytest.mark.multiprocess
def test_a_failing_replica_is_named_by_every_other_rank() -> None:
    # Rank 3 fails; rank 2 (its pipeline) stops waiting for its gradients, and the first replica's
    # ranks stop waiting in the gradient exchange: all say so and quote rank 3's error, none hangs.
    results = spawn(_one_replica_fails, 4, timeout=180)
    assert results[3]["type"] == "StageError", results[3]
    quoted = "The first rank to fail reported: rank 3 failed: StageError"
    for rank in (0, 1, 2):
        assert results[rank]["type"] == "PeerFailed", (rank, results[rank])
        assert quoted in results[rank]["message"], (rank, results[rank]["message"])
    assert "data-parallel exchange" in results[1]["message"]
