"""A plan from the layout search trains as it is: the trainer takes its replicas and sharding, exactly."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import Cluster, plan_layout
from rank_pool import spawn
from runtime import PipelineTrainer
from runtime.transport.placement import PlacementError


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ref = copy.deepcopy(model)
    loss = _loss(ref(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}


def test_a_one_replica_layout_trains_exactly_in_one_process() -> None:
    model = _gpt2()
    plan = plan_layout(model, (torch.randint(0, 64, (1, 8)),), cluster=Cluster.uniform(2, "cpu"),
                       global_batch=8, dp_sizes=(1,))
    assert plan.layout is not None and plan.layout.dp == 1
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, 64, (8, 8), generator=gen), torch.randint(0, 64, (8, 8), generator=gen)
    want_loss, want = _reference(model, x, y)
    trainer = PipelineTrainer(plan, _loss)
    assert trainer.m == plan.layout.microbatches and trainer.schedule_name == plan.layout.schedule
    loss = trainer.forward_backward(x, y)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6)


def test_a_layout_with_replicas_in_one_process_says_how_to_launch_it() -> None:
    plan = plan_layout(_gpt2(), (torch.randint(0, 64, (1, 8)),), cluster=Cluster.uniform(2, "cpu"),
                       global_batch=8, dp_sizes=(2,))
    with pytest.raises(PlacementError, match="torchrun --nproc-per-node 2"):
        PipelineTrainer(plan, _loss, transport="local")
    PipelineTrainer(plan, _loss, transport="local", data_parallel=1)  # one replica, asked for


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])


def _replicated(rank: int, world: int) -> dict[str, dict[str, Any]]:
    out = {}
    for zero in ("zero1", "fsdp"):  # one spawn, a trainer per sharding
        model = _mlp()
        plan = plan_layout(model, (torch.randn(1, 16),), cluster=Cluster.uniform(world, "cpu"),
                           global_batch=8, dp_sizes=(2,), zero=(zero,))
        mse = nn.functional.mse_loss
        gen = torch.Generator().manual_seed(9)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
        ref = copy.deepcopy(model)  # before the trainer: FSDP shards the model's own parameters
        want_loss = mse(ref(x), y)
        want_loss.backward()
        want = dict(ref.named_parameters())
        trainer = PipelineTrainer(plan, mse, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), transport="dist")
        loss = trainer.forward_backward(*trainer.local_batch(x, y))
        # Under FSDP each rank holds its shard of every gradient: compare them gathered.
        grads = {n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for n, p in trainer.named_parameters()
                 if p.grad is not None}
        worst = max(float((g - want[n].grad).abs().max() / want[n].grad.abs().max()) for n, g in grads.items())
        dp = trainer.options.data_parallel
        out[zero] = {"dp": dp.size, "shard": dp.shard_optimizer, "engine": dp.engine, "loss": float(loss),
                     "want": float(want_loss.detach()), "worst": worst, "held": len(grads),
                     "layout": plan.layout.label() if plan.layout else ""}
    return out


def _every_part(rank: int, world: int, names: list[str]) -> dict[str, dict[str, Any]]:
    """Each part's result on this rank, or its traceback: one spawn for the file's three tests
    (starting the processes and importing torch cost more than a part)."""
    import traceback

    out: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            out[name] = {"result": _PARTS[name](rank, world)}
        except Exception:  # reported by the part's own test
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def over_gloo() -> list[dict[str, dict[str, Any]]]:
    return spawn(_every_part, 2, list(_PARTS), timeout=300)


def _part(results: list[dict[str, dict[str, Any]]], name: str) -> list[Any]:
    """Every rank's result of one part, failing with the first rank's traceback if a rank failed."""
    for r in results:
        assert "error" not in r[name], r[name]["error"]
    return [r[name]["result"] for r in results]


@pytest.mark.multiprocess
def test_the_trainer_takes_replicas_and_sharding_from_the_layout(over_gloo: list[dict[str, Any]]) -> None:
    results = _part(over_gloo, "replicated")
    for r in results:
        assert (r["zero1"]["dp"], r["zero1"]["shard"], r["zero1"]["engine"]) == (2, True, "replicate")
        assert (r["fsdp"]["dp"], r["fsdp"]["shard"], r["fsdp"]["engine"]) == (2, False, "fsdp")
        for got in r.values():
            assert got["layout"].endswith(got["engine"] if got["engine"] == "fsdp" else "zero1")
            assert got["loss"] == pytest.approx(got["want"], rel=1e-5)
            assert got["held"] > 0 and got["worst"] < 1e-5


def _memory(rank: int, world: int) -> dict[str, float]:
    from runtime.execute.saved_memory import SavedBytes

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(8)])
    plan = plan_layout(model, (torch.randn(1, 64),), cluster=Cluster.uniform(world, "cpu"), global_batch=16,
                       dp_sizes=(2,), zero=("zero1",), microbatch_sizes=(2,), schedules=("1f1b",))
    trainer = PipelineTrainer(plan, nn.functional.mse_loss, optimizer=lambda ps: torch.optim.AdamW(ps),
                              transport="dist")
    x, y = trainer.local_batch(torch.randn(16, 64), torch.randn(16, 64))
    params = list(model.parameters())
    # The micro-batches are views of the batch, which the caller holds anyway: not counted.
    with SavedBytes(exclude=[*params, x, y]) as meter:
        trainer.step(x, y)
    moments = sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values() for t in s.values()
                  if torch.is_tensor(t) and t.dim())
    weights = sum(p.numel() * p.element_size() for p in params)
    assert plan.layout is not None
    # Every rank accumulates whole gradients in backward (non-owners drop theirs after the reduction).
    grads = weights
    return {"state": weights + grads + moments, "act": meter.peak, "moments": moments, "weights": weights,
            "predicted_state": sum(st.state_bytes for st in plan.stages),
            "predicted_act": plan.layout.memory - sum(st.state_bytes for st in plan.stages)}


@pytest.mark.multiprocess
def test_each_rank_holds_the_memory_the_layout_predicts(over_gloo: list[dict[str, Any]]) -> None:
    # ZeRO-1 over 2 replicas: weights and gradients whole, AdamW's moments on the owned half; the
    # activations 1F1B holds at its peak (one micro-batch on a one-rank pipeline): as priced.
    for r in _part(over_gloo, "memory"):
        assert r["moments"] == pytest.approx(r["weights"])  # 8 bytes per parameter of fp32 Adam, halved
        assert r["state"] == pytest.approx(r["predicted_state"], rel=1e-6)
        # The plan also charges the micro-batch's input the first layer saves (2 x 64 fp32), which
        # the caller holds here as part of its batch.
        assert r["act"] + 2 * 64 * 4 == pytest.approx(r["predicted_act"], rel=1e-6)


def _overhead(rank: int, world: int) -> dict[str, Any]:
    from partitioner import LayoutSearch
    from runtime.overheads import fit_to_runtime, measure_action_overhead

    tiny = measure_action_overhead(Cluster.uniform(world, "cpu"), repeat=3)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4)])
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 256, generator=gen), torch.randn(64, 256, generator=gen)
    batch = lambda rows: (x[:rows], y[:rows])  # noqa: E731
    cpu = Cluster.uniform(world, "cpu")
    search = LayoutSearch(model, (x[:1],), cluster=cpu, global_batch=8)
    fitted = fit_to_runtime(search, nn.functional.mse_loss, batch, sizes=(1, 64), repeat=3)
    search.use_cluster(fitted)
    on_model = measure_action_overhead(fitted, search=search, batch=batch, repeat=3)
    dev = fitted.devices[0]
    return {"tiny": tiny, "fit": (dev.peak_flops_fp32, dev.op_overhead), "on_model": on_model,
            "cluster_kept": search.cluster == fitted, "grads": [p.grad for p in model.parameters()]}


# The worker of each multi-process test of this file, run one after another by ``_every_part``.
_PARTS: dict[str, Callable[[int, int], Any]] = {"replicated": _replicated, "memory": _memory, "overhead": _overhead}


@pytest.mark.multiprocess
def test_the_runtimes_cost_per_action_is_measured_alike_on_every_rank(over_gloo: list[dict[str, Any]]) -> None:
    from runtime.overheads import fit_action_overhead

    got = _part(over_gloo, "overhead")
    # The ranks agree (the same plan everywhere): the slowest rank's model timings, the mean overhead.
    assert got[0]["tiny"] == got[1]["tiny"] and 0.0 <= got[0]["tiny"] < 0.5
    assert got[0]["fit"] == got[1]["fit"] and got[0]["fit"][0] > 0
    assert got[0]["on_model"] == got[1]["on_model"] and 0.0 <= got[0]["on_model"] < 0.5
    # Measuring on the search prices with its cluster, and leaves it (and the model's gradients) as found.
    assert all(r["cluster_kept"] for r in got) and all(g is None for r in got for g in r["grads"])
    assert fit_action_overhead((1.0, 0.5), (0.0, 0.0), 4) == 0.0  # noise never gives a negative cost
