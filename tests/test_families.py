"""The model-family matrix: tiny Hugging Face models of 20 families, cut into 2 and 4 stages.

Each model is passed to ``partition`` as it is, no wrapper, its keyword inputs (``decoder_input_ids``)
as ``example_kwargs``; its blocks stay whole (the default granularity for a Hugging Face model).
For each family and ``p``: partitioning leaves grad mode on, the stages chained equal the model
(rebuilt into its own ``ModelOutput``), and 1F1B and ZB-H1 in one process give the loss and
every gradient of the unpartitioned model (fp32). Three families also run over 2 gloo processes
(one by default). The default profile runs one family of each mechanism (``SAME_MECHANISM``).
A plan is made once per (family, p) and shared by the tests (module-scoped cache).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from families import (
    FAMILIES,
    MB,
    ROWS,
    SEED,
    TOL,
    check_grads,
    dist_worker,
    first_names,
    loss_fn,
    make_plan,
    reference,
)
from partitioner import Plan
from profiles import LONG, long_only
from rank_pool import spawn
from runtime import PipelineTrainer

STAGES = (2, 4)
SCHEDULES = ("1f1b", "zbh1")
# Over 2 gloo processes: a rotary mixture-of-experts decoder, an image classifier, and an
# encoder-decoder with two inputs whose tied embedding sits on both ranks (its plan saved to JSON
# and loaded back on every rank: the ModelOutput is rebuilt from the file's output structure).
# The default profile runs the encoder-decoder alone, the long profile all three.
GLOO_FAMILIES = ["t5", "mixtral", "vit"] if LONG else ["t5"]
VIA_FILE = "t5"
# Known failures, each naming its cause (a strict xfail: fixing one turns the test red until removed).
XFAIL: dict[tuple[str, int, str], str] = {}
# The families cut into 4 stages by default: a rotary decoder (a middle stage with neither end) and
# an image classifier. The encoder-decoder (its tied embedding on both ends, as on 2 stages) and the
# state-space model (the slowest to trace) on 4 are the long profile's, with every other family.
# Tracing is most of a case's time; the long profile cuts every family into 4.
FOUR_STAGES = ("llama", "vit")
# Families whose mechanisms another family already runs by default, each with the one that does:
# the long profile runs them (every test), the default profile one family of each mechanism.
SAME_MECHANISM = {
    "mistral": "gemma2 (a sliding window)", "qwen2": "llama (a rotary GQA decoder)",
    "gemma": "gemma2 (the embedding scale)", "roberta": "bert (an encoder, masked LM)",
    "qwen2_moe": "mixtral (routed experts)", "bart": "t5 and whisper (encoder-decoders)",
}


@dataclass
class _Family:
    model: nn.Module
    x: dict[str, torch.Tensor]
    y: torch.Tensor
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    plans: dict[int, Plan | BaseException] = field(default_factory=dict)
    grad_mode_after: dict[int, bool] = field(default_factory=dict)


class _Lab:
    """Each family's model, reference gradients and plans, made on first use."""

    def __init__(self) -> None:
        self.families: dict[str, _Family] = {}

    def family(self, name: str) -> _Family:
        if name not in self.families:
            fam = FAMILIES[name]
            model = fam.build()
            x, y = fam.batch(ROWS, torch.Generator().manual_seed(SEED))
            loss, grads = reference(copy.deepcopy(model), loss_fn, x, y)
            self.families[name] = _Family(model, x, y, loss, grads)
        return self.families[name]

    def plan(self, name: str, p: int) -> tuple[_Family, Plan]:
        f = self.family(name)
        if p not in f.plans:
            try:
                f.plans[p] = make_plan(f.model, f.x, p)
            except Exception as e:  # every test of this (family, p) reports it, without re-planning
                f.plans[p] = e
            f.grad_mode_after[p] = torch.is_grad_enabled()
        plan = f.plans[p]
        if isinstance(plan, BaseException):
            raise plan
        return f, plan


@pytest.fixture(scope="module")
def lab() -> _Lab:
    return _Lab()


def _params(marks: dict[tuple[Any, ...], str], *axes: tuple[Any, ...]) -> list[Any]:
    """Every combination of ``axes`` (family, stages, ...), marked by :func:`_marks`."""
    combos: list[tuple[Any, ...]] = [()]
    for axis in axes:
        combos = [(*c, a) for c in combos for a in axis]
    return [pytest.param(*c, marks=_marks(marks, c)) for c in combos]


def _marks(xfail: dict[tuple[Any, ...], str], combo: tuple[Any, ...]) -> list[pytest.MarkDecorator]:
    """A strict xfail where ``xfail`` names a cause; ``long`` for a (family, 4 stages, ...) case of
    a family outside ``FOUR_STAGES``, and for every case of a family in ``SAME_MECHANISM``."""
    marks = [pytest.mark.xfail(strict=True, reason=xfail[combo])] if combo in xfail else []
    name, p = combo[0], combo[1]
    long = name in SAME_MECHANISM or (p == 4 and name not in FOUR_STAGES)
    return marks + ([pytest.mark.long] if long else [])


@pytest.mark.parametrize("name", long_only(FAMILIES, SAME_MECHANISM))
def test_the_config_leaves_training_deterministic(lab: _Lab, name: str) -> None:
    f = lab.family(name)
    assert f.model.training
    assert all(mod.p == 0 for mod in f.model.modules() if isinstance(mod, nn.Dropout))
    with torch.no_grad():
        assert torch.equal(f.model(**f.x).logits, f.model(**f.x).logits)


@pytest.mark.parametrize(("name", "p"), _params(XFAIL, FAMILIES, STAGES))
def test_stages_chained_equal_the_model(lab: _Lab, name: str, p: int) -> None:
    f, plan = lab.plan(name, p)
    assert f.grad_mode_after[p], "partition() left grad mode off"
    assert len(plan.stages) == p
    assert plan.bottleneck >= plan.lower_bound
    assert plan.granularity == "module"  # a Hugging Face model's blocks are never cut
    staged = plan.build_stages()
    x, _ = FAMILIES[name].batch(MB, torch.Generator().manual_seed(p))
    with torch.no_grad():
        got = plan.traced.unflatten_outputs(staged(*(x[n] for n in plan.input_names)))
        want = f.model(**x)
    assert type(got) is type(want)  # the model's own ModelOutput
    torch.testing.assert_close(got.logits, want.logits, **TOL)


@pytest.mark.parametrize(("name", "p", "schedule"), _params(XFAIL, FAMILIES, STAGES, SCHEDULES))
def test_pipeline_gradients_equal_the_model(lab: _Lab, name: str, p: int, schedule: str) -> None:
    f, plan = lab.plan(name, p)
    trainer = PipelineTrainer(plan, loss_fn, schedule=schedule, transport="local")
    trainer.zero_grad()  # the plans of one family share the model's parameters
    loss = trainer.forward_backward(f.x, f.y)
    torch.testing.assert_close(loss, f.loss, **TOL)
    checked = check_grads(trainer, f.grads)
    # Every trainable tensor of the model was checked, under one of its names (a tied weight's
    # copy on another rank thread is another object with the same name).
    first = first_names(f.model)
    assert {first[n] for n in checked} == set(first.values())


@pytest.mark.parametrize("name", long_only(FAMILIES, SAME_MECHANISM))
def test_recomputed_stages_equal_the_model(lab: _Lab, name: str) -> None:
    # Every stage recomputes (its forward keeps only its inputs; B replays it first): rotary
    # tables, masks, routers and state-space scans must replay to the same numbers.
    f, plan = lab.plan(name, 2)
    trainer = PipelineTrainer(plan, loss_fn, schedule="zbh1", transport="local", recompute=True)
    trainer.zero_grad()
    loss = trainer.forward_backward(f.x, f.y)
    torch.testing.assert_close(loss, f.loss, **TOL)
    check_grads(trainer, f.grads)


# Under bf16 autocast, with values kept in their autocast dtypes between stages.
# The default profile runs a decoder and an image classifier, the long one all six.
BF16_FAMILIES = ["llama", "vit",
                 *(pytest.param(n, marks=pytest.mark.long) for n in ("mixtral", "gemma2", "t5", "bert"))]


@pytest.mark.parametrize("name", BF16_FAMILIES)
def test_bf16_pipeline_equals_the_model_under_autocast(lab: _Lab, name: str) -> None:
    """Two stages under bf16 autocast against the unpartitioned model under it, over the same
    micro-batches: tight against the traced model (one stage: the graph the stages are cut
    from), and within bf16's rounding against the eager one. torch.export's graph runs forward
    bitwise as eager does under autocast, but its backward rounds differently (measured up to
    8e-3 of the largest gradient on Llama's attention), the size of autocast's own error."""
    from runtime.precision import MixedPrecision

    policy = MixedPrecision("bf16", cast_activations=False)
    f, plan = lab.plan(name, 2)
    got = _bf16_grads(PipelineTrainer(plan, loss_fn, schedule="1f1b", transport="local", precision=policy), f)
    _, whole = lab.plan(name, 1)
    traced = _bf16_grads(PipelineTrainer(whole, loss_fn, transport="local", precision=policy), f)
    torch.testing.assert_close(got[0], traced[0], rtol=1e-5, atol=1e-6)
    assert _worst(got[1], traced[1]) < 1e-4
    first = first_names(f.model)
    assert {first[n] for n in got[1]} == set(first.values())  # every trainable tensor checked

    ref = copy.deepcopy(f.model)
    ref.zero_grad()
    want_loss = torch.zeros(())
    m = 4
    for i in range(m):  # the eager model: the same micro-batches, each under autocast
        xs = {k: t.chunk(m)[i] for k, t in f.x.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            part = loss_fn(ref(**xs), f.y.chunk(m)[i]) / m
        part.backward()
        want_loss += part.detach().float()
    torch.testing.assert_close(got[0], want_loss, rtol=1e-5, atol=1e-6)
    eager = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False) if p.grad is not None}
    assert _worst(got[1], eager) < 2e-2


def _bf16_grads(trainer: PipelineTrainer, f: _Family) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    trainer.zero_grad()  # the plans of one family share the model's parameters
    loss = trainer.forward_backward(f.x, f.y)
    named = [kv for st in trainer.stages.values() for kv in st.module.named_parameters(remove_duplicate=False)]
    return loss, {n: p.grad.clone() for n, p in named if p.grad is not None}  # a tied weight by each name


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest ``max|g - g_ref| / max|g_ref|`` over parameters (each checked to be present)."""
    assert set(got) <= set(want), sorted(set(got) - set(want))[:4]
    return max(float((g - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12)) for n, g in got.items())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gloo_processes_match_the_model() -> None:
    results = spawn(dist_worker, 2, GLOO_FAMILIES, VIA_FILE, timeout=300)
    for name in GLOO_FAMILIES:
        first = results[0][name]["first"]
        covered = {first[n] for res in results for n in res[name]["checked"]}
        assert covered == set(first.values()), name  # together the ranks checked every tensor
        assert len({round(res[name]["loss"], 6) for res in results}) == 1  # the loss is broadcast
