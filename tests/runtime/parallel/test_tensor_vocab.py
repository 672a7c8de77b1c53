"""The vocabulary split over tp (``TensorParallel(vocab=True)``, ``runtime.parallel.vocab``): on 4 gloo
processes, 2 pp x tp 2, a Llama (untied) and a GPT-2 (``wte`` tied between the first stage and the
last) train as the plain model does (loss, every gradient, parameters after 3 clipped AdamW steps),
their embedding and LM head ``Shard(0)`` of ``V / tp`` rows; a step gathers nothing (the logits stay
``(B, T, V / tp)``), ``predict`` returns them whole, a loss the model computes from ``labels``
splits too (long profile), and a loss ``loss_parallel`` cannot run is refused. In one process: the
refusals of the rewrite itself."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import fx, nn

from rank_pool import Cases
from runtime.errors import TrainerOptionError
from runtime.options import TensorParallel
from runtime.parallel.vocab import VocabParallelError, parallelize_vocab, vocab_names, vocab_rows
from tests.runtime.parallel.test_tensor_trainer import _batch, _case
from tests.runtime.parity import TOL

V = 96  # the test models' vocabulary: 48 rows a rank


def _probe(trainer: Any, ref: nn.Module) -> dict[str, Any]:
    """After the parity run: the collectives of one forward_backward (no all-gather), the local logits'
    shape, ``predict``'s whole logits against the plain model's, and two losses refused."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Shard

    from runtime.parallel.vocab import Gathers, VocabLogits, VocabLossError, plain_loss

    x, y = _batch(torch.Generator().manual_seed(11))
    shapes: list[tuple[int, ...]] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: shapes.append(tuple(out.to_local().shape)))
             for st in trainer.stages.values() for m in st.module.modules() if isinstance(m, VocabLogits)]
    with Gathers() as gathers:
        trainer.forward_backward(x, y)
    for h in hooks:
        h.remove()
    out = trainer.predict(x)
    predicted = None
    if out is not None:
        with torch.no_grad():
            want = ref(x).logits
        predicted = {"type": type(out.logits).__name__, "shape": tuple(out.logits.shape),
                     "diff": float((out.logits - want).abs().max())}
    mesh = trainer.mesh.tp_mesh
    t = mesh.get_local_rank()
    logits = DTensor.from_local(torch.randn(2, 8, V // 2), mesh, [Shard(2)], run_check=False)
    refused = {}
    bad = {"smoothing": lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten(), label_smoothing=0.1),
           "gathered": lambda o, y: o.softmax(-1).amax(-1).mean()}
    for name, fn in bad.items():
        with pytest.raises(VocabLossError) as info:
            plain_loss(fn, logits, torch.zeros(2, 8, dtype=torch.long), f"tp rank {t}")
        refused[name] = str(info.value)
    return {"gathers": gathers.ops, "logits": shapes,
            "predicted": predicted, "refused": refused}


def _labels_case() -> dict[str, Any]:
    """A 2-layer Llama given ``labels``, its own loss (``out.loss``) computed in the last stage's graph
    on the split logits: the loss and every gradient against the plain model's, and the all-gathers
    of the second forward_backward (the first one's agreement on the batch gathers a few bytes)."""
    import copy

    from torch.distributed.tensor import DTensor

    from partitioner import partition
    from runtime.parallel.vocab import Gathers
    from runtime.trainer import PipelineTrainer
    from tests.runtime.parallel.test_tensor_trainer import _llama

    model = _llama(2)
    ref = copy.deepcopy(model)
    x, y = _batch(torch.Generator().manual_seed(5))
    plan = partition(model, (x[:2],), 2, microbatches=4, schedule="1f1b", split_points=["model.layers.1"],
                     example_kwargs={"labels": y[:2]})
    trainer = PipelineTrainer(plan, lambda out, _: out.loss, schedule="1f1b", transport="dist",
                              tensor_parallel=TensorParallel(size=2, vocab=True))
    trainer.forward_backward({"input_ids": x, "labels": y})
    trainer.zero_grad()
    with Gathers() as gathers:
        loss = trainer.forward_backward({"input_ids": x, "labels": y})
    want = ref(x, labels=y).loss
    want.backward()
    torch.testing.assert_close(loss, want.detach(), **TOL)
    grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    for n, prm in trainer.named_parameters():
        got = prm.grad.full_tensor() if isinstance(prm.grad, DTensor) else prm.grad
        torch.testing.assert_close(got, grads[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
    return {"gathers": gathers.ops}


# Each case of the file on 4 ranks of the pool, run when a test first asks for it: key -> the
# schedule, the stages and _case's options (``"labels"``: _labels_case).
_CASES: dict[str, tuple[str, int, dict[str, Any]]] = {
    "llama": ("1f1b", 2, {"probe": _probe}), "gpt2": ("1f1b", 2, {"family": "gpt2"}),
    "llama zbh1": ("zbh1", 2, {}), "gpt2 interleaved": ("interleaved", 4, {"family": "gpt2"}),
    "llama recompute": ("1f1b", 2, {"recompute": True}), "labels": ("labels", 2, {}),
    # TensorParallel(size=2), vocab left to the plan: one that splits only the embedding splits the vocabulary
    "embedding plan": ("1f1b", 2, {"family": "llama embedding plan", "vocab": None}),
}


def _part(rank: int, world: int, key: str) -> dict[str, Any]:
    schedule, stages, opts = _CASES[key]
    # eps 1e-4: the split head and loss sum the logits' classes in two halves; Adam's step near a
    # zero gradient moves by lr / eps times that round-off (eps 1e-5 left 1 element of 3,072 at 3e-6).
    return _labels_case() if schedule == "labels" else _case(schedule, stages, **{"vocab": True, "eps": 1e-4, **opts})


@pytest.fixture(scope="module")
def runs() -> Cases:
    pytest.importorskip("transformers")
    return Cases(_part, 4, timeout=420)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["llama", "gpt2", pytest.param("llama zbh1", marks=pytest.mark.long),
                                  pytest.param("gpt2 interleaved", marks=pytest.mark.long),
                                  pytest.param("llama recompute", marks=pytest.mark.long)])
def test_vocabulary_split_trains_as_the_plain_model(runs: Cases, case: str) -> None:
    # _case asserted the loss, every gradient (shards gathered) and every parameter after 3 clipped
    # AdamW steps against the plain model on every rank; here, the vocabulary's weights' shards.
    for rank, got in enumerate(runs(case)):
        first, last = got["stages"][0] == 0, got["stages"][-1] == (3 if case.endswith("interleaved") else 1)
        if case.startswith("gpt2"):  # tied: wte read by the first stage's embedding and the last's head
            vocab = {"lm_head.weight"} & set(got["names"]) if first else set()
            vocab |= {"transformer.wte.weight"} & set(got["names"]) if last else set()
        else:
            vocab = ({"model.embed_tokens.weight"} if first else set()) | ({"lm_head.weight"} if last else set())
        assert vocab and vocab <= set(got["sharded"]), (rank, got["sharded"])
        for name in vocab:
            assert got["local"][name] == ((V // 2, 32), "S(0)"), (rank, name, got["local"][name])
        for mine, plain in got["norms"]:
            assert mine == pytest.approx(plain, rel=2e-5)


@pytest.mark.multiprocess
def test_a_plan_splitting_only_the_embedding_splits_the_vocabulary_and_nothing_else(runs: Cases) -> None:
    # transformers' plan for DiffLlama, GPT-OSS, LFM2...: {"embed_tokens": "embedding_rowwise"}, run as
    # TensorParallel(vocab=True) without being asked; _case asserted the loss, gradients and steps.
    for rank, got in enumerate(runs("embedding plan")):
        first = got["stages"][0] == 0
        assert set(got["sharded"]) == ({"model.embed_tokens.weight"} if first else {"lm_head.weight"}), (rank, got)


def test_the_vocabulary_split_defaults_to_what_the_models_plan_says() -> None:
    from types import SimpleNamespace

    from runtime.parallel.tensor_stages import plan_problem, size_problems, vocab_only_plan

    only = SimpleNamespace(model_type="lfm2", base_model_tp_plan={"embed_tokens": "embedding_rowwise"}, vocab_size=97)
    mixed = SimpleNamespace(base_model_tp_plan={"wte": "embedding_rowwise", "h.*.mlp.fc_in": "colwise"})
    inner = SimpleNamespace(base_model_tp_plan={"layers.*.mlp.up_embed": "embedding_rowwise"})  # Doge's
    assert vocab_only_plan(only) and not vocab_only_plan(mixed) and not vocab_only_plan(inner)
    assert TensorParallel(size=2).splits_vocab(only)
    assert not TensorParallel(size=2, vocab=False).splits_vocab(only)
    assert not TensorParallel(size=2, plan={"embed_tokens": "colwise"}).splits_vocab(only)  # a user's plan: asked
    assert not TensorParallel(size=2).splits_vocab(mixed) and TensorParallel(size=2, vocab=True).splits_vocab(mixed)
    assert plan_problem(only) is None and "splits only weights" in str(plan_problem(inner))
    assert size_problems(only, 2) == ["vocab_size = 97 does not divide by 2 (the plan splits the embedding's rows)"]


@pytest.mark.multiprocess
@pytest.mark.long
def test_a_loss_the_model_computes_from_labels_runs_split_too(runs: Cases) -> None:
    # _labels_case asserted the loss and every gradient; and nothing gathered the logits.
    assert all(r["gathers"] == [] for r in runs("labels")), runs("labels")


@pytest.mark.multiprocess
def test_a_step_gathers_no_logits_and_predict_gives_them_whole(runs: Cases) -> None:
    for rank, r in enumerate(runs("llama")):
        got = r["probe"]
        assert got["gathers"] == [], got["gathers"]  # no all-gather anywhere in the step
        last = rank >= 2
        # A micro-batch of 2 sequences of 8 tokens, this rank's 48 classes: the step's 4 forwards.
        assert got["logits"] == ([(2, 8, V // 2)] * 4 if last else []), got["logits"]
        if last:
            assert got["predicted"]["type"] == "Tensor" and got["predicted"]["shape"] == (8, 8, V)
            assert got["predicted"]["diff"] < 1e-4, got["predicted"]  # after 3 steps, parameters within TOL
        else:
            assert got["predicted"] is None
        for text in got["refused"].values():
            assert "loss_parallel" in text and "vocab=True" in text, text
        assert "gathered the logits whole" in got["refused"]["gathered"]


# -- in one process: the rewrite's refusals ----------------------------------------------------


class _Mesh:
    """A 1-D mesh of 2 ranks as parallelize_vocab reads it, without a process group: its refusals
    come before any collective or DTensor is made."""

    def size(self) -> int:
        return 2

    def get_local_rank(self) -> int:
        return 0

    def get_group(self) -> None:
        return None


def _graph(vocab: int, read: str) -> fx.GraphModule:
    """A stage reading a ``(vocab, 4)`` weight ``w`` by ``read``: 'embedding', 'linear' or 'mul'."""
    root = nn.Module()
    root.w = nn.Parameter(torch.randn(vocab, 4))
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.get_attr("w")
    aten = torch.ops.aten
    op = {"embedding": aten.embedding.default, "linear": aten.linear.default, "mul": aten.mul.Tensor}[read]
    g.output(g.call_function(op, (w, x) if read == "embedding" else (x, w)))
    return fx.GraphModule(root, g)


def test_a_vocabulary_not_divisible_by_tp_is_refused_with_both_sizes() -> None:
    assert vocab_rows(96, tp=4, rank=3) == (72, 96)
    with pytest.raises(VocabParallelError, match=r"97 rows, not divisible by tp=2.*pad_to_multiple_of=2"):
        parallelize_vocab(_graph(97, "embedding"), frozenset({"w"}), _Mesh(), last=True)


@pytest.mark.parametrize(("read", "last", "match"), [
    ("linear", False, "stage other than the model's last"),
    ("mul", True, "read by something else than an aten.embedding"),
])
def test_a_head_off_the_last_stage_or_another_reader_is_refused(read: str, last: bool, match: str) -> None:
    gm = _graph(96, read)
    with pytest.raises(VocabParallelError, match=match) as info:
        parallelize_vocab(gm, frozenset({"w"}), _Mesh(), last=last)
    assert "'w'" in str(info.value) and "vocab=True" in str(info.value)


def test_the_vocabulary_is_found_through_the_embedding_methods_aliases_included() -> None:
    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
            self.head.weight = self.wte.weight

        def get_input_embeddings(self) -> nn.Module:
            return self.wte

        def get_output_embeddings(self) -> nn.Module:
            return self.head

    assert vocab_names(TiedLM()) == {"wte.weight", "head.weight"}
    with pytest.raises(VocabParallelError, match="get_input_embeddings"):
        vocab_names(nn.Linear(2, 2))
    with pytest.raises(TrainerOptionError, match="vocab is True"):
        TensorParallel(size=2, vocab="yes")  # type: ignore[arg-type]
