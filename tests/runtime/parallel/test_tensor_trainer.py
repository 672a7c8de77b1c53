"""Tensor parallelism wired into the trainer: a Llama and a GPT-2 (Conv1D layers, q, k and v packed,
its embedding tied to the LM head of the last stage) from transformers on 4 gloo processes, 2 tp x
2 pp (world rank ``(d * pp + s) * tp + t``), train as the plain model does: the loss, every
gradient (shards gathered) and the parameters after 3 clipped AdamW steps, under 1F1B, ZB-H1 and
interleaved, with recompute, bf16 and fp16 (the default profile: Llama under 1F1B and ZB-H1, bf16,
GPT-2 under 1F1B; interleaved, recompute, fp16 and GPT-2's other schedules in the long profile);
2 dp x 2 tp of one stage and, on 8, 2 dp x 2 pp x 2 tp, replicated and ZeRO-1 (the long profile's);
clipping over tp shards (checkpoints: test_tensor_state.py). Each case runs on the test process's
pool of ranks when a test first asks for it (``rank_pool.Cases``)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from rank_pool import Cases, spawn
from tests.runtime.parity import TOL


def _loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def _llama(layers: int = 4) -> nn.Module:
    import transformers as T

    torch.manual_seed(0)
    cfg = T.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        num_hidden_layers=layers, vocab_size=96, max_position_embeddings=32, attention_dropout=0.0)
    return T.LlamaForCausalLM(cfg)


def _gpt2(layers: int = 4) -> nn.Module:
    import transformers as T

    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=96, n_positions=32, resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0)
    return T.GPT2LMHeadModel(cfg)  # wte tied to lm_head: the first stage and the last read it


def _llama_embedding_plan(layers: int = 4) -> nn.Module:
    """A Llama whose config's tp plan splits nothing but the token embedding (``embedding_rowwise``),
    as DiffLlama's, GPT-OSS's and LFM2's do."""
    model = _llama(layers)
    model.config.base_model_tp_plan = {"embed_tokens": "embedding_rowwise"}
    return model


# family -> (the model, the module path of block i)
_FAMILIES = {"llama": (_llama, "model.layers.{}"), "gpt2": (_gpt2, "transformer.h.{}"),
             "llama embedding plan": (_llama_embedding_plan, "model.layers.{}")}


def _batch(gen: torch.Generator, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 96, (rows, 8), generator=gen), torch.randint(0, 96, (rows, 8), generator=gen)


def _case(
    schedule: str, stages: int, dp: int = 1, zero1: bool = False, layers: int = 4, family: str = "llama",
    vocab: bool | None = False, eps: float = 1e-4, probe: Callable[..., Any] | None = None, **opts: Any
) -> dict[str, Any]:
    """One trainer of this rank (tp 2, ``dp`` replicas; ``vocab``: embedding and LM head split over
    the vocabulary) of a ``family`` model against the plain model on the global batch:
    forward_backward, then 3 clipped AdamW steps; then ``probe(trainer, plain model)``, if given,
    whose result is returned under ``"probe"``."""
    from torch.distributed.tensor import DTensor

    from partitioner import partition
    from runtime.options import DataParallel, TensorParallel
    from runtime.trainer import PipelineTrainer

    started = time.perf_counter()
    build, block = _FAMILIES[family]
    model = build(layers)
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(5)
    x, y = _batch(gen, 8 * dp)
    # Stages begin at blocks: a cut between a column layer and its row layer cannot be split.
    starts = [block.format(k * layers // stages) for k in range(1, stages)]
    plan = partition(model, (x[:2],), stages, microbatches=4, schedule=schedule, split_points=starts)
    # foreach=True: one multi-tensor update over DTensor shards and whole tensors together (CPU
    # defaults to the per-tensor loop). Adam divides by sqrt(v): a gradient near 0 turns the
    # round-off of the row-parallel sums (split in two, then all-reduced) into a visible step;
    # eps=1e-4 bounds that amplification to TOL (with transformers 5.24's Llama init, 1e-5 left one
    # element of the 3,072 of embed_tokens at 3e-6, as 1e-6 had one of 1,024 before; the vocab cases
    # use 1e-4 too).
    opt = lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, eps=eps, foreach=True)  # noqa: E731
    trainer = PipelineTrainer(plan, _loss, opt, schedule=schedule, transport="dist",
                              tensor_parallel=TensorParallel(size=2, vocab=vocab),
                              data_parallel=DataParallel(size=dp, shard_optimizer=zero1), **opts)
    loss = trainer.forward_backward(*trainer.local_batch(x, y))
    ref.zero_grad()
    want_loss = _loss(ref(x), y)
    want_loss.backward()
    torch.testing.assert_close(loss, want_loss.detach(), **TOL)
    # Every name: a tied weight is held under the name its stage reads it by (GPT-2's first stage:
    # lm_head.weight, its last: transformer.wte.weight), one parameter in the plain model.
    grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    sharded = []
    owned = {id(p) for p in trainer._replicas.owned}  # ZeRO-1: a replica keeps the gradients it owns
    for n, prm in trainer.named_parameters():
        assert isinstance(prm, DTensor), n  # whole weights too (Replicate): one foreach step over all
        if any(not pl.is_replicate() for pl in prm.placements):  # Shard, or _StridedShard (packed)
            sharded.append(n)
        if id(prm) not in owned:
            assert prm.grad is None, n
            continue
        assert prm.grad is not None, n
        g = prm.grad.full_tensor() if isinstance(prm.grad, DTensor) else prm.grad
        torch.testing.assert_close(g, grads[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
    trainer.zero_grad()
    ref_opt = opt(list(ref.parameters()))
    norms = []
    for _ in range(3):
        x, y = _batch(gen, 8 * dp)
        trainer.step(*trainer.local_batch(x, y), max_norm=0.5)
        ref_opt.zero_grad()
        _loss(ref(x), y).backward()
        norms.append((float(trainer.last_grad_norm), float(nn.utils.clip_grad_norm_(ref.parameters(), 0.5))))
        ref_opt.step()
    want = dict(ref.named_parameters(remove_duplicate=False))
    for n, prm in trainer.named_parameters():
        got = prm.detach().full_tensor() if isinstance(prm, DTensor) else prm.detach()
        torch.testing.assert_close(got, want[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
    planned = dict(plan.model.named_parameters(remove_duplicate=False))  # the split weights' whole tensors went
    return {"sharded": sharded, "checked": len(list(trainer.named_parameters())), "norms": norms,
            "whole_left": [n for n in sharded if not planned[n].is_meta],
            "names": [n for n, _ in trainer.named_parameters()],
            "local": {n: (tuple(p.to_local().shape), str(p.placements[0])) for n, p in trainer.named_parameters()},
            "tp_rank": trainer.mesh.tp_rank, "pp_rank": trainer.mesh.pp_rank, "dp_rank": trainer.mesh.dp_rank,
            "stages": sorted(trainer.stages), "probe": probe(trainer, ref) if probe is not None else None,
            "seconds": time.perf_counter() - started}


def _accumulated(model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype,
                 m: int = 4) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The plain model's loss and gradients over ``m`` micro-batches under autocast (as
    test_mixed_precision's, which spawned ranks cannot import)."""
    model.zero_grad()
    total = torch.zeros(())
    for xc, yc in zip(x.chunk(m), y.chunk(m)):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = _loss(model(xc), yc) / m
        loss.backward()
        total += loss.detach().float()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _autocast_case(precision: str = "bf16") -> dict[str, float]:
    """Under bf16 (or fp16, loss-scaled) autocast, tp 2 x pp 2 against the plain model under the same
    autocast and micro-batches, and that plain model against fp32: how far each is (loss, worst
    relative error of a gradient)."""
    from torch.distributed.tensor import DTensor

    from partitioner import partition
    from runtime.trainer import PipelineTrainer

    model = _llama()
    ref = copy.deepcopy(model)
    x, y = _batch(torch.Generator().manual_seed(5))
    plan = partition(model, (x[:2],), 2, microbatches=4, schedule="1f1b", split_points=["model.layers.2"])
    trainer = PipelineTrainer(plan, _loss, schedule="1f1b", transport="dist", tensor_parallel=2, precision=precision)
    loss = float(trainer.forward_backward(x, y))
    assert not trainer.last_found_inf
    bf16_loss, bf16 = _accumulated(ref, x, y, torch.bfloat16 if precision == "bf16" else torch.float16)
    fp32_loss, fp32 = _accumulated(ref, x, y, torch.float32)
    tp_err = plain_err = 0.0
    for n, prm in trainer.named_parameters():
        g = prm.grad.full_tensor() if isinstance(prm.grad, DTensor) else prm.grad
        assert g is not None and g.dtype == torch.float32, n  # fp32 master gradients
        tp_err = max(tp_err, float((g - bf16[n]).abs().max() / bf16[n].abs().max()))
        plain_err = max(plain_err, float((bf16[n] - fp32[n]).abs().max() / fp32[n].abs().max()))
    return {"tp_loss": abs(loss - float(bf16_loss)), "plain_loss": abs(float(bf16_loss) - float(fp32_loss)),
            "tp_err": tp_err, "plain_err": plain_err}


def _found_inf_check() -> list[bool]:
    """fp16's inf/NaN flag on 4 ranks as 2 stages x tp 2, an inf in one tp rank's shard only (rank
    0's): reduced over the stages and the tp group, every rank finds it (the pipeline group alone
    would leave ranks 1 and 3 taking the step that 0 and 2 skip)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from runtime.precision import LossScaler

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    prm = nn.Parameter(torch.ones(4))
    prm.grad = torch.ones(4)
    if dist.get_rank() == 0:
        prm.grad[1] = float("inf")
    scaler = LossScaler()
    flags = [scaler.unscale_([prm], distributed=True, group=mesh["pp"].get_group(), tp_group=tp)
             for tp in (None, mesh["tp"].get_group())]
    return flags


def _clip_check() -> dict[str, float]:
    """``clip_grad_norm_`` on 4 ranks as 2 stages x tp 2: a sharded weight, a whole one as a
    ``Replicate`` DTensor and a plain one on each stage; the norm is the whole model's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from runtime.parallel.clipping import clip_grad_norm_

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    s, t = dist.get_rank() // 2, dist.get_rank() % 2
    a = torch.arange(8.0) + 10 * s  # split in two over tp
    b, c = torch.tensor([1.0, 2.0, 3.0]) * (s + 1), torch.tensor([0.5, -0.5]) * (s + 1)
    params = [nn.Parameter(DTensor.from_local(a[4 * t:4 * t + 4].clone(), mesh["tp"], [Shard(0)], run_check=False)),
              nn.Parameter(DTensor.from_local(b.clone(), mesh["tp"], [Replicate()], run_check=False)),
              nn.Parameter(c.clone())]
    for prm in params:
        prm.grad = prm.detach().clone()
    norm = clip_grad_norm_(params, 1.0, distributed=True, group=mesh["pp"].get_group(),
                           tp_group=mesh["tp"].get_group())
    want = float(sum((torch.arange(8.0) + 10 * k).square().sum() + 14 * (k + 1) ** 2 + 0.5 * (k + 1) ** 2
                     for k in range(2)) ** 0.5)
    shard = params[0].grad.to_local()
    return {"norm": float(norm), "want": want, "scaled": float((shard - a[4 * t:4 * t + 4] / want).abs().max())}


# Every 4-rank case of the file, each run on the pool when a test first asks for it: key -> the
# schedule, the stages and _case's options; and the checks that are no trainer's.
_RUNS: dict[str, tuple[str, int, dict[str, Any]]] = {
    "1f1b": ("1f1b", 2, {}), "zbh1": ("zbh1", 2, {}), "interleaved": ("interleaved", 4, {}),
    "1f1b recompute": ("1f1b", 2, {"recompute": True}), "gpt2 1f1b": ("1f1b", 2, {"family": "gpt2"}),
    "gpt2 zbh1": ("zbh1", 2, {"family": "gpt2"}), "gpt2 interleaved": ("interleaved", 4, {"family": "gpt2"}),
    # 2 replicas of one stage over tp 2: dp x tp on 4 ranks (dp x pp x tp on 8: the long profile's)
    "dp, 1 stage": ("1f1b", 1, {"dp": 2, "layers": 2}),
    "zero1, 1 stage": ("1f1b", 1, {"dp": 2, "zero1": True, "layers": 2}),
}


def _part(rank: int, world: int, key: str) -> Any:
    """The case ``key`` on this rank: a trainer of ``_RUNS`` against the plain model, or a check."""
    if key in _RUNS:
        schedule, stages, opts = _RUNS[key]
        return _case(schedule, stages, **opts)
    if key in ("bf16", "fp16"):
        return _autocast_case(key)
    return {"clip": _clip_check, "found_inf": _found_inf_check}[key]()


def _worker(rank: int, world: int, cases: list[tuple[str, str, int, dict[str, Any]]]) -> dict[str, Any]:
    return {key: _case(schedule, stages, **opts) for key, schedule, stages, opts in cases}


@pytest.fixture(scope="module")
def runs() -> Cases:
    pytest.importorskip("transformers")
    return Cases(_part, 4, timeout=420)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["1f1b", "zbh1", pytest.param("interleaved", marks=pytest.mark.long),
                                  pytest.param("1f1b recompute", marks=pytest.mark.long), "gpt2 1f1b",
                                  pytest.param("gpt2 zbh1", marks=pytest.mark.long),
                                  pytest.param("gpt2 interleaved", marks=pytest.mark.long)])
def test_2_tp_x_2_pp_trains_as_the_plain_model(runs: Cases, case: str) -> None:
    # _case asserted the loss, every gradient and the parameters after 3 clipped AdamW steps on
    # every rank; here, that each rank sat where (d * pp + s) * tp + t puts it and held its shards.
    for rank, got in enumerate(runs(case)):
        assert (got["pp_rank"], got["tp_rank"]) == divmod(rank, 2)
        v = 2 if case.endswith("interleaved") else 1
        assert got["stages"] == [got["pp_rank"] + 2 * k for k in range(v)]
        # Of the 2 blocks this rank holds (of 4), split over tp: Llama's q, k, v, o, gate, up and
        # down; GPT-2's c_attn (weight, bias), attn.c_proj, c_fc (weight, bias), mlp.c_proj.
        assert len(got["sharded"]) == (6 if case.startswith("gpt2") else 7) * 2, got["sharded"]
        assert got["whole_left"] == []  # released to meta: the rank holds its shards only
        if case.startswith("gpt2"):  # the tied embedding: the first stage's and the last stage's copy
            first, last = got["stages"][0] == 0, got["stages"][-1] == 2 * v - 1
            assert ("lm_head.weight" in got["names"], "transformer.wte.weight" in got["names"]) == (first, last)
        for mine, plain in got["norms"]:
            assert mine == pytest.approx(plain, rel=2e-5)


@pytest.mark.multiprocess
def test_the_norm_counts_each_shard_and_each_whole_weight_once(runs: Cases) -> None:
    for got in runs("clip"):
        assert got["norm"] == pytest.approx(got["want"], rel=1e-6) and got["scaled"] < 1e-6


@pytest.mark.multiprocess
def test_bf16_under_tp_is_as_close_to_the_plain_bf16_model_as_bf16_is_to_fp32(runs: Cases) -> None:
    # Under autocast a row-parallel layer's two partial sums are rounded to bf16 before the
    # all-reduce, where the whole layer rounds once: the gradients move by bf16's own round-off
    # (measured: worst relative error 0.012 against the plain bf16 model, whose own against fp32
    # is 0.012), not by a wrong term, which would be of order 1.
    for got in runs("bf16"):
        assert got["tp_loss"] < got["plain_loss"] and got["tp_err"] < 2 * got["plain_err"], got


@pytest.mark.long  # bf16 runs the autocast path by default; fp16's loss scaling is the long profile's
@pytest.mark.multiprocess
def test_fp16_under_tp_is_as_close_to_the_plain_fp16_model_as_fp16_is_to_fp32(runs: Cases) -> None:
    # Loss-scaled (the scale a power of two: scaling and unscaling are exact), no step skipped.
    # fp16 keeps 3 more mantissa bits than bf16: measured, the worst relative gradient error 0.0042
    # and 0.0062 against the plain fp16 model (whose own against fp32: 0.0035 and 0.0065), the loss
    # 5.7e-6 away (the plain fp16 model's from fp32: 2.9e-6; a wrong term would be of order 1).
    for got in runs("fp16"):
        assert got["tp_loss"] < 2e-5 and got["tp_err"] < 2 * got["plain_err"], got


def test_fp16s_inf_flag_is_reduced_over_the_tp_group(runs: Cases) -> None:
    # Per rank: the flag over the pipeline group alone, then over it and the tp group.
    assert runs("found_inf") == [[True, True], [False, True], [True, True], [False, True]]


def _check_dp(runs: list[dict[str, Any]], pp: int) -> None:
    for rank, got in enumerate(runs):  # _case compared the loss, every (owned) gradient and the stepped parameters
        at = rank // 2
        assert (got["dp_rank"], got["pp_rank"], got["tp_rank"]) == (at // pp, at % pp, rank % 2)
        assert len(got["sharded"]) == 7 * 2 // pp  # the blocks of this stage: q, k, v, o, gate, up, down


@pytest.mark.multiprocess
@pytest.mark.long  # the 1-stage layouts beside 2 tp x 2 pp's: the long profile's
@pytest.mark.parametrize("case", ["dp, 1 stage", "zero1, 1 stage"])
def test_2_dp_x_2_tp_replicated_and_zero1_train_as_the_plain_model(runs: Cases, case: str) -> None:
    _check_dp(runs(case), pp=1)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.long  # 8 processes (a fresh spawn: the pool has 4) on the 2 shared cores measured: 150 s
def test_2_dp_x_2_pp_x_2_tp_replicated_and_zero1_train_as_the_plain_model() -> None:
    pytest.importorskip("transformers")
    cases = [("dp", "1f1b", 2, {"dp": 2, "layers": 2}), ("zero1", "1f1b", 2, {"dp": 2, "zero1": True, "layers": 2})]
    runs = spawn(_worker, 8, cases, timeout=600)
    for case in ("dp", "zero1"):
        _check_dp([r[case] for r in runs], pp=2)
