"""PipelineTrainer parity: loss, every gradient, and weights after 3 steps equal the unpartitioned model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parity import case, check_case, dist_worker, make_trainer
from runtime.launch import spawn
from runtime.trainer import MicrobatchError, split_microbatches

MODELS = ["mlp", "gpt2", "skip"]
SCHEDULES = ["gpipe", "1f1b"]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", MODELS)
def test_in_process_threads_match_reference(name: str, schedule: str) -> None:
    res = check_case(name, 3, schedule, transport="local")
    assert len({res["aliases"][n] for n in res["checked"]}) == res["tensors"]
    m, p = 4, 3
    want = [m] * p if schedule == "gpipe" else [min(m, p - s) for s in range(p)]
    assert [res["peak"][s] for s in range(p)] == want


@pytest.mark.parametrize("name", [*MODELS, "mlp-mb4"])
def test_sequential_transport_matches_reference(name: str) -> None:
    check_case(name, 2, "1f1b", transport="sequential")


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_processes_match_reference(world: int) -> None:
    cases = [(n, s) for n in MODELS for s in SCHEDULES] + [("mlp-mb4", "1f1b")]
    results = spawn(dist_worker, world, cases, timeout=600)
    for key in results[0]:  # together the ranks checked every tensor of the model
        aliases = results[0][key]["aliases"]
        covered = {aliases[n] for res in results for n in res[key]["checked"]}
        assert len(covered) == results[0][key]["tensors"], (key, sorted(covered))
    for rank, res in enumerate(results):
        for key, r in res.items():
            sched = key.split("/")[1]
            want = 4 if sched == "gpipe" else min(4, world - rank)
            assert r["peak"] == {rank: want}, (rank, key, r["peak"])
    # Every rank reports the same (broadcast) loss.
    for key in results[0]:
        assert len({round(res[key]["loss"], 6) for res in results}) == 1


def test_export_graph_on_another_micro_batch_size_is_a_clear_error() -> None:
    from partitioner.errors import PlanMismatchError
    from runtime.shapes import wire_shapes

    c = case("gpt2", 2)
    trainer = make_trainer(c, 2, "gpipe")
    traced = trainer.plan.traced
    with pytest.raises(PlanMismatchError, match="specialises the graph"):
        wire_shapes(traced.gm, {traced.input_names[0]: torch.zeros(3, 8, dtype=torch.long)}, method=traced.method)


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
    with pytest.raises(MicrobatchError, match="10.*4"):
        trainer.forward_backward(torch.randn(10, 16), torch.randn(10, 8))


def test_step_without_optimizer_says_how_to_fix() -> None:
    trainer = make_trainer(case("mlp", 2), 2, "gpipe")
    with pytest.raises(RuntimeError, match="optimizer="):
        trainer.step(torch.randn(8, 16), torch.randn(8, 8))


def test_a_failing_stage_stops_the_others_quickly() -> None:
    c = case("mlp", 2)

    def bad_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise ValueError("loss exploded")

    c["loss"] = bad_loss
    trainer = make_trainer(c, 2, "1f1b", timeout=60)
    with pytest.raises(ValueError, match="loss exploded"):
        trainer.forward_backward(torch.randn(8, 16), torch.randn(8, 8))


def test_state_dict_uses_original_names() -> None:
    c = case("mlp", 3)
    trainer = make_trainer(c, 3, "gpipe")
    assert set(trainer.state_dict()) == set(c["model"].state_dict())
    names = {n for n, _ in trainer.named_parameters()}
    assert names == {n for n, _ in nn.Module.named_parameters(c["model"])}
