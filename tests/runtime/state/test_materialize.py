"""Materialising a rank's stages from a model built on meta (issue 10, part 1)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from partitioner import partition
from partitioner.zoo import MLPChain
from rank_pool import Cases
from runtime.state.materialize import (
    MaterializeError,
    empty_weights,
    initialize,
    materialize,
    release_whole_copies,
    released_device,
    released_names,
)


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(module.named_parameters(remove_duplicate=False))
    out.update(module.named_buffers(remove_duplicate=False))
    return out


def test_empty_weights_puts_parameters_on_meta_keeps_buffers_and_restores_the_patch() -> None:
    original = nn.Module.register_parameter
    with empty_weights():
        bn = nn.BatchNorm1d(4)
        lin = nn.Linear(8, 8)
    assert lin.weight.is_meta and bn.weight.is_meta and isinstance(lin.weight, nn.Parameter)
    assert not bn.running_var.is_meta and torch.equal(bn.running_var, torch.ones(4))
    assert nn.Module.register_parameter is original
    with pytest.raises(ValueError), empty_weights():
        raise ValueError("inside")
    assert nn.Module.register_parameter is original


def test_only_the_asked_stages_become_real_with_plan_independent_values() -> None:
    torch.manual_seed(0)
    with empty_weights():
        model = MLPChain((16, 32, 32, 32, 8))
    plan = partition(model, (torch.randn(2, 16),), 2, microbatches=2)
    staged = plan.build_stages()
    rng = torch.random.get_rng_state()
    report = materialize(model, {1: staged[1]}, "cpu", seed=7)
    assert torch.equal(torch.random.get_rng_state(), rng)  # no side effect on the global RNG
    real = {n for n, t in _tensors(model).items() if not t.is_meta}
    assert real == set(_tensors(staged[1])) and set(report.tensors) == real
    assert all(t.is_meta for t in _tensors(staged[0]).values())
    assert report.bytes == sum(t.numel() * 4 for n, t in _tensors(model).items() if n in real)
    reference = MLPChain((16, 32, 32, 32, 8))
    initialize(reference, seed=7)
    ref = _tensors(reference)
    for name, t in _tensors(staged[1]).items():
        assert torch.equal(t, ref[name]), name
        assert t is _tensors(model)[name]  # the model and the stage hold the same tensor
    # Another stage count, another rank: the same values for the same names.
    plan4 = partition(copy.deepcopy(reference).to("meta"), (torch.randn(2, 16),), 4, microbatches=4)
    staged4 = plan4.build_stages()
    materialize(None, {3: staged4[3]}, "cpu", seed=7, init_fn=lambda name, m: m.reset_parameters())
    assert all(torch.equal(t, ref[n]) for n, t in _tensors(staged4[3]).items() if not t.is_meta)


def _llama(tie: bool = False) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    from partitioner.tracing.trace import CausalLMLogits

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32,
                                   tie_word_embeddings=tie)
    return CausalLMLogits(transformers.LlamaForCausalLM(cfg))


@pytest.mark.parametrize("build", ["empty_weights", "meta_device"])
def test_llama_stages_materialise_to_the_weights_and_buffers_of_a_real_model(build: str) -> None:
    if build == "empty_weights":
        with empty_weights():
            model = _llama(tie=True)
    else:  # everything on meta: Hugging Face's own _init_weights recomputes the rotary table
        with torch.device("meta"):
            model = _llama(tie=True)
    ids = torch.randint(0, 64, (2, 8))
    plan = partition(model, (ids,), 2, microbatches=2)
    staged = plan.build_stages()
    report = materialize(model, dict(enumerate(staged)), "cpu", seed=3)
    # A buffer the forward never reads and no state_dict holds is in no stage: it stays on meta.
    left = [n for n, t in _tensors(model).items() if t.is_meta]
    assert left == ([] if build == "empty_weights" else ["model.model.rotary_emb.original_inv_freq"])
    assert report.initialised and set(report.initialised.values()) == {"hf"}
    reference = _llama(tie=True)
    initialize(reference, seed=3)
    ref = _tensors(reference)
    for name, t in _tensors(model).items():
        assert name in left or torch.equal(t, ref[name]), name
    tied = _tensors(model)
    assert tied["model.lm_head.weight"] is tied["model.model.embed_tokens.weight"]
    with torch.no_grad():
        torch.testing.assert_close(staged(ids)[0], reference(ids))


class _Table(nn.Module):
    """A buffer __init__ computes and checkpoints do not hold, and a bare parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(6.0).reshape(2, 3), persistent=False)
        self.scale = nn.Parameter(torch.ones(3))
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * self.scale) + self.table.sum(0)


def test_a_buffer_lost_on_meta_or_a_parameter_nothing_initialises_is_named() -> None:
    with torch.device("meta"):
        model = _Table()
    staged = partition(model, (torch.randn(2, 3),), 1, microbatches=1).build_stages()
    want = (r"not initialised: \['scale', '_tensor_constant0 \(a constant the trace computed from tensors of "
            r"the model, here on meta\)'\].*_Table.*init_fn.*empty_weights")
    with pytest.raises(MaterializeError, match=want):
        materialize(model, {0: staged[0]}, "cpu")

    with empty_weights():
        model = _Table()
    staged = partition(model, (torch.randn(2, 3),), 1, microbatches=1).build_stages()
    with pytest.raises(MaterializeError, match=r"not initialised: \['scale'\]"):
        materialize(model, {0: staged[0]}, "cpu")
    assert torch.equal(model.table, torch.arange(6.0).reshape(2, 3))  # kept real by empty_weights

    def init_fn(name: str, module: nn.Module) -> None:
        if isinstance(module, _Table):
            nn.init.ones_(module.scale)
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    with empty_weights():
        model = _Table()
    staged = partition(model, (torch.randn(2, 3),), 1, microbatches=1).build_stages()
    report = materialize(model, {0: staged[0]}, "cpu", init_fn=init_fn)
    assert torch.equal(model.scale, torch.ones(3)) and report.initialised == {"": "init_fn", "lin": "init_fn"}
    # A name a checkpoint fills next is not an error even when nothing initialises it.
    with empty_weights():
        model = _Table()
    staged = partition(model, (torch.randn(2, 3),), 1, microbatches=1).build_stages()
    materialize(model, {0: staged[0]}, "cpu", will_load=["scale"])


# -- the trainer materialises its own stages --------------------------------------------------------


def _meta_gpt2_case(world: int) -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    """A GPT-2 (tied embeddings) built under empty_weights, its real twin initialised alike, a batch."""
    from partitioner.zoo import gpt2

    with empty_weights():
        model, _ = gpt2(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, batch=2, seq=8)
    reference, _ = gpt2(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, batch=2, seq=8)
    initialize(reference, seed=11)
    gen = torch.Generator().manual_seed(5)
    return model, reference, torch.randint(0, 64, (8, 8), generator=gen), torch.randint(0, 64, (8, 8), generator=gen)


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _train_meta(rank: int, world: int, weights: str | None = None) -> dict[str, object]:
    """One step of a meta-built GPT-2 on ``world`` stages, initialised (seed 11) or loaded from
    ``weights`` (a checkpoint of the real twin, whose gradients are the reference either way)."""
    from parity import check_grads, reference
    from runtime import PipelineTrainer

    model, ref, x, y = _meta_gpt2_case(world)
    if weights is not None:
        ref.load_state_dict(torch.load(weights + "/twin.pt", weights_only=True))
    plan = partition(model, (x[:2],), world, microbatches=4)
    transport = "dist" if torch.distributed.is_initialized() else "local"
    trainer = PipelineTrainer(plan, _lm_loss, schedule="1f1b", transport=transport, seed=11, timeout=60,
                              weights=weights)
    loss = trainer.forward_backward(x, y)
    want_loss, want = reference(ref, _lm_loss, (x,), y)
    torch.testing.assert_close(loss, want_loss)
    checked = check_grads(trainer, want)
    real = sorted(n for n, t in _tensors(model).items() if not t.is_meta)
    held = sorted({n for s in trainer.stages.values() for n in _tensors(s.module)})
    return {"checked": checked, "real": real, "held": held}


def test_the_trainer_materialises_a_meta_model_and_trains_it_exactly() -> None:
    out = _train_meta(0, 2)
    assert out["real"] == out["held"] and out["checked"]


def _train_meta_part(rank: int, world: int, key: str, weights: str) -> dict[str, object]:
    """``_train_meta`` initialised (``key`` 'initialised') or loaded from ``weights`` ('loaded')."""
    return _train_meta(rank, world, weights if key == "loaded" else None)


@pytest.fixture(scope="module")
def over_gloo(tmp_path_factory: pytest.TempPathFactory) -> Cases:
    """Each of 2 gloo ranks' ``_train_meta``, initialised or loaded from a sharded checkpoint: a case
    each on the pool's ranks, run when a test asks for it."""
    source = _checkpoint_of_a_twin(tmp_path_factory.mktemp("twin"))
    return Cases(_train_meta_part, 2, source, timeout=300)


@pytest.mark.multiprocess
def test_over_gloo_each_rank_allocates_only_its_own_stages(over_gloo: Cases) -> None:
    results = over_gloo("initialised")
    for r in results:
        assert r["real"] == r["held"], "a rank allocated tensors of another rank's stage"
    both = set(results[0]["real"]) & set(results[1]["real"])
    assert both <= {"model.transformer.wte.weight", "model.lm_head.weight"}  # the tied embedding lives on both
    model, _, _, _ = _meta_gpt2_case(2)
    every = {n for n, p in model.named_parameters()}
    assert set(results[0]["checked"]) | set(results[1]["checked"]) >= every


def _checkpoint_of_a_twin(directory: Path) -> str:
    """Sharded safetensors of a GPT-2 twin with other weights than seed 11 gives (and a torch copy)."""
    from runtime import save_safetensors

    _, twin, _, _ = _meta_gpt2_case(2)
    initialize(twin, seed=99)
    state = twin.state_dict()
    save_safetensors(state, directory, max_shard_bytes=40_000)
    torch.save(state, directory / "twin.pt")
    assert len(list(directory.glob("*.safetensors"))) > 1
    return str(directory)


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.multiprocess)])
def test_the_trainer_loads_its_stages_from_a_sharded_checkpoint(
    tmp_path: Path, world: int, request: pytest.FixtureRequest
) -> None:
    if world == 1:
        out = _train_meta(0, 2, _checkpoint_of_a_twin(tmp_path))
    else:  # rank 0 of the pool's case
        out = request.getfixturevalue("over_gloo")("loaded")[0]
    assert out["real"] == out["held"] and out["checked"]


def test_released_weights_stay_tied_on_meta_and_still_give_the_graph_its_shapes() -> None:
    # What an FSDP trainer leaves of the whole weights it sharded: one meta stand-in per tensor
    # (a tie stays a tie, requires_grad kept), marked with its device; a fake run of the traced
    # graph (the trainer's check of new micro-batch sizes) still finds every shape.
    from runtime.execute.shapes import wire_shapes

    model = MLPChain((8, 8, 8, 8))
    model.layers[2].weight = model.layers[0].weight  # a tie
    model.layers[1].bias.requires_grad_(False)
    plan = partition(model, (torch.randn(2, 8),), num_stages=1)
    want = wire_shapes(plan.traced.gm, {m.name: torch.zeros(5, 8) for m in plan.traced.example_inputs})
    whole = [model.layers[0].weight, model.layers[1].bias]
    released = release_whole_copies([plan.model, plan.traced.gm], whole)
    assert released == (8 * 8 + 8) * 4  # the tie counted once
    assert model.layers[2].weight is model.layers[0].weight and model.layers[0].weight.is_meta
    assert not model.layers[1].bias.requires_grad and released_device(model.layers[1].bias) == torch.device("cpu")
    assert released_device(model.layers[1].weight) is None and not model.layers[1].weight.is_meta
    assert sorted(released_names(model)) == ["layers.0.weight", "layers.1.bias", "layers.2.weight"]
    assert release_whole_copies([model], whole) == 0  # nothing left to release
    got = wire_shapes(plan.traced.gm, {m.name: torch.zeros(5, 8) for m in plan.traced.example_inputs})
    assert got == want
    assert plan.traced.gm.get_parameter(next(n for n, _ in plan.traced.gm.named_parameters())).is_meta  # put back


def test_new_micro_batch_sizes_are_found_with_other_ranks_stages_still_on_meta() -> None:
    # A rank of a meta-built model materialises its own stages only; the trainer's fake run of the
    # whole traced graph at a micro-batch size other than the plan's example must still find every
    # shape (meta tensors stand in as fakes on the inputs' device), and leave the meta ones in place.
    from runtime.execute.shapes import wire_shapes

    model = MLPChain((8, 8, 8, 8))
    plan = partition(model, (torch.randn(2, 8),), num_stages=1)
    inputs = {m.name: torch.zeros(5, 8) for m in plan.traced.example_inputs}
    want = wire_shapes(plan.traced.gm, inputs)
    meta = copy.deepcopy(model.layers[1]).to("meta")
    gm = plan.traced.gm
    owner = gm.get_submodule("layers.1")  # the traced graph calls the model's own Linear
    owner.weight, owner.bias = meta.weight, meta.bias
    assert wire_shapes(gm, inputs) == want
    assert owner.weight.is_meta and isinstance(owner.weight, nn.Parameter)  # put back
