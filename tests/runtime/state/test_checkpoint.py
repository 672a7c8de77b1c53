"""Checkpoints (issue 10, part 3): exact resume, resharding across plans, export, crash safety."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

from partitioner import partition
from partitioner.search import LayoutSearch
from rank_pool import spawn
from runtime import PipelineTrainer
from runtime.state.checkpoint import CheckpointError, load_model
from tests.runtime.parity import plan_once

STEPS = 3
# GPT-2 traced once per process and stage count, planned from that trace for every schedule and
# each trainer (``parity.plan_once``: tracing is most of a trainer's making). A trainer built after
# another takes the traced model over, with its own fresh weights: the earlier one is not used again.
_SEARCHES: dict[tuple[str, int], LayoutSearch] = {}


def _case(name: str) -> tuple[nn.Module, torch.Tensor, Any]:
    """A model (same weights every call), its example micro-batch and loss."""
    torch.manual_seed(21)
    if name == "gpt2":
        from partitioner.zoo import gpt2

        model, _ = gpt2(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, batch=2, seq=8)
        return model, torch.zeros(2, 8, dtype=torch.long), _lm_loss
    from partitioner.zoo import MLPChain

    return MLPChain((16, 32, 32, 32, 8)), torch.zeros(2, 16), nn.functional.mse_loss


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    if name == "gpt2":
        return torch.randint(0, 64, (8, 8), generator=gen), torch.randint(0, 64, (8, 8), generator=gen)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)


def _trainer(name: str, stages: int, schedule: str = "1f1b", transport: str = "local", *,
             fresh: bool = False, searches: dict[tuple[str, int], LayoutSearch] = _SEARCHES) -> PipelineTrainer:
    """A trainer of ``name`` on ``stages``; GPT-2's plan from ``searches``' one trace of it."""
    model, example, loss = _case(name)
    if fresh:  # other weights than the saved run's: a load must overwrite every one
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
    c = {"model": model, "example": (example,), "x": _batch(name, 0)[0]}
    plan_once(c, name, stages, schedule, searches)
    plan = c["plan"] if "plan" in c else partition(model, (example,), stages, microbatches=4, schedule=schedule)
    return PipelineTrainer(
        plan, loss, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), schedule=schedule,
        transport=transport, timeout=60,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k)),
    )


def _run(trainer: PipelineTrainer, name: str, steps: range) -> list[float]:
    return [float(trainer.step(*_batch(name, k))) for k in steps]


def _params(trainer: PipelineTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.named_parameters()}


def _by_value(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """numpy copies: they travel back from a spawned rank by value (a tensor would point at the
    rank's shared memory, gone once it exits)."""
    return {n: t.numpy().copy() for n, t in tensors.items()}


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() <= want.keys() and got
    for n, t in got.items():
        assert torch.equal(t, want[n]), n


# -- exact resume ------------------------------------------------------------------------------


def _first_half(rank: int, world: int, name: str, directory: str, transport: str) -> dict[str, Any]:
    """6 uninterrupted steps; then a fresh trainer's 3 steps, saved (both planned from one trace)."""
    searches: dict[tuple[str, int], LayoutSearch] = {}  # this case's own: a case is a process of its own
    whole = _trainer(name, world if transport == "dist" else 2, transport=transport, searches=searches)
    losses = _run(whole, name, range(2 * STEPS))
    final = _params(whole)
    part = _trainer(name, world if transport == "dist" else 2, transport=transport, searches=searches)
    _run(part, name, range(STEPS))
    part.save(directory)
    return {"losses": losses, "params": _by_value(final)}


def _second_half(rank: int, world: int, name: str, directory: str, transport: str) -> dict[str, Any]:
    """In a new process: a trainer with other weights loads the checkpoint, 3 more steps."""
    torch.manual_seed(12345)  # another RNG state than the saving run's: the checkpoint restores it
    trainer = _trainer(name, world if transport == "dist" else 2, transport=transport, fresh=True, searches={})
    trainer.load(directory)
    assert trainer.step_count == STEPS
    losses = _run(trainer, name, range(STEPS, 2 * STEPS))
    lr = trainer.optimizer.param_groups[0]["lr"] if trainer.optimizer is not None else None  # a stage may hold none
    return {"losses": losses, "params": _by_value(_params(trainer)), "lr": lr}


@pytest.mark.multiprocess
@pytest.mark.parametrize(("name", "world", "transport"), [
    ("gpt2", 1, "local"),  # one process (2 stages on threads), resumed in a new process
    ("gpt2", 2, "dist"),  # a stage per process, each rank saving and loading its own
    pytest.param("mlp", 4, "dist", marks=[pytest.mark.slow, pytest.mark.long]),  # the same, on more ranks
])
def test_resume_is_bitwise_exact(tmp_path: Path, name: str, world: int, transport: str) -> None:
    ckpt = str(tmp_path / "ckpt")
    first = spawn(_first_half, world, name, ckpt, transport, timeout=300)
    second = spawn(_second_half, world, name, ckpt, transport, timeout=300)
    for a, b in zip(first, second):
        assert b["losses"] == a["losses"][STEPS:]  # bitwise: floats compared exactly
        if not b["params"]:
            continue
        _assert_bitwise({n: torch.from_numpy(v) for n, v in b["params"].items()},
                        {n: torch.from_numpy(v) for n, v in a["params"].items()})
        assert b["lr"] is None or b["lr"] == pytest.approx(1e-2 / (1 + 2 * STEPS))


# -- resharding --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A GPT-2 trained 3 steps under a 2-stage 1F1B plan, saved; and its weights."""
    directory = tmp_path_factory.mktemp("reshard") / "ckpt"
    trainer = _trainer("gpt2", 2)
    _run(trainer, "gpt2", range(STEPS))
    trainer.save(directory)
    return directory, _params(trainer)


@pytest.fixture(scope="module")
def next_step(saved: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The saving plan's step after the checkpoint, from the checkpoint: loss and weights."""
    reference = _trainer("gpt2", 2, fresh=True)
    reference.load(saved[0])
    loss = reference.step(*_batch("gpt2", STEPS))
    return loss, _params(reference)


@pytest.mark.parametrize(("stages", "schedule"), [(4, "1f1b"), (4, "interleaved"), (4, "zbv"), (3, "gpipe")])
def test_a_checkpoint_loads_into_another_plan_and_schedule(
    saved: Any, next_step: Any, stages: int, schedule: str
) -> None:
    directory, weights = saved
    trainer = _trainer("gpt2", stages, schedule, fresh=True)
    trainer.load(directory)
    _assert_bitwise(_params(trainer), weights)
    assert trainer.step_count == STEPS
    # The optimizer state came along: one more step equals the saving plan's next step.
    want_loss, want = next_step
    torch.testing.assert_close(trainer.step(*_batch("gpt2", STEPS)), want_loss)
    for n, t in _params(trainer).items():
        torch.testing.assert_close(t, want[n], rtol=1e-5, atol=1e-6)


def test_a_checkpoint_loads_into_the_plain_model(saved: Any) -> None:
    directory, weights = saved
    model, _, _ = _case("gpt2")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    names = load_model(model, directory)
    assert set(weights) <= set(names)
    plain = dict(model.named_parameters(remove_duplicate=False))
    _assert_bitwise({n: plain[n] for n in weights}, weights)


def test_weights_only_load_and_errors(saved: Any, tmp_path: Path) -> None:
    directory, weights = saved
    trainer = _trainer("gpt2", 2, fresh=True)
    trainer.load(directory, optimizer=False)
    _assert_bitwise(_params(trainer), weights)
    assert not trainer.optimizer.state
    with pytest.raises(CheckpointError, match="not a pipecut checkpoint"):
        trainer.load(tmp_path)
    other = _trainer("mlp", 2)
    with pytest.raises(CheckpointError, match=r"lacks .* entries this trainer needs"):
        other.load(directory)


def test_a_save_that_dies_midway_leaves_the_previous_checkpoint(saved: Any, tmp_path: Path, monkeypatch: Any) -> None:
    import shutil

    import torch.distributed.checkpoint as dcp

    directory = tmp_path / "ckpt"
    shutil.copytree(saved[0], directory)
    trainer = _trainer("gpt2", 2)
    _run(trainer, "gpt2", range(STEPS + 1))  # other weights than the saved ones
    real_save = dcp.save

    def dying_save(state: Any, *, checkpoint_id: str, **kw: Any) -> Any:
        real_save(dict(list(state.items())[:3]), checkpoint_id=checkpoint_id, **kw)
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        trainer.save(directory)
    monkeypatch.setattr(dcp, "save", real_save)
    fresh = _trainer("gpt2", 2, fresh=True)
    fresh.load(directory)  # still the complete, older checkpoint
    _assert_bitwise(_params(fresh), saved[1])
    partial = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.partial")]
    assert (partial and not (partial[0] / ".metadata").exists()) or partial
    with pytest.raises(CheckpointError):
        fresh.load(tmp_path / "never-written")


# -- export to Hugging Face --------------------------------------------------------------------


def _llama_trainer(stages: int, transport: str) -> tuple[PipelineTrainer, Any]:
    transformers = pytest.importorskip("transformers")
    from partitioner.tracing.trace import CausalLMLogits

    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32,
                                   tie_word_embeddings=True)
    model = CausalLMLogits(transformers.LlamaForCausalLM(cfg))
    plan = partition(model, (torch.zeros(2, 8, dtype=torch.long),), stages, microbatches=4)
    trainer = PipelineTrainer(plan, _lm_loss, lambda ps: torch.optim.SGD(ps, lr=0.1), transport=transport, timeout=60)
    trainer.step(*_batch("gpt2", 0))
    return trainer, cfg


def _export(rank: int, world: int, directory: str) -> dict[str, Any]:
    trainer, cfg = _llama_trainer(world, "dist" if world > 1 else "local")
    trainer.export_safetensors(directory, prefix="model.")
    if rank == 0:
        cfg.save_pretrained(directory)
    return _by_value({n.removeprefix("model."): p.detach() for n, p in trainer.named_parameters()})


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.multiprocess)])
def test_an_export_loads_into_the_original_hugging_face_class(tmp_path: Path, world: int) -> None:
    transformers = pytest.importorskip("transformers")
    directory = str(tmp_path / "hf")
    held = [_export(0, 1, directory)] if world == 1 else spawn(_export, world, directory, timeout=300)
    loaded = transformers.LlamaForCausalLM.from_pretrained(directory)
    state = dict(loaded.named_parameters(remove_duplicate=False))
    for part in held:
        for name, t in part.items():
            assert torch.equal(state[name], torch.from_numpy(t)), name
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    # The keys save_pretrained writes: the tied embedding once, under its first name, whichever
    # name the trace gave it (lm_head.weight) and whichever rank held it.
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    loaded.save_pretrained(tmp_path / "ref")
    assert set(index["weight_map"]) == set(safetensors.torch.load_file(tmp_path / "ref" / "model.safetensors"))
