"""PipelineTrainer parity: loss, every gradient, and weights after 3 steps equal the unpartitioned model."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from parity import (
    TOL,
    _fresh,
    _fresh_y,
    case,
    check_case,
    check_grads,
    dist_workers,
    make_trainer,
    reference_grads,
    stages_for,
)
from partitioner import partition
from partitioner.schedule.registry import get_schedule
from partitioner.schedule.validation import peak_inflight
from profiles import in_profile
from rank_pool import LaunchError, spawn
from runtime.errors import StageError, TrainerStateError
from runtime.trainer import MicrobatchError, PipelineTrainer, split_microbatches

MODELS = ["mlp", "gpt2", "skip"]
SCHEDULES = ["gpipe", "1f1b"]
# Split backward and several stages per rank: interleaved (v = 2) and ZB-V put 2 stages per rank.
NEW_SCHEDULES = ["interleaved", "zbh1", "zbv"]
# Gloo world sizes: 2 runs every schedule (interleaved and ZB-V with two stages a rank); the same
# matrix over 4 ranks is the long profile's.
WORLDS = [2, pytest.param(4, marks=pytest.mark.long)]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", MODELS)
def test_in_process_threads_match_reference(name: str, schedule: str) -> None:
    res = check_case(name, 3, schedule, transport="local")
    assert len({res["aliases"][n] for n in res["checked"]}) == res["tensors"]
    m, p = 4, 3
    want = [m] * p if schedule == "gpipe" else [min(m, p - s) for s in range(p)]
    assert [res["peak"][s] for s in range(p)] == want


@pytest.mark.parametrize("schedule", NEW_SCHEDULES)
@pytest.mark.parametrize("name", MODELS)
def test_new_schedules_in_process_match_reference(name: str, schedule: str) -> None:
    # Two ranks (3 for ZB-H1, so a stage defers a W): 4 stages for interleaved and ZB-V.
    ranks = 3 if schedule == "zbh1" else 2
    S = stages_for(schedule, ranks)
    res = check_case(name, S, schedule, transport="local")
    assert len({res["aliases"][n] for n in res["checked"]}) == res["tensors"]
    kw = {"v": 2} if schedule == "interleaved" else {}
    sched = get_schedule(schedule, ranks, 4, **kw)
    assert res["stage_to_rank"] == list(sched.stage_to_rank)
    # The executor's measured per-stage peak equals the schedule's unit-time count.
    assert [res["peak"][s] for s in range(S)] == list(peak_inflight(sched))
    if name == "gpt2":  # tied embedding on stages 0 and S-1: one copy per rank thread
        assert res["tied_groups"] == int(sched.stage_to_rank[0] != sched.stage_to_rank[S - 1])


@pytest.mark.parametrize("name", [*MODELS, "mlp-mb4"])
def test_sequential_transport_matches_reference(name: str) -> None:
    check_case(name, 2, "1f1b", transport="sequential")


@pytest.mark.parametrize(("name", "schedule"), [("gpt2", "zbv"), ("skip", "interleaved"), ("mlp-mb4", "zbh1")])
def test_sequential_transport_runs_new_schedules(name: str, schedule: str) -> None:
    res = check_case(name, stages_for(schedule, 2), schedule, transport="sequential")
    assert [res["peak"][s] for s in range(len(res["want_peak"]))] == res["want_peak"]


def _gloo_cases(world: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Per world size, the (model, schedule) cases run over gloo, and those run with grouped messages."""
    cases = [(n, s) for n in MODELS for s in SCHEDULES + NEW_SCHEDULES] + [("mlp-mb4", "1f1b")]
    if world == 2:
        cases.append(("mlp-mb4", "zbv"))
    # The skip model's stem feeds the last stage: over 4 ranks 1F1B's and ZB-H1's grouped
    # programs could wait in a circle, and NCCL refuses them (test_placement); GPipe's finishes.
    grouped = [(n, s) for n in MODELS for s in ("gpipe", "1f1b", "zbh1")
               if not (n == "skip" and world > 2 and s != "gpipe")] + [("mlp-mb4", "1f1b")]
    # The default profile: every schedule over gloo on GPT-2 (tied embedding, every placement), the
    # skip model's stem crossing ranks in a loop and a V, and micro-batches of another size; the
    # MLP's and the rest of the skip model's cases (each also run in-process above) are the long
    # profile's.
    plain_long = [(n, s) for n, s in cases if n == "mlp" or (n == "skip" and s not in ("1f1b", "zbv"))]
    grouped_long = [(n, s) for n, s in grouped if n == "mlp" or (n == "skip" and s != "gpipe")]
    return (list(in_profile(dict.fromkeys(cases), plain_long)),
            list(in_profile(dict.fromkeys(grouped), grouped_long)))


_Gloo = tuple[list[dict[str, Any]], list[dict[str, Any]], Path | None]


@pytest.fixture(scope="module")
def over_gloo(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], _Gloo]:
    """Per world size, one spawn runs every case, plain then grouped (processes and imports are
    the slow part): each rank's results of both, and the ZB-V trace written at world 2."""
    runs: dict[int, _Gloo | BaseException] = {}

    def run(world: int) -> _Gloo:
        if world not in runs:
            trace = tmp_path_factory.mktemp("gloo") / "zbv.json" if world == 2 else None
            try:
                results = spawn(dist_workers, world, *_gloo_cases(world), trace and str(trace), timeout=600)
                runs[world] = ([r[0] for r in results], [r[1] for r in results], trace)
            except LaunchError as e:  # both tests of this world size report it, without a second spawn
                runs[world] = e
        got = runs[world]
        if isinstance(got, BaseException):
            raise got
        return got

    return run


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", WORLDS)
def test_gloo_processes_match_reference(world: int, over_gloo: Callable[[int], _Gloo]) -> None:
    plain, _, trace = over_gloo(world)
    results = [dict(res) for res in plain]
    extra = [res.pop("_extra", None) for res in results]
    for key in results[0]:  # together the ranks checked every tensor of the model
        aliases = results[0][key]["aliases"]
        covered = {aliases[n] for res in results for n in res[key]["checked"]}
        assert len(covered) == results[0][key]["tensors"], (key, sorted(covered))
    for rank, res in enumerate(results):
        for key, r in res.items():
            sched = key.split("/")[1]
            if sched in SCHEDULES:
                want = 4 if sched == "gpipe" else min(4, world - rank)
                assert r["peak"] == {rank: want}, (rank, key, r["peak"])
            # Each rank measured its own stages' peaks: the schedule's unit-time count.
            mine = {s: n for s, (n, q) in enumerate(zip(r["want_peak"], r["stage_to_rank"])) if q == rank}
            assert r["peak"] == mine, (rank, key, r["peak"], mine)
            assert len(mine) == (2 if sched in ("interleaved", "zbv") else 1)
    # Every rank reports the same (broadcast) loss.
    for key in results[0]:
        assert len({round(res[key]["loss"], 6) for res in results}) == 1
    # GPT-2's tied embedding: ZB-V keeps its two holders (stages 0 and S-1) on rank 0, one object;
    # interleaved puts them on ranks 0 and world-1, kept equal by summing gradients.
    assert [res["gpt2/zbv"]["tied_groups"] for res in results] == [0] * world
    assert [res["gpt2/interleaved"]["tied_groups"] for res in results] == [1] + [0] * (world - 2) + [1]
    if world == 2:
        assert "--nproc-per-node 1" in extra[0]["refused"] and "2 processes" in extra[0]["refused"]
        assert extra[0]["written"] == str(trace) and [e["written"] for e in extra[1:]] == [None]
        events = json.loads(trace.read_text())["traceEvents"]
        spans = [e for e in events if e["ph"] == "X"]
        assert len(spans) == sum(e["records"] for e in extra) == 4 * 4 * 3  # S x m x (F, I, W)
        assert {e["tid"] for e in spans} == {0, 1}
        assert {e["name"] for e in spans if e["tid"] == 1} >= {"1F0", "2I3", "1W3"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", WORLDS)
def test_grouped_messages_match_reference(world: int, over_gloo: Callable[[int], _Gloo]) -> None:
    """The program NCCL runs (each action's sends posted with the next one's receives, as one
    ``batch_isend_irecv``), run over gloo: exact for the schedules NCCL accepts."""
    from partitioner.schedule.comm import needs_early_receives
    from partitioner.schedule.registry import get_schedule

    cases = _gloo_cases(world)[1]
    assert not any(needs_early_receives(get_schedule(s, world, 4)) for _, s in cases)
    _, results, _ = over_gloo(world)
    assert [set(res) for res in results] == [{f"{n}/{s}" for n, s in cases}] * world
    for key in results[0]:
        aliases = results[0][key]["aliases"]
        covered = {aliases[n] for res in results for n in res[key]["checked"]}
        assert len(covered) == results[0][key]["tensors"], (key, sorted(covered))
        assert len({round(res[key]["loss"], 6) for res in results}) == 1


def test_export_graph_runs_other_micro_batch_sizes_and_names_fixed_ones() -> None:
    from partitioner import partition
    from partitioner.errors import PlanMismatchError
    from rotary_case import RotaryNet
    from runtime.execute.shapes import wire_shapes

    c = case("gpt2", 2)
    trainer = make_trainer(c, 2, "gpipe")
    traced = trainer.plan.traced
    # The batch (and the token sequence) were traced as dynamic: other sizes have wire shapes.
    shapes = wire_shapes(traced.gm, {traced.input_names[0]: torch.zeros(3, 5, dtype=torch.long)}, method=traced.method)
    hidden = next(v for v in trainer.plan.io[0].outputs if v.kind == "tensor" and v.shape[:2] == (2, 8))
    assert shapes[hidden.name][:2] == (3, 5)
    # A float input's other dimensions stay fixed: running another size says so.
    plan = partition(RotaryNet(), (torch.randn(2, 6, 8),), 2)
    with pytest.raises(PlanMismatchError, match="fixed the sizes"):
        wire_shapes(plan.traced.gm, {plan.input_names[0]: torch.zeros(2, 7, 8)}, method="export")


def test_tied_embeddings_are_shared_and_listed() -> None:
    c = case("gpt2", 3)
    trainer = make_trainer(c, 3, "1f1b")
    shared = dict(trainer.plan.shared_params)
    # The wrapper's embedding and head are one tensor, listed once under one of its names.
    assert set(shared) & {"model.transformer.wte.weight", "model.lm_head.weight"}
    assert list(shared.values()) == [(0, 2)]


def test_tied_copies_on_different_devices_stay_identical() -> None:
    # cpu and cpu:0 are distinct devices to the trainer: the tied weight is copied per device
    # and its gradients summed, the path multi-GPU single-process runs take.
    c = case("gpt2", 2)
    ref_trainer = make_trainer(case("gpt2", 2), 2, "1f1b")
    trainer = make_trainer(c, 2, "1f1b", devices=["cpu", "cpu:0"],
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert trainer._tied, "expected the tied embedding to be copied across devices"
    x = torch.randint(0, 64, (8, 8))
    y = torch.randint(0, 64, (8, 8))
    trainer.step(x, y)
    (copies, _), = trainer._tied
    torch.testing.assert_close(copies[0].detach(), copies[1].detach())
    ref_trainer.forward_backward(x, y)


def test_predict_equals_model_output() -> None:
    c = case("skip", 3)
    trainer = make_trainer(c, 3, "1f1b")
    x = torch.randn(8, 12)
    with torch.no_grad():
        torch.testing.assert_close(trainer.predict(x), c["model"](x))


def test_uneven_batch_is_a_clear_error() -> None:
    with pytest.raises(MicrobatchError, match="batch of 10 cannot be split into 4"):
        split_microbatches(torch.zeros(10, 3), 4)
    c = case("mlp", 2)
    trainer = make_trainer(c, 2, "gpipe")
    with pytest.raises(MicrobatchError, match=r"10.*4"):
        trainer.forward_backward(torch.randn(10, 16), torch.randn(10, 8))


def test_step_without_optimizer_says_how_to_fix() -> None:
    trainer = make_trainer(case("mlp", 2), 2, "gpipe")
    with pytest.raises(RuntimeError, match="optimizer=") as info:
        trainer.step(torch.randn(8, 16), torch.randn(8, 8))
    assert isinstance(info.value, TrainerStateError)


def test_a_failing_stage_stops_the_others_quickly() -> None:
    c = case("mlp", 2)

    def bad_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise ValueError("loss exploded")

    c["loss"] = bad_loss
    trainer = make_trainer(c, 2, "1f1b", timeout=60)
    start = time.monotonic()
    with pytest.raises(StageError, match="loss exploded") as err:  # the first error, not a peer's timeout
        trainer.forward_backward(torch.randn(8, 16), torch.randn(8, 8))
    assert isinstance(err.value.__cause__, ValueError) and time.monotonic() - start < 30


def test_state_dict_uses_original_names() -> None:
    c = case("mlp", 3)
    trainer = make_trainer(c, 3, "gpipe")
    assert set(trainer.state_dict()) == set(c["model"].state_dict())
    names = {n for n, _ in trainer.named_parameters()}
    assert names == {n for n, _ in nn.Module.named_parameters(c["model"])}


# -- several stages per rank, timelines ---------------------------------------------------------


def test_stage_count_that_does_not_fit_the_placement_is_a_clear_error() -> None:
    from runtime.transport.placement import PlacementError

    c = case("skip", 3)
    plan = make_trainer(c, 3, "1f1b").plan
    with pytest.raises(PlacementError, match=r"'zbv' places 2 stages per rank, but the plan has 3 stages.*2 or 4"):
        PipelineTrainer(plan, c["loss"], schedule="zbv")
    with pytest.raises(PlacementError, match=r"3 stages, not a multiple of 2"):
        PipelineTrainer(plan, c["loss"], schedule="interleaved")
    PipelineTrainer(plan, c["loss"], schedule="interleaved", chunks_per_rank=3)  # 1 rank, 3 chunks
    with pytest.raises(PlacementError, match="exactly 2 stages per rank"):
        PipelineTrainer(plan, c["loss"], schedule="zbv", chunks_per_rank=3)
    with pytest.raises(PlacementError, match=r"one stage per rank.*schedule='interleaved'"):
        PipelineTrainer(plan, c["loss"], schedule="1f1b", chunks_per_rank=3)


def test_stages_of_one_rank_must_share_a_device() -> None:
    from runtime.transport.placement import PlacementError

    c = case("mlp", 4)
    plan = make_trainer(c, 4, "zbv").plan
    # ZB-V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2.
    with pytest.raises(PlacementError, match=r"stages \[0, 3\] on rank 0.*devices=\['cpu', 'cpu:0', 'cpu:0', 'cpu'\]"):
        PipelineTrainer(plan, c["loss"], schedule="zbv", devices=["cpu", "cpu:0", "cpu", "cpu:0"])
    trainer = PipelineTrainer(plan, c["loss"], schedule="zbv", devices=["cpu", "cpu:0", "cpu:0", "cpu"])
    trainer.forward_backward(c["x"], c["y"])
    assert all(prm.grad is not None for prm in trainer.parameters())


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_predict_runs_on_the_schedules_placement(schedule: str) -> None:
    c = case("skip", 4)
    trainer = make_trainer(c, 4, schedule, record=True)
    x = torch.randn(8, 12)
    with torch.no_grad():
        torch.testing.assert_close(trainer.predict(x), c["model"](x))
    assert {(r.rank, r.stage) for r in trainer.last_records} == {
        (q, s) for s, q in enumerate(trainer.schedule.stage_to_rank)}


def test_measured_timeline_and_trace_match_the_schedule(tmp_path: Path) -> None:
    from partitioner.schedule.timeline import Timeline, to_chrome_trace
    from partitioner.schedule.validation import peak_inflight_per_rank

    c = case("mlp", 4)
    trainer = make_trainer(c, 4, "zbv", record=True)
    with pytest.raises(RuntimeError, match="run step") as info:
        trainer.timeline()
    assert isinstance(info.value, TrainerStateError)
    trainer.forward_backward(c["x"], c["y"])
    t = trainer.timeline()
    assert isinstance(t, Timeline) and t.num_ranks == 2
    assert {x.label for x in t.spans} == {str(a) for row in trainer.schedule.actions for a in row}
    for r, row in enumerate(trainer.schedule.actions):  # each rank ran its list in order
        assert [x.label for x in t.of_rank(r)] == [str(a) for a in row]
    # Counted from the measured spans, the activations held peak as the schedule says.
    assert t.peak_inflight == peak_inflight_per_rank(trainer.schedule)
    # The plan's per-stage activation bytes weigh the memory curves (micro-batches of the example size).
    assert t.activation_bytes == tuple(st.act_bytes for st in trainer.plan.stages)
    assert t.peak_bytes is not None and all(b > 0 for b in t.peak_bytes)
    assert {m.what for m in t.messages} == {"act", "grad"}

    path = trainer.save_trace(tmp_path / "zbv.json")
    events = json.loads(path.read_text())["traceEvents"]
    assert events == to_chrome_trace(t, name="pipecut zbv (measured)")["traceEvents"]
    assert {e["ph"] for e in events} >= {"M", "X", "s", "f", "C"}


def test_timeline_needs_recording() -> None:
    trainer = make_trainer(case("mlp", 2), 2, "zbh1")
    trainer.forward_backward(torch.randn(8, 16), torch.randn(8, 8))
    with pytest.raises(RuntimeError, match="record=True") as info:
        trainer.timeline()
    assert isinstance(info.value, TrainerStateError)


def test_actions_are_labelled_for_the_profiler() -> None:
    c = case("mlp", 4)
    trainer = make_trainer(c, 4, "zbv", transport="sequential")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainer.forward_backward(c["x"], c["y"])
    names = {e.name for e in prof.events() if e.name.startswith("pipecut ")}
    assert names == {f"pipecut {a}" for row in trainer.schedule.actions for a in row}


@pytest.mark.parametrize("schedule", ["zbh1", "zbv"])
def test_split_backward_frees_every_saved_activation_by_the_end_of_the_step(schedule: str) -> None:
    # I keeps the graph for W (retain_graph); nothing may keep it past W. The pack hook holds
    # detached copies, so only the graph's own saved-tensor slots keep a box alive.
    import weakref

    class Box:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    boxes: list[weakref.ref[Box]] = []

    def pack(t: torch.Tensor) -> Box:
        box = Box(t.detach())
        boxes.append(weakref.ref(box))
        return box

    c = case("gpt2", 4)
    trainer = make_trainer(c, 4, schedule, transport="sequential")  # one thread: the hooks apply
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
        trainer.forward_backward(c["x"], c["y"])
    assert boxes and not [b for b in boxes if b() is not None]


def test_recorded_actions_start_when_their_inputs_arrived() -> None:
    c = case("mlp", 2)
    trainer = make_trainer(c, 2, "1f1b", record=True)
    trainer.forward_backward(torch.randn(8, 16), torch.randn(8, 8))
    recs = {(r.stage, r.kind, r.mb): r for r in trainer.last_records}
    for mb in range(4):
        consumer, producer = recs[(1, "F", mb)], recs[(0, "F", mb)]
        # Stage 1's forward cannot compute before stage 0's forward of the same micro-batch ended;
        # the time it sat waiting is reported apart, as idle time.
        assert consumer.start >= producer.end - 1e-4
        assert consumer.waited >= 0.0 and consumer.start <= consumer.end
    assert any(r.waited > 0 for r in trainer.last_records)


@pytest.mark.parametrize("schedule", ["interleaved", "1f1b"])
def test_gradients_accumulate_over_forward_backward_calls_with_a_tied_weight(schedule: str) -> None:
    # GPT-2's tied embedding: interleaved puts its holders on two rank threads (two copies whose
    # gradients are summed), 1F1B on two stages of 2 ranks. Two calls must add, counting each once.
    c = case("gpt2", stages_for(schedule, 2))
    ref = copy.deepcopy(c["model"])
    trainer = make_trainer(c, stages_for(schedule, 2), schedule)
    gen = torch.Generator().manual_seed(5)
    batches = [(_fresh(c, gen), _fresh_y(c, gen)) for _ in range(2)]
    ref.zero_grad()
    for x, y in batches:
        trainer.forward_backward(x, y)
        c["loss"](ref(x), y).backward()
    want = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    check_grads(trainer, want)


def test_stages_run_on_their_device_whatever_device_the_trace_recorded() -> None:
    """Export records the tracing device in factory calls (GPT-2's position ids: ``arange(...,
    device=cpu)``); a stage placed on another device must make them there (on a GPU the stages
    once made position ids on the CPU and failed). Emulated on the CPU: the trace is made to
    record ``meta``, the stages run on the CPU, and the traced graph is left as it was."""
    from partitioner.tracing.trace import retarget_device

    c = case("gpt2", 2)
    ref = copy.deepcopy(c["model"])
    plan = partition(c["model"], c["example"], 2, microbatches=4)
    assert retarget_device(plan.traced.gm, "meta") > 0  # as if traced on another device
    traced = [(n.name, n.args, n.kwargs) for n in plan.traced.gm.graph.nodes]
    trainer = PipelineTrainer(plan, c["loss"], transport="local", devices=["cpu", "cpu"])
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 64, (8, 8), generator=gen), torch.randint(0, 64, (8, 8), generator=gen)
    loss = trainer.forward_backward(x, y)
    want_loss, want = reference_grads(c, ref, x, y)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert len(check_grads(trainer, want)) == len(want)
    assert [(n.name, n.args, n.kwargs) for n in plan.traced.gm.graph.nodes] == traced
