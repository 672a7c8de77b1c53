"""Activation recomputation (``PipelineTrainer(recompute=...)``): exact gradients, less memory held."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from parity import TOL, case, check_grads, make_trainer, plan_once, reference_grads, stages_for
from partitioner import partition
from partitioner.search import LayoutSearch
from rank_pool import spawn
from runtime.execute.recompute import RecomputeOptionError
from runtime.execute.saved_memory import SavedBytes
from runtime.trainer import PipelineTrainer

# GPT-2 traced once by this test process and planned from that trace for every schedule and test
# (``parity.plan_once``; tracing is most of a case's time): each test's trainers are the only ones alive.
_SEARCHES: dict[tuple[str, int], LayoutSearch] = {}


def _gpt2_case(schedule: str, stages: int = 2) -> dict[str, Any]:
    """Parity's GPT-2 case on ``stages``, planned for ``schedule`` from this process's one trace."""
    c = case("gpt2", stages)
    plan_once(c, "gpt2", stages, schedule, _SEARCHES)
    return c


def _parity(name: str, schedule: str, transport: str = "local", recompute: Any = True, *,
            searches: dict[tuple[str, int], LayoutSearch] = _SEARCHES) -> dict[str, Any]:
    """One forward-backward with recomputation equals the unpartitioned model's loss and gradients.
    ``searches``: GPT-2 traced once per process (``parity.plan_once``)."""
    S = stages_for(schedule, 2)
    c = case(name, S)
    plan_once(c, name, S, schedule, searches)
    ref = copy.deepcopy(c["model"])
    trainer = make_trainer(c, S, schedule, transport=transport, recompute=recompute)
    loss = trainer.forward_backward(c["x"], c["y"])
    want_loss, want = reference_grads(c, ref, c["x"], c["y"])
    torch.testing.assert_close(loss, want_loss, **TOL)
    return {"checked": check_grads(trainer, want), "recompute": sorted(trainer.recompute), "stages": S}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbh1", "interleaved", "zbv"])
@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_recomputed_stages_match_reference(name: str, schedule: str) -> None:
    res = _parity(name, schedule)
    assert res["recompute"] == list(range(res["stages"]))
    assert res["checked"]


@pytest.mark.parametrize(("schedule", "stages"), [("1f1b", {0}), ("zbh1", {1}), ("zbv", [1, 2])])
def test_some_stages_recompute(schedule: str, stages: Any) -> None:
    res = _parity("gpt2", schedule, recompute=stages)
    assert res["recompute"] == sorted(stages)


def test_recomputation_holds_only_inputs_between_forward_and_backward() -> None:
    """Under GPipe (every forward before any backward), autograd holds every micro-batch's
    activations at once; with recomputation only the stage being backpropagated holds any."""
    c = _gpt2_case("gpipe")
    peaks = {}
    for recompute in (False, True):
        trainer = make_trainer(c, 2, "gpipe", transport="sequential", recompute=recompute)
        with SavedBytes(exclude=trainer.parameters()) as meter:
            trainer.forward_backward(c["x"], c["y"])
        assert meter.live == 0  # every graph was freed by the end of the step
        peaks[recompute] = meter.peak
    # 4 micro-batches x 2 stages held without; one stage's one micro-batch (the largest) with.
    assert peaks[True] < 0.4 * peaks[False], peaks
    assert peaks[True] > 0


def test_stash_keeps_only_inputs() -> None:
    c = case("mlp", 2)
    trainer = make_trainer(c, 2, "gpipe", transport="sequential", recompute={0})
    ex = trainer._executors(_NullTransport(), trainer._autocast.resolve("this test"))[0]
    micro = [{"x": x} for x in c["x"].chunk(4)]
    state = ex.start(micro, list(c["y"].chunk(4)))
    forward = next(a for a in trainer.schedule.actions[0] if a.stage == 0)
    ex.execute(state, forward)
    st = state.stash[(0, forward.mb)]
    assert st.outputs == () and st.replay is not None
    assert [a is micro[forward.mb]["x"] for a in st.args] == [True]


class _NullTransport:
    """Swallows sends (enough for one forward of stage 0, which receives nothing)."""

    posts_receives = False
    groups_messages = False

    def send(self, key: Any, tensors: Any) -> None:
        pass


class _Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.drop(torch.relu(self.b(self.drop(torch.relu(self.a(x)))))))


def test_dropout_is_replayed_and_global_state_left_as_found() -> None:
    model = _Dropped()
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    plan = partition(model, (x[:2],), 2, microbatches=4, schedule="1f1b")
    got: dict[bool, Any] = {}
    for recompute in (False, True):
        trainer = PipelineTrainer(plan, nn.functional.mse_loss, transport="sequential", recompute=recompute)
        torch.manual_seed(7)
        with torch.no_grad():  # a step trains whatever the caller's grad mode
            loss = trainer.forward_backward(x, y)
            assert not torch.is_grad_enabled()
        after = torch.get_rng_state()
        got[recompute] = (loss, {n: p.grad.clone() for n, p in trainer.named_parameters()}, after)
        trainer.zero_grad()
    (l0, g0, r0), (l1, g1, r1) = got[False], got[True]
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
    assert torch.equal(r0, r1)  # the replays drew nothing from the caller's generator
    assert any(bool((g == 0).any()) for g in g0.values())  # dropout did drop something


def test_bad_stage_index_names_the_range() -> None:
    c = case("mlp", 2)
    with pytest.raises(RecomputeOptionError, match=r"\[5\].*0\.\.1"):
        make_trainer(c, 2, "1f1b", recompute={0, 5})
    with pytest.raises(RecomputeOptionError, match="collection of stage indices"):
        make_trainer(c, 2, "1f1b", recompute="all")


def _dist_recompute(rank: int, world: int) -> dict[str, Any]:
    out = {}
    searches: dict[tuple[str, int], LayoutSearch] = {}  # one trace of GPT-2 for both schedules
    for name, schedule in (("gpt2", "1f1b"), ("gpt2", "zbv")):
        res = _parity(name, schedule, transport="dist", searches=searches)
        out[f"{name}/{schedule}"] = {"checked": res["checked"], "recompute": res["recompute"]}
    return out


@pytest.mark.multiprocess
def test_recompute_over_gloo_processes_matches_reference() -> None:
    results = spawn(_dist_recompute, 2, timeout=300)
    for key in ("gpt2/1f1b", "gpt2/zbv"):
        assert all(res[key]["checked"] for res in results), key
        assert results[0][key]["recompute"] == list(range(2 if key.endswith("1f1b") else 4))


def test_trainer_follows_the_plans_choice_by_default() -> None:
    c = case("mlp", 2)
    plan = partition(c["model"], c["example"], 2, microbatches=4, schedule="gpipe", recompute=True)
    assert [st.recompute for st in plan.stages] == [True, True]
    assert PipelineTrainer(plan, c["loss"], transport="local").recompute == {0, 1}
    assert PipelineTrainer(plan, c["loss"], transport="local", recompute=False).recompute == frozenset()
    plain = partition(c["model"], c["example"], 2, microbatches=4, schedule="gpipe")
    assert PipelineTrainer(plain, c["loss"], transport="local").recompute == frozenset()


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_recomputation_under_bf16_autocast_replays_the_same_numbers(schedule: str) -> None:
    # The replay must run under the autocast the first forward ran in: then the recomputing
    # pipeline's gradients are bitwise those of the one that kept its activations.
    grads = []
    for recompute in (False, True):
        c = _gpt2_case(schedule)
        trainer = make_trainer(c, 2, schedule, precision="bf16", recompute=recompute)
        loss = trainer.forward_backward(c["x"], c["y"])
        grads.append((loss, {n: p.grad.clone() for n, p in trainer.named_parameters()}))
    (loss0, g0), (loss1, g1) = grads
    assert torch.equal(loss0, loss1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


def test_measured_timeline_counts_only_inputs_for_recomputing_stages() -> None:
    c = case("mlp", 2)
    peaks = {}
    for recompute in (False, True):
        trainer = make_trainer(c, 2, "gpipe", transport="sequential", record=True, recompute=recompute)
        trainer.forward_backward(c["x"], c["y"])
        peaks[recompute] = trainer.timeline().peak_bytes
    held = [4 * st.in_bytes for st in trainer.plan.stages]  # GPipe: all 4 micro-batches at once
    assert peaks[True] == pytest.approx(tuple(held))
    assert all(a < b for a, b in zip(peaks[True], peaks[False]))
