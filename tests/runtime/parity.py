"""Shared parity checks: a pipelined trainer must match the unpartitioned model exactly.

Used by the in-process tests and, inside spawned ranks, by the multi-process tests (so every
function here is importable and picklable).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from partitioner import Cluster, partition
from partitioner.plan.layout import Option
from partitioner.schedule.registry import stages_per_rank
from partitioner.schedule.validation import peak_inflight
from partitioner.search import LayoutSearch
from partitioner.zoo import MLPChain, gpt2
from runtime.execute import wgrad_fusion
from runtime.trainer import PipelineTrainer
from runtime.transport.p2p import DistTransport
from runtime.transport.placement import PlacementError

TOL = {"rtol": 2e-5, "atol": 2e-6}
# Fuse weight-gradient accumulation into every linear layer, however small, so that the parity
# cases check the fused path (the split-backward schedules, which never fuse, check the plain one).
wgrad_fusion.DEFAULT_MIN_NUMEL = 1
# Traced once per process by the gloo workers (``plan_once``) and planned from that trace for every
# schedule: GPT-2 goes through torch.export (~0.6 s a trace, up to 17 cases a rank); the stage cuts
# equal partition()'s (checked for every schedule on 2 and 4 ranks when this was written).
TRACE_ONCE = ("gpt2",)


def stages_for(schedule: str, ranks: int) -> int:
    """``S``: the stages a plan needs to run ``schedule`` on ``ranks`` ranks."""
    return ranks * stages_per_rank(schedule)


class SkipChain(nn.Module):
    """Six blocks; the stem's output is added back after the last one (a skip over many stages)."""

    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.stem = nn.Linear(12, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(6))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = torch.relu(self.stem(x))
        h = h0
        for block in self.blocks:
            h = block(h)
        return self.head(h + h0)


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def case(name: str, p: int) -> dict[str, Any]:
    """Model, batch, loss and partition options for a named parity case on ``p`` stages (2 to 8)."""
    torch.manual_seed(1234)
    if name == "mlp":
        model: nn.Module = MLPChain((16, 48, 24, 64, 32, 40, 8))
        x, y = torch.randn(8, 16), torch.randn(8, 8)
        return dict(model=model, example=(x[:2],), x=x, y=y, loss=nn.functional.mse_loss, opts={})
    if name == "mlp-mb4":  # micro-batches of 4 rows from a plan traced on 2: shapes found per size
        model = MLPChain((16, 48, 24, 64, 32, 40, 8))
        x, y = torch.randn(16, 16), torch.randn(16, 8)
        return dict(model=model, example=(x[:2],), x=x, y=y, loss=nn.functional.mse_loss, opts={})
    if name == "gpt2":
        model, _ = gpt2(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, batch=2, seq=8)
        x = torch.randint(0, 64, (8, 8))
        y = torch.randint(0, 64, (8, 8))
        return dict(model=model, example=(x[:2],), x=x, y=y, loss=_lm_loss, opts={})
    if name == "skip":
        model = SkipChain()
        x, y = torch.randn(8, 12), torch.randn(8, 5)
        # Stages begin at blocks spread over the chain, so the stem's output skips >= 2 stages.
        starts = {2: ["blocks.3"], 3: ["blocks.2", "blocks.4"], 4: ["blocks.1", "blocks.3", "blocks.5"],
                  8: ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "blocks.4", "blocks.5", "head"]}[p]
        return dict(model=model, example=(x[:2],), x=x, y=y, loss=nn.functional.mse_loss,
                    opts={"split_points": starts})
    raise ValueError(name)


def make_trainer(
    c: dict[str, Any], p: int, schedule: str, *, transport: str = "local",
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None, **kw: Any,
) -> PipelineTrainer:
    plan = c["plan"] if "plan" in c else partition(c["model"], c["example"], p, microbatches=4, schedule=schedule,
                                                     **c["opts"])
    return PipelineTrainer(plan, c["loss"], optimizer, schedule=schedule, transport=transport, **kw)


def step_failure(trainer: PipelineTrainer, x: torch.Tensor, y: torch.Tensor) -> dict[str, str]:
    """What ``trainer.forward_backward(x, y)`` raised, as ``{"type", "message"}`` (both ``""`` when it ran)."""
    try:
        trainer.forward_backward(x, y)
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": "", "message": ""}


def reference(
    model: nn.Module, loss_fn: Callable[..., torch.Tensor],
    x: tuple[torch.Tensor, ...] | Mapping[str, torch.Tensor], y: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of the whole batch ``x`` (one tensor per model input, or a dict of them by input
    name, passed as keywords) and every parameter's gradient by every name (tied weights under
    each), unpartitioned."""
    model.zero_grad()
    loss = loss_fn(model(**x) if isinstance(x, Mapping) else model(*x), y)
    loss.backward()
    grads = {n: prm.grad.clone() for n, prm in model.named_parameters(remove_duplicate=False) if prm.grad is not None}
    return loss.detach(), grads


def reference_grads(
    c: dict[str, Any], ref: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`reference` for a parity case's single-input model and loss."""
    return reference(ref, c["loss"], (x,), y)


def check_grads(trainer: PipelineTrainer, want: dict[str, torch.Tensor]) -> list[str]:
    """Every trainable parameter this process holds has the reference gradient, and a frozen one
    (``requires_grad=False``, e.g. Whisper's sinusoidal positions) none; returns the names checked."""
    names = []
    for name, prm in trainer.named_parameters():
        if not prm.requires_grad:
            assert prm.grad is None and name not in want, f"frozen {name} got a gradient"
            continue
        assert prm.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(prm.grad, want[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")
        names.append(name)
    return names


def check_case(
    name: str, p: int, schedule: str, transport: str = "local", *, grouped: bool = False,
    searches: dict[tuple[str, int], LayoutSearch] | None = None,
) -> dict[str, Any]:
    """Loss and gradients of one step, then weights after 3 optimizer steps, equal the reference.

    ``grouped``: over gloo, run the program NCCL runs (sends posted with the next receives).
    ``searches``: this process's traced ``TRACE_ONCE`` models, kept across calls (see ``plan_once``).
    """
    c = case(name, p)
    if searches is not None:
        plan_once(c, name, p, schedule, searches)
    ref = copy.deepcopy(c["model"])
    opt = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    trainer = make_trainer(c, p, schedule, transport=transport, optimizer=opt)
    if grouped:
        trainer._dist_transport = DistTransport(trainer.schedule.stage_to_rank, trainer.timeout, grouped=True)
    gen = torch.Generator().manual_seed(99)
    x, y = _fresh(c, gen), _fresh_y(c, gen)
    loss = trainer.forward_backward(x, y)
    want_loss, want = reference_grads(c, ref, x, y)
    torch.testing.assert_close(loss, want_loss, **TOL)
    checked = check_grads(trainer, want)

    ref_opt = opt(list(ref.parameters()))
    trainer.zero_grad()
    for _ in range(3):
        x, y = _fresh(c, gen), _fresh_y(c, gen)
        trainer.step(x, y)
        ref_opt.zero_grad()
        c["loss"](ref(x), y).backward()
        ref_opt.step()
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for pname, prm in trainer.named_parameters():
        torch.testing.assert_close(prm.detach(), ref_params[pname].detach(), **TOL,
                                   msg=lambda m, pname=pname: f"{pname}: {m}")
    every = {id(prm): n for n, prm in ref.named_parameters()}  # one name per tensor (tied: one)
    return {"checked": checked, "peak": dict(trainer.last_peak_inflight), "loss": float(loss),
            "tensors": len(every), "aliases": _aliases(ref), "tied_groups": len(trainer._tied),
            "want_peak": list(peak_inflight(trainer.schedule)), "stage_to_rank": list(trainer.schedule.stage_to_rank)}


def plan_once(
    c: dict[str, Any], name: str, p: int, schedule: str, searches: dict[tuple[str, int], LayoutSearch]
) -> None:
    """For a ``TRACE_ONCE`` model (else nothing): put in ``c['plan']`` the plan of ``c`` from the
    process's one trace of the model, and make the traced model ``c['model']``, holding ``c``'s fresh
    weights (copied into its tensors, which the plan's stages share) and no gradients: the case
    starts as a freshly partitioned one would. One trainer at a time: the next case resets them."""
    if name not in TRACE_ONCE:
        return
    ranks = p // stages_per_rank(schedule)
    rows, batch = len(c["example"][0]), len(c["x"])
    search = searches.get((name, ranks))
    if search is not None and any(t.is_meta for t in search.model.parameters()):
        search = None  # an FSDP trainer kept only its shards and put the whole weights on meta: trace anew
    if search is None:
        search = searches[name, ranks] = LayoutSearch(
            c["model"], c["example"], cluster=Cluster.uniform(ranks, "cpu"), global_batch=batch)
    model = search.model
    # An engine that swapped a tensor of the model (FSDP's shards, say) would leave it out of the reset.
    kinds = {n: type(t).__name__ for n, t in model.state_dict(keep_vars=True).items()
             if type(t) not in (nn.Parameter, torch.Tensor)}
    assert not kinds, f"a trainer replaced the traced model's tensors {kinds}: partition this case anew"
    with torch.no_grad():
        model.load_state_dict(c["model"].state_dict())
    for prm in model.parameters():
        prm.grad = None
    plan = search.plan(Option(dp=1, pp=ranks, schedule=schedule, microbatch_size=rows, zero="none", global_batch=batch))
    assert plan.num_stages == p and plan.microbatches == 4, (name, schedule, plan.num_stages, plan.microbatches)
    # No layout: the trainer runs it as partition()'s plan (one replica, its options untouched).
    c["model"], c["plan"] = model, dataclasses.replace(plan, layout=None)


def _aliases(model: nn.Module) -> dict[str, str]:
    """Every parameter name -> the first name of the same tensor."""
    first: dict[int, str] = {}
    out = {}
    for n, prm in model.named_parameters(remove_duplicate=False):
        out[n] = first.setdefault(id(prm), n)
    return out


def backward_against_plain(
    trainer: PipelineTrainer, c: dict[str, Any], ref: nn.Module, dtype: torch.dtype | None, rows: int = 16
) -> dict[str, torch.Tensor]:
    """One ``forward_backward`` of this replica's share of a fresh global batch of ``rows``; its
    loss checked against the plain model ``ref``'s (under ``dtype``'s autocast, over the same
    micro-batches, with the trainer's loss scale); the plain model's gradients returned."""
    from test_mixed_precision import _accumulated

    gen = torch.Generator().manual_seed(11)
    x = _fresh({"x": c["x"].new_empty(rows, *c["x"].shape[1:])}, gen)
    y = _fresh_y({"y": c["y"].new_empty(rows, *c["y"].shape[1:])}, gen)
    loss = trainer.forward_backward(*trainer.local_batch(x, y))
    if dtype is None:
        want_loss, want = reference_grads(c, ref, x, y)
    else:
        scale = trainer.scaler.scale if trainer.scaler is not None else 1.0
        want_loss, want = _accumulated(ref, c["loss"], x, y, 2 * trainer.m, dtype, scale)
    assert not trainer.last_found_inf
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    return want


def _fresh(c: dict[str, Any], gen: torch.Generator) -> torch.Tensor:
    x = c["x"]
    if x.dtype.is_floating_point:
        return torch.randn(x.shape, generator=gen)
    return torch.randint(0, 64, x.shape, generator=gen)


def _fresh_y(c: dict[str, Any], gen: torch.Generator) -> torch.Tensor:
    y = c["y"]
    if y.dtype.is_floating_point:
        return torch.randn(y.shape, generator=gen)
    return torch.randint(0, 64, y.shape, generator=gen)


def dist_workers(
    rank: int, world: int, cases: list[tuple[str, str]], grouped: list[tuple[str, str]], trace: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``dist_worker`` on ``cases``, then on the ``grouped`` cases with grouped messages, in one
    spawn: starting the processes and importing torch cost more than most cases."""
    searches: dict[tuple[str, int], LayoutSearch] = {}  # both runs plan from one trace per model
    return (dist_worker(rank, world, cases, trace, searches=searches),
            dist_worker(rank, world, grouped, None, True, searches=searches))


def dist_worker(
    rank: int, world: int, cases: list[tuple[str, str]], trace: str | None = None, grouped: bool = False, *,
    searches: dict[tuple[str, int], LayoutSearch] | None = None,
) -> dict[str, Any]:
    """Run every (model, schedule) case on this rank of a ``world``-rank pipeline.

    The plan has ``stages_for(schedule, world)`` stages: one per rank, two for interleaved and ZB-V.
    With ``trace`` (a path), also: a plan of the wrong size is refused, and a ZB-V step's Chrome
    trace is gathered to rank 0 and written there (under ``'_extra'``).
    """
    out: dict[str, Any] = {}
    searches = {} if searches is None else searches  # TRACE_ONCE models traced once for every case
    for name, schedule in cases:
        stages = stages_for(schedule, world)
        out[f"{name}/{schedule}"] = check_case(name, stages, schedule, transport="dist", grouped=grouped,
                                               searches=searches)
    if trace is not None:
        c = case("mlp", world)
        try:  # world stages under ZB-V need world / 2 ranks, not world
            make_trainer(c, world, "zbv", transport="dist")
            refused = ""
        except PlacementError as err:
            refused = str(err)
        c = case("mlp", 2 * world)
        trainer = make_trainer(c, 2 * world, "zbv", transport="dist", record=True)
        trainer.forward_backward(c["x"], c["y"])
        written = trainer.save_trace(trace)
        out["_extra"] = {"refused": refused, "written": None if written is None else str(written),
                         "records": len(trainer.last_records)}
    return out
