"""FSDP2 as the data-parallel engine: 2 replicas of a 2-rank pipeline on 4 gloo processes, each
stage's parameters sharded over its 2 replicas, train exactly as the unpartitioned model on the
global batch (loss, clipped AdamW steps, every parameter after them)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from partitioner.search import LayoutSearch
from profiles import long_only
from rank_pool import Cases
from runtime.options import DataParallel
from tests.runtime.parity import (
    TOL,
    _fresh,
    _fresh_y,
    backward_against_plain,
    case,
    make_trainer,
    plan_once,
    reference_grads,
)

# GPT-2 traced once per part of the matrix (torch.export, ~0.6 s a trace) and planned from that for every
# case whose trainer is the only one alive (``parity.plan_once``); the trainers a checkpoint is loaded
# into, built beside the saving one, partition anew and hold their own tensors.
_SEARCHES: dict[tuple[str, int], LayoutSearch] = {}


def cut_inside(plan: Any, block: str, where: str) -> Any:
    """``plan`` (two stages) cut inside ``block`` instead, as a cut at node granularity may fall:
    ``where='tail'``: the second stage begins after the block's last node that reads one of its
    weights (it holds only the block's residual add and such, none of its weights);
    ``'mid'``: at the block's second half (``.mlp``: each stage holds a part of its weights)."""
    from runtime.parallel.blocks import _path

    gm = plan.traced.gm
    stage_of = plan.stage_of()
    nodes = [n for n in gm.graph.nodes if n.name in stage_of]
    inside = [i for i, n in enumerate(nodes) if _path(n) == block or _path(n).startswith(block + ".")]
    if where == "tail":
        k = 1 + max(i for i in inside if any(a.op == "get_attr" for a in nodes[i].all_input_nodes))
    else:
        k = min(i for i in inside if _path(nodes[i]).startswith(block + ".mlp"))
    names = [n.name for n in nodes]
    first, second = plan.stages
    return dataclasses.replace(plan, stages=(dataclasses.replace(first, nodes=tuple(names[:k])),
                                             dataclasses.replace(second, nodes=tuple(names[k:]))))


def _fsdp_case(name: str, schedule: str, dp: int, ranks: int, folder: str | None = None, **opts: Any) -> dict[str, Any]:
    """One (model, schedule) on this rank: forward_backward, then 2 clipped AdamW steps, each
    compared with the unpartitioned model; the parameters gathered from their shards at the end."""
    from torch.distributed.tensor import DTensor

    reshard = opts.pop("reshard_after_forward", True)
    cut = opts.pop("cut", None)
    stages = 2 * ranks if schedule in ("interleaved", "zbv") else ranks
    c = case(name, stages)
    plan_once(c, name, stages, schedule, _SEARCHES)
    if cut is not None:
        c["plan"] = cut_inside(c["plan"], *cut)
    ref = copy.deepcopy(c["model"])
    # Adam divides by sqrt(v): on a gradient near 0 the round-off of another summation order (the
    # reduce-scatter's) becomes a visible step. eps=1e-6 bounds that amplification to TOL.
    opt = lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, eps=1e-6)  # noqa: E731
    trainer = make_trainer(c, stages, schedule, transport="dist", optimizer=opt,
                           data_parallel=DataParallel(size=dp, engine="fsdp", reshard_after_forward=reshard), **opts)
    held = dict((c["plan"].model if "plan" in c else c["model"]).named_parameters(remove_duplicate=False))
    # The shards are the weights: the planned model keeps no whole copy of this rank's (meta instead).
    whole_left = [n for n, _ in trainer.named_parameters() if n in held and not held[n].is_meta]
    gen = torch.Generator().manual_seed(7)  # the same global batch on every rank
    rows = dp * c["x"].shape[0]
    fresh = lambda: (_fresh({"x": c["x"].new_empty(rows, *c["x"].shape[1:])}, gen),  # noqa: E731
                     _fresh_y({"y": c["y"].new_empty(rows, *c["y"].shape[1:])}, gen))
    x, y = fresh()
    with _counting_all_gathers() as gathers:
        loss = trainer.forward_backward(*trainer.local_batch(x, y))
    want_loss, want = reference_grads(c, ref, x, y)
    torch.testing.assert_close(loss, want_loss, **TOL)
    checked = []
    for n, prm in trainer.named_parameters():
        assert isinstance(prm, DTensor), n
        assert prm.grad is not None, f"{n} got no gradient"
        torch.testing.assert_close(prm.grad.full_tensor(), want[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
        checked.append(n)
    ref_opt = opt(list(ref.parameters()))
    norms, losses = [], []
    for _ in range(2):
        x, y = fresh()
        losses.append(float(trainer.step(*trainer.local_batch(x, y), max_norm=0.5)))
        ref_opt.zero_grad()
        ref_loss = c["loss"](ref(x), y)
        ref_loss.backward()
        norms.append((float(trainer.last_grad_norm), float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))))
        ref_opt.step()
        assert losses[-1] == pytest.approx(float(ref_loss.detach()), rel=1e-5)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for n, prm in trainer.named_parameters():
        torch.testing.assert_close(prm.detach().full_tensor(), ref_params[n].detach(), **TOL,
                                   msg=lambda m, n=n: f"{n}: {m}")
    out: dict[str, Any] = {}
    if folder is not None:
        out["checkpoint"] = _round_trip(trainer, name, schedule, stages, dp, opt, Path(folder), ref_params, fresh)
    local = sum(p.to_local().numel() for p in trainer.parameters())
    whole = sum(p.numel() for p in trainer.parameters())
    from torch.distributed.fsdp import FSDPModule

    units = [m for st in trainer.stages.values() for m in st.module.modules() if isinstance(m, FSDPModule)]
    return {**out, "gathers": gathers[0], "stages_here": len(trainer.stages), "units_here": len(units),
            "blocks_here": len(units) - len(trainer.stages), "checked": checked, "norms": norms,
            "local": local, "whole": whole, "whole_left": whole_left,
            "dp_rank": trainer.mesh.dp_rank, "pp_rank": trainer.mesh.pp_rank}


@contextlib.contextmanager
def _counting_all_gathers() -> Iterator[list[int]]:
    """Count FSDP's parameter all-gathers within (one per FSDP unit gathered)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    count = [0]
    real = group.foreach_all_gather

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return real(*args, **kwargs)

    group.foreach_all_gather = counted
    try:
        yield count
    finally:
        group.foreach_all_gather = real


def _full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor: a DTensor gathered from its shards, else itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _round_trip(trainer: Any, name: str, schedule: str, stages: int, dp: int, opt: Any, folder: Path,
                ref_params: dict[str, torch.Tensor], fresh: Any) -> list[str]:
    """Save under FSDP and export safetensors; load the export as an FSDP trainer's weights, the
    checkpoint into the plain model, into a new FSDP trainer (which then steps as the saved one
    does), into the home-made engine's and into an FSDP trainer of another plan; returns what
    was checked."""
    import torch.distributed as dist

    from runtime.state.checkpoint import load_model

    trainer.save(folder / "ckpt")
    trainer.export_safetensors(folder / "hf")  # gathered from the shards, written by the first replica
    done = []
    loaded = make_trainer(case(name, stages), stages, schedule, transport="dist", optimizer=opt,
                          data_parallel=DataParallel(size=dp, engine="fsdp"), weights=folder / "hf")
    for n, p in loaded.named_parameters():  # each rank read its stages and kept its shards
        torch.testing.assert_close(p.detach().full_tensor(), ref_params[n].detach(), **TOL)
    done.append("weights")
    if dist.get_rank() == 0:
        plain = copy.deepcopy(case(name, stages)["model"])
        load_model(plain, folder / "ckpt")
        for n, prm in plain.named_parameters():
            torch.testing.assert_close(prm, ref_params[n].detach(), **TOL)
        done.append("plain model")
    mine = {n: trainer.optimizer.state[p]["exp_avg"].full_tensor() for n, p in trainer.named_parameters()}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)  # another plan puts other parameters on this rank
    moments = {n: t for part in every for n, t in part.items()}
    # Another engine, another plan (interleaved: twice the stages, two per rank), and the saved
    # plan under FSDP again, built last: it then steps as the saved trainer does.
    for engine, plan in (("replicate", schedule), ("fsdp", "interleaved"), ("fsdp", schedule)):
        n_stages = 2 * stages if plan == "interleaved" else stages
        again = make_trainer(case(name, n_stages), n_stages, plan, transport="dist", optimizer=opt,
                             data_parallel=DataParallel(size=dp, engine=engine))
        again.load(folder / "ckpt")
        assert again.step_count == trainer.step_count
        for n, p in again.named_parameters():
            torch.testing.assert_close(_full(p.detach()), ref_params[n].detach(), **TOL)
            torch.testing.assert_close(_full(again.optimizer.state[p]["exp_avg"]), moments[n], rtol=0, atol=0)
        done.append(f"{engine} {plan}")
    resumed = again  # FSDP, the saved plan, the checkpoint loaded
    x, y = fresh()
    a = trainer.step(*trainer.local_batch(x, y), max_norm=0.5)
    b = resumed.step(*resumed.local_batch(x, y), max_norm=0.5)
    assert float(a) == float(b)
    mine = dict(resumed.named_parameters())
    for n, p in trainer.named_parameters():
        torch.testing.assert_close(mine[n].full_tensor(), p.full_tensor(), rtol=0, atol=0)
    done.append("resumed")
    return done


# Every FSDP run of this file, in one spawn of 4 processes (2 replicas x 2 ranks):
# label: (model, schedule, options).
_RUNS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2/1f1b": ("gpt2", "1f1b", {}),
    "gpt2/1f1b/gathered": ("gpt2", "1f1b", {"reshard_after_forward": False}),
    "gpt2/zbh1/gathered": ("gpt2", "zbh1", {"reshard_after_forward": False}),
    "gpt2/zbh1": ("gpt2", "zbh1", {}),
    "gpt2/gpipe": ("gpt2", "gpipe", {}),
    "gpt2/interleaved": ("gpt2", "interleaved", {}),
    "mlp/zbv": ("mlp", "zbv", {}),
    "gpt2/zbh1/unfused": ("gpt2", "zbh1", {"fuse_wgrad": False}),
    # Micro-batches of 4 rows from a plan traced on 2: shapes found on the sharded model's graph.
    "mlp-mb4/1f1b": ("mlp-mb4", "1f1b", {}),
}

# A block the cut splits between the stages (GPT-2 at node granularity): label: (model, schedule,
# options). Run in the file's one spawn too.
_CUT_RUNS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2/1f1b/tail-of-h.1": ("gpt2", "1f1b", {"cut": ("model.transformer.h.1", "tail")}),
    "gpt2/gpipe/gathered/tail-of-h.1": ("gpt2", "gpipe", {"cut": ("model.transformer.h.1", "tail"),
                                                          "reshard_after_forward": False}),
}


# Left to the long profile: combinations of behaviours the default runs apart (kept gathered, split
# backward), GPipe's order (the cut runs below run it), every W apart from its I (ZB-H1 defers some),
# and the schedules and options another default run already takes under FSDP: weights kept gathered
# (the GPipe cut run), ZB-H1's split backward (with recomputation below), interleaved (with
# recomputation and bf16 below).
_LONG_RUNS = ("gpt2/zbh1/gathered", "gpt2/gpipe", "gpt2/zbh1/unfused", "gpt2/1f1b/gathered", "gpt2/zbh1",
              "gpt2/interleaved", "gpt2/1f1b/fp16")



# Features combined with FSDP: (schedule, trainer options, autocast dtype); gradients after one
# forward_backward against the plain model under the same autocast over the same micro-batches.
COMBINED: dict[str, tuple[str, str, dict[str, Any], torch.dtype | None]] = {
    "gpt2/interleaved/recompute/bf16": ("gpt2", "interleaved", {"recompute": True, "precision": "bf16-uncast"},
                                        torch.bfloat16),
    "gpt2/1f1b/fp16": ("gpt2", "1f1b", {"precision": "fp16-uncast"}, torch.float16),
    "gpt2/zbh1/recompute": ("gpt2", "zbh1", {"recompute": True}, None),
    # Weights gathered in bf16 (FSDP's MixedPrecisionPolicy): a lossy option, bf16 round-off
    # expected. An MLP: on CPU, autocast leaves layer_norm to its inputs' dtype, and torch's CPU
    # layer_norm refuses bf16 weights beside a residual stream autocast keeps in fp32.
    "mlp/zbh1/bf16-gathered": ("mlp", "zbh1", {"precision": "bf16-gathered"}, torch.bfloat16),
}


def _combined(name: str, schedule: str, opts: dict[str, Any], dtype: torch.dtype | None,
              ranks: int) -> tuple[float, list[str]]:
    """The worst relative gradient error against the plain model (under ``dtype``'s autocast),
    and the dtypes FSDP gathered the weights in."""
    from runtime.precision import MixedPrecision

    kw = dict(opts)
    if str(kw.get("precision", "")).endswith("-uncast"):  # the wire keeps autocast's dtypes
        kw["precision"] = MixedPrecision(kw["precision"].split("-")[0], cast_activations=False)
    elif str(kw.get("precision", "")).endswith("-gathered"):
        kw["precision"] = MixedPrecision(kw["precision"].split("-")[0], cast_activations=False,
                                         gather_low_precision=True)
    stages = 2 * ranks if schedule in ("zbv", "interleaved") else ranks
    c = case(name, stages)
    plan_once(c, name, stages, schedule, _SEARCHES)
    ref = copy.deepcopy(c["model"])
    trainer = make_trainer(c, stages, schedule, transport="dist", data_parallel=DataParallel(size=2, engine="fsdp"),
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), **kw)
    want = backward_against_plain(trainer, c, ref, dtype)
    worst = 0.0
    for n, p in trainer.named_parameters():
        assert p.grad is not None, n
        assert p.dtype == p.grad.dtype == torch.float32, n  # shards, gradients (and the optimizer) stay fp32
        g = p.grad.full_tensor()
        worst = max(worst, float((g - want[n]).abs().max() / want[n].abs().max()))
    from runtime.parallel.fsdp import _fsdp_params

    gathered = {fp._unsharded_param.dtype for st in trainer.stages.values() for fp in _fsdp_params(st.module)}
    return worst, sorted(str(d) for d in gathered)


def _accumulated(ranks: int) -> float:
    """Two forward_backward calls before a step add up as the plain model's gradients of both
    batches (each call's own are reduced, then the earlier ones added back)."""
    c = case("gpt2", ranks)
    plan_once(c, "gpt2", ranks, "zbh1", _SEARCHES)
    ref = copy.deepcopy(c["model"])
    trainer = make_trainer(c, ranks, "zbh1", transport="dist", data_parallel=DataParallel(size=2, engine="fsdp"),
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    gen = torch.Generator().manual_seed(5)
    want: dict[str, torch.Tensor] = {}
    for _ in range(2):
        x = _fresh({"x": c["x"].new_empty(16, 8)}, gen)
        y = _fresh_y({"y": c["y"].new_empty(16, 8)}, gen)
        trainer.forward_backward(*trainer.local_batch(x, y))
        for n, g in reference_grads(c, ref, x, y)[1].items():
            want[n] = want[n] + g if n in want else g
    worst = 0.0
    for n, p in trainer.named_parameters():
        assert p.grad is not None, n
        worst = max(worst, float((p.grad.full_tensor() - want[n]).abs().max() / want[n].abs().max()))
    return worst


def _refusals(ranks: int) -> dict[str, str]:
    """The messages of what FSDP refuses (every rank refuses alike, before any weight moves)."""
    out = {}
    c = case("gpt2", 2 * ranks)
    plan_once(c, "gpt2", 2 * ranks, "zbv", _SEARCHES)
    try:  # ZB-V puts the tied embedding's two stages on rank 0
        make_trainer(c, 2 * ranks, "zbv", transport="dist", data_parallel=DataParallel(size=2, engine="fsdp"))
        out["zbv"] = ""
    except Exception as e:
        out["zbv"] = f"{type(e).__name__}: {e}"
    c = case("mlp", ranks)
    make_trainer(c, ranks, "1f1b", transport="dist", data_parallel=DataParallel(size=2, engine="fsdp"))
    try:  # a second trainer on the model the first took the weights of (meta now), without weights=
        make_trainer(c, ranks, "1f1b", transport="dist", data_parallel=DataParallel(size=2))
        out["again"] = ""
    except Exception as e:
        out["again"] = f"{type(e).__name__}: {e}"
    c = case("mlp", ranks)
    model = c["model"]
    try:  # the factory ignores the shards it is given
        make_trainer(c, ranks, "1f1b", transport="dist", data_parallel=DataParallel(size=2, engine="fsdp"),
                     optimizer=lambda ps: torch.optim.SGD(model.parameters(), lr=0.1))
        out["optimizer"] = ""
    except Exception as e:
        out["optimizer"] = f"{type(e).__name__}: {e}"
    return out


def _part(rank: int, world: int, key: str, tmp: str) -> Any:
    """One part of the file's matrix on this rank: a run of ``_RUNS``/``_CUT_RUNS``, a feature of
    ``COMBINED``, or one of the checks named below (each a test's own case on the module's pool)."""
    import traceback

    ranks = world // 2
    # A part is a process group of its own: the traced model the last part's FSDP trainer wrapped
    # holds that group's mesh in its modules' FSDP state, so each part traces anew (~0.6 s).
    _SEARCHES.clear()
    try:
        if key in _RUNS or key in _CUT_RUNS:
            name, schedule, opts = {**_RUNS, **_CUT_RUNS}[key]
            where = str(Path(tmp) / key.replace("/", "-")) if key in _SAVED else None
            return _fsdp_case(name, schedule, 2, ranks, where, **opts)
        if key in COMBINED:
            name, schedule, opts, dtype = COMBINED[key]
            worst, gathered = _combined(name, schedule, opts, dtype, ranks)
            return {"worst": worst, "gathered": gathered}
        return {"refused": _refusals, "peak gathered": _peak_gathered, "accumulated": _accumulated,
                "reset before a forward": _reset_before_a_forward}[key](ranks)
    except Exception as e:  # reported by the test, with the label
        return {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}


def _peak_gathered(ranks: int) -> dict[str, Any]:
    """Under 1F1B (ZeRO-3), the most weight bytes FSDP held gathered at once on this rank, a stage
    of 4 GPT-2 blocks, and the bytes of each of its FSDP units (the stage's own: key '')."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as G

    from partitioner.zoo import gpt2

    live: dict[int, int] = {}
    peak = [0]
    unshard, reshard = G.FSDPParamGroup.unshard, G.FSDPParamGroup.reshard

    def counted_unshard(self: Any, *a: Any, **k: Any) -> Any:
        live[id(self)] = sum(fp._orig_size.numel() * 4 for fp in self.fsdp_params)
        peak[0] = max(peak[0], sum(live.values()))
        return unshard(self, *a, **k)

    def counted_reshard(self: Any, *a: Any, **k: Any) -> Any:
        live.pop(id(self), None)
        return reshard(self, *a, **k)

    c = case("gpt2", ranks)
    torch.manual_seed(0)
    c["model"], _ = gpt2(n_layer=4 * ranks, n_embd=32, n_head=2, vocab_size=64, n_positions=16, batch=2, seq=8)
    trainer = make_trainer(c, ranks, "1f1b", transport="dist", optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                           data_parallel=DataParallel(size=2, engine="fsdp"))
    gen = torch.Generator().manual_seed(7)
    x = _fresh({"x": c["x"].new_empty(16, *c["x"].shape[1:])}, gen)
    y = _fresh_y({"y": c["y"].new_empty(16, *c["y"].shape[1:])}, gen)
    G.FSDPParamGroup.unshard, G.FSDPParamGroup.reshard = counted_unshard, counted_reshard  # type: ignore[method-assign]
    try:
        trainer.step(*trainer.local_batch(x, y))
    finally:
        G.FSDPParamGroup.unshard, G.FSDPParamGroup.reshard = unshard, reshard  # type: ignore[method-assign]
    units = {n: sum(fp._orig_size.numel() * 4 for g in m._get_fsdp_state()._fsdp_param_groups for fp in g.fsdp_params)
             for st in trainer.stages.values() for n, m in st.module.named_modules() if isinstance(m, FSDPModule)}
    return {"peak": peak[0], "units": units}


_SAVED = ("gpt2/1f1b",)  # runs that save a checkpoint and load it three ways


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Cases:
    """Each rank's result of one part of the file's matrix (``_part``), run when a test first asks
    for it on the test process's pool of 4 ranks (started once: processes and imports cost more
    than a run)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    for label in _SAVED:
        (tmp / label.replace("/", "-")).mkdir()
    return Cases(_part, 4, str(tmp), timeout=600)


@pytest.mark.multiprocess
@pytest.mark.parametrize("label", long_only(_RUNS, set(_LONG_RUNS) & set(_RUNS)))
def test_fsdp_over_two_replicas_equals_the_plain_model(sharded: Cases, label: str) -> None:
    results = sharded(label)
    for r in results:
        assert "error" not in r, r.get("error")
    assert [(r["dp_rank"], r["pp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        for got, want in r["norms"]:
            assert got == pytest.approx(want, rel=1e-5), label
        assert r["local"] <= r["whole"] // 2 + 64  # each replica holds half of its stages (rows rounded up)
        assert r["whole_left"] == [], r["whole_left"]  # and no whole copy of them beside


@pytest.mark.multiprocess
@pytest.mark.parametrize("label", long_only(COMBINED, set(_LONG_RUNS) & set(COMBINED)))
def test_fsdp_with_recomputation_and_mixed_precision(sharded: Cases, label: str) -> None:
    # Autocast (bf16, fp16 with loss scaling) and recomputation run inside the stage's forward and
    # backward, which FSDP gathers around: the gathered gradients equal the plain model's under
    # the same autocast over the same micro-batches (round-off only).
    for r in sharded(label):
        assert "error" not in r, r.get("error")
        if label.endswith("gathered"):  # weights gathered in bf16: round-off of bf16 weights
            assert r["gathered"] == ["torch.bfloat16"] and r["worst"] < 5e-2, r
        else:
            assert r["gathered"] == ["torch.float32"] and r["worst"] < 1e-5, r


@pytest.mark.multiprocess
def test_fsdp_refuses_a_tied_weight_within_a_rank_a_stray_optimizer_and_reusing_its_model(
    sharded: Cases
) -> None:
    for r in sharded("refused"):
        assert "error" not in r, r.get("error")
        zbv, opt = r["zbv"], r["optimizer"]
        assert zbv.startswith("FSDPOptionError") and "'model.lm_head.weight'" in zbv and "1f1b" in zbv, zbv
        assert opt.startswith("FSDPOptionError") and "lambda params" in opt, opt
        again = r["again"]  # not silently initialised afresh
        assert again.startswith("MaterializeError") and "engine='fsdp'" in again and "Init(weights=" in again, again


def test_engine_options_are_checked() -> None:
    from runtime.errors import TrainerOptionError

    with pytest.raises(TrainerOptionError, match="'replicate'"):
        DataParallel(engine="ddp")
    with pytest.raises(TrainerOptionError, match="ZeRO-1"):
        DataParallel(size=2, engine="fsdp", shard_optimizer=True)


@pytest.mark.multiprocess
def test_an_fsdp_checkpoint_loads_unsharded_sharded_and_resumes_exactly(sharded: Cases) -> None:
    # A safetensors export gathers the shards and loads back per stage as weights=.
    # DCP writes each rank's shards; the plain model, a new FSDP trainer and the home-made
    # engine's trainer read every weight and Adam moment back, and the new FSDP trainer's next
    # step equals the saved one's bit for bit.
    for rank, r in enumerate(sharded("gpt2/1f1b")):
        assert "error" not in r, r.get("error")
        want = ["weights"] + (["plain model"] if rank == 0 else []) + [
            "replicate 1f1b", "fsdp interleaved", "fsdp 1f1b", "resumed"]
        assert r["checkpoint"] == want


def _reset_before_a_forward(ranks: int) -> str:
    """A step that fails before a stage's first forward (a peer failed, a bad batch): the reset
    after it must leave FSDP as it is (nothing ran) and let the step's own error through."""
    trainer = make_trainer(case("mlp", ranks), ranks, "gpipe", transport="dist",
                           data_parallel=DataParallel(size=2, engine="fsdp", reshard_after_forward=False))
    try:
        trainer._replicas.averager.reset()
        return ""
    except Exception as e:
        return f"{type(e).__name__}: {e}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("label", list(_CUT_RUNS))
def test_fsdp_trains_a_block_the_cut_splits_exactly(sharded: Cases, label: str) -> None:
    # The plan cuts inside block h.1 (as node granularity may): each stage shards the part of the
    # block it holds as a unit of its own, or, holding none of its weights (the tail: a residual
    # add), computes that part in its own unit. Loss, every gradient, clipped AdamW steps and the
    # weights after them equal the plain model's (checked in _fsdp_case), kept gathered or not.
    for r in sharded(label):
        assert "error" not in r, r.get("error")
        for got, want in r["norms"]:
            assert got == pytest.approx(want, rel=1e-5), label
    held = {r["pp_rank"]: r["blocks_here"] for r in sharded(label)}
    if label.endswith("mid-h.1"):
        assert held == {0: 2, 1: 1}  # h.0 and the first half of h.1; the second half of h.1
    else:
        assert held == {0: 2, 1: 0}  # h.0 and h.1; no block weights (h.1's tail stays in the stage)


@pytest.mark.multiprocess
def test_reshard_after_forward_false_gathers_each_unit_once_per_step(sharded: Cases) -> None:
    # Each block of a stage is its own FSDP unit (runtime.parallel.blocks), the rest of the stage
    # one more. ZeRO-3 gathers a block again for backward after each forward freed it; kept
    # gathered, each unit is gathered at its first forward and freed after its last backward.
    for kept, zero3 in zip(sharded("gpt2/1f1b/gathered"), sharded("gpt2/1f1b")):
        assert "error" not in kept and "error" not in zero3, (kept.get("error"), zero3.get("error"))
        assert kept["stages_here"] == 1 and kept["blocks_here"] >= 1  # GPT-2's blocks are outlined
        assert kept["gathers"] == kept["units_here"] == kept["blocks_here"] + 1
        assert zero3["gathers"] >= 4 * zero3["blocks_here"]  # a block per micro-batch's backward (m = 4)


@pytest.mark.multiprocess
def test_fsdp_accumulates_gradients_over_two_calls(sharded: Cases) -> None:
    for r in sharded("accumulated"):
        assert isinstance(r, float), r
        assert r < 1e-5


@pytest.mark.multiprocess
def test_a_rank_holds_its_stage_unit_and_two_blocks_gathered_at_most(sharded: Cases) -> None:
    # Each block is its own FSDP unit: under 1F1B a rank gathers the block computing and the next,
    # beside its stage's own unit (embeddings, final norm, head), never the whole stage at once.
    for got in sharded("peak gathered"):
        assert "error" not in got, got.get("error")
        units = dict(got["units"])
        root = units.pop("")
        assert len(units) >= 4  # the stage's blocks (a block the cut splits: a part in each stage), each a unit
        largest = sorted(units.values())
        assert root + largest[-1] <= got["peak"] <= root + largest[-1] + largest[-2]
        assert got["peak"] < root + sum(units.values())


@pytest.mark.multiprocess
def test_fsdp_resets_after_a_step_that_failed_before_any_forward(sharded: Cases) -> None:
    # FSDP's step state exists once a forward has run through the stage (its lazy init): a reset
    # before that raised "'FSDPCommContext' object has no attribute 'all_gather_state'" in
    # place of the step's own error.
    assert sharded("reset before a forward") == [""] * 4
