"""The family sweep's checks: per family, train, generate and tensor-parallel results against the plain model.

Each check returns a :class:`Result`: ``exact`` (the pipelined run computes what the plain model
computes, within the suite's tolerance), ``refused`` (pipecut raised one of its typed errors,
:class:`~partitioner.errors.PipecutError`, before computing anything different), ``n/a`` (the
axis does not apply: a model without a key/value cache for generation), ``differs`` (a silently
different answer: the one result pipecut must never give) or ``error`` (an untyped exception from
pipecut or the model: a bug, reported with its type and message).

Importable by the tests, the gloo ranks of the tp check and ``benchmarks/families.py``.
"""

from __future__ import annotations

import copy
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from families import ROWS, TOL, loss_fn, make_plan, reference
from partitioner.errors import PipecutError
from tiny_configs import VOCAB, Entry, build_model

__all__ = ["Result", "check_train", "check_generate", "check_tp", "tp_worker", "PROMPTS", "NEW"]

# Ragged prompts longer than the tiny sliding windows (4), of ids above the special ones.
PROMPTS = [[5, 17, 33, 8, 91, 40, 12], [60, 3, 77], [9, 9, 21, 54, 30]]
NEW = 6
SEQ = 8
# A tp gradient outside TOL of the fp32 model's is exact when it is at most this many times as far
# from the float64 model's gradient as the fp32 model's own is (summation order, not arithmetic).
FP32_ROUNDING = 4.0


@dataclass(frozen=True)
class Result:
    """One axis of one family: ``status`` (exact, refused, n/a, differs, error) and what it saw."""

    status: str
    detail: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "detail": self.detail, "seconds": round(self.seconds, 2)}


def _failure(err: BaseException) -> Result:
    text = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:300]
    if isinstance(err, PipecutError):
        return Result("refused", text)
    where = traceback.extract_tb(err.__traceback__)[-1]
    return Result("error", f"{text} (at {where.filename.rsplit('/', 2)[-1]}:{where.lineno})")


def check_train(entry: Entry, p: int = 2) -> Result:
    """A ``p``-stage 1F1B step's loss and every gradient against the plain model on one batch."""
    from runtime import Execution, PipelineTrainer

    try:
        model = build_model(entry)
        gen = torch.Generator().manual_seed(1234)
        x = torch.randint(3, VOCAB, (ROWS, SEQ), generator=gen)
        y = torch.randint(3, VOCAB, (ROWS, SEQ), generator=gen)
        want_loss, want = reference(copy.deepcopy(model), loss_fn, {"input_ids": x}, y)
    except Exception as err:  # the plain model cannot train the tiny config: not an axis pipecut can offer
        return Result("n/a", f"the plain model fails: {type(err).__name__}: {str(err)[:200]}")
    try:
        plan = make_plan(model, {"input_ids": x}, p)
        trainer = PipelineTrainer(plan, loss_fn, execution=Execution(schedule="1f1b", transport="local"))
        trainer.zero_grad()
        loss = trainer.forward_backward({"input_ids": x}, y)
    except Exception as err:  # the failure is the result
        return _failure(err)
    if not torch.allclose(loss, want_loss, **TOL):
        return Result("differs", f"loss {loss.item():.6g} against {want_loss.item():.6g}")
    for name, prm in trainer.named_parameters():
        if not prm.requires_grad:
            continue
        if prm.grad is None or name not in want:  # unused at this length: the plain model's is None too
            if (prm.grad is None) != (name not in want):
                return Result("differs", f"{name}: a gradient on one side only (pipeline "
                                         f"{prm.grad is not None}, plain model {name in want})")
            continue
        if not torch.allclose(prm.grad, want[name], **TOL):
            worst = (prm.grad - want[name]).abs().max().item()
            return Result("differs", f"gradient of {name} differs by up to {worst:.3g}")
    return Result("exact", f"loss {loss.item():.4f}, {len(want)} gradients")


def check_generate(entry: Entry, stages: tuple[int, ...] = (2, 4)) -> Result:
    """Greedy tokens and every step's logits against ``model.generate`` on ragged prompts, on each
    stage count of ``stages``."""
    from partitioner import partition
    from runtime.generate import Generator, left_pad

    try:
        model = build_model(entry).eval()
        ids, mask = left_pad(PROMPTS, pad_token_id=0)
        want = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, eos_token_id=[],
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    except Exception as err:  # the plain model cannot generate: not an axis pipecut can offer
        return Result("n/a", f"model.generate fails: {type(err).__name__}: {str(err)[:200]}")
    notes = []
    for p in stages:
        try:
            plan = partition(model, (torch.zeros(1, SEQ, dtype=torch.long),), p)
            got = Generator(plan).generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0,
                                           output_logits=True)
        except Exception as err:  # the failure is the result
            return _failure(err)
        if not torch.equal(got.sequences, want.sequences):
            return Result("differs", f"{p} stages: tokens {got.sequences[:, -NEW:].tolist()} against "
                                     f"{want.sequences[:, -NEW:].tolist()}")
        assert got.logits is not None
        a, b = torch.stack(got.logits, 1), torch.stack(want.logits, 1)
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
            return Result("differs", f"{p} stages: same tokens, logits differ by up to "
                                     f"{(a - b).abs().max().item():.3g} (ratio {(a.std() / b.std()).item():.3g})")
        notes.append(f"{p} stages")
    return Result("exact", ", ".join(notes))


def tp_worker(rank: int, world: int, model_type: str) -> dict[str, Any]:
    """On each of 4 gloo ranks: 2 pp x 2 tp of ``model_type``'s tiny model, one 1F1B step against
    the plain model (loss, and every gradient with its shards gathered); the result as a dict
    (a failure is caught and returned, so that every rank reports the same outcome)."""
    from torch.distributed.tensor import DTensor

    from partitioner import partition
    from partitioner.tracing.hf import blocks
    from runtime.options import TensorParallel
    from runtime.trainer import PipelineTrainer
    from tiny_configs import sweep_entries

    (entry,) = sweep_entries([model_type])
    try:
        model = build_model(entry)
        ref = copy.deepcopy(model)
        ref64 = copy.deepcopy(model)  # made float64 only if a gradient is not within TOL (fp32 rounding or not)
        gen = torch.Generator().manual_seed(5)
        x = torch.randint(3, VOCAB, (8, SEQ), generator=gen)
        y = torch.randint(3, VOCAB, (8, SEQ), generator=gen)
        layers = list(blocks(model))
        # Stages begin at blocks: a cut between a column layer and its row layer cannot be split.
        plan = partition(model, (x[:2],), 2, microbatches=4, schedule="1f1b", split_points=[layers[len(layers) // 2]])
        trainer = PipelineTrainer(plan, loss_fn, schedule="1f1b", transport="dist", timeout=120,
                                  tensor_parallel=TensorParallel(size=2))
        loss = trainer.forward_backward(*trainer.local_batch(x, y))
        want_loss = loss_fn(ref(x), y)
        want_loss.backward()
    except Exception as err:  # the failure is the result, the same on every rank
        return _failure(err).as_dict()
    if not torch.allclose(loss, want_loss.detach(), **TOL):
        return Result("differs", f"loss {loss.item():.6g} against {want_loss.item():.6g}").as_dict()
    grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    sharded = 0
    exact64: dict[str, torch.Tensor] | None = None
    for name, prm in trainer.named_parameters():
        if prm.grad is None:
            if grads.get(name) is not None:
                return Result("differs", f"no gradient for {name}").as_dict()
            continue
        g = prm.grad.full_tensor() if isinstance(prm.grad, DTensor) else prm.grad
        if isinstance(prm, DTensor) and any(not pl.is_replicate() for pl in prm.placements):
            sharded += 1
        if torch.allclose(g, grads[name], **TOL):
            continue
        # Not within TOL of the fp32 model: judged against the float64 model, the fp32 model's
        # own rounding is the yardstick (a tied embedding's gradient, summed over both ends and
        # the tp ranks in another order, can stray by a few times that: Gemma 4's by 2x).
        if exact64 is None:
            loss_fn(ref64.double()(x), y).backward()
            exact64 = {n: p.grad for n, p in ref64.named_parameters(remove_duplicate=False)}
        if not within_fp32_rounding(g, grads[name], exact64[name]):
            mine = (g.double() - exact64[name]).abs().max().item()
            plain = (grads[name].double() - exact64[name]).abs().max().item()
            return Result("differs", f"gradient of {name} differs by up to {(g - grads[name]).abs().max().item():.3g} "
                                     f"({mine:.3g} from the float64 model's, where the fp32 model's is {plain:.3g} "
                                     "from it)").as_dict()
    if not sharded:
        return Result("differs", "no weight was sharded over tp: the run was not tensor-parallel").as_dict()
    return Result("exact", f"loss {loss.item():.4f}, {sharded} sharded weights").as_dict()


def within_fp32_rounding(got: torch.Tensor, plain: torch.Tensor, exact: torch.Tensor) -> bool:
    """Whether ``got`` is as close to the float64 model's ``exact`` as fp32 arithmetic allows: at
    most :data:`FP32_ROUNDING` times as far as the fp32 model's own ``plain`` (and never held to
    less than 1e-7 of the largest value).

    Example:
        >>> exact = torch.tensor([1.0, -0.5], dtype=torch.float64)
        >>> plain = torch.tensor([1.0 + 1e-6, -0.5])
        >>> within_fp32_rounding(torch.tensor([1.0 + 3e-6, -0.5]), plain, exact)
        True
        >>> within_fp32_rounding(torch.tensor([1.0 + 1e-5, -0.5]), plain, exact)
        False
    """
    mine = (got.double() - exact).abs().max().item()
    own = (plain.double() - exact).abs().max().item()
    return mine <= FP32_ROUNDING * max(own, 1e-7 * exact.abs().max().item())


def check_tp(entry: Entry, spawner: Any = None) -> Result:
    """2 pp x 2 tp over 4 gloo processes against the plain model (:func:`tp_worker`); ``spawner``
    runs ``fn(rank, world, *args)`` on 4 ranks (default: ``runtime.transport.launch.spawn``; the
    tests pass their shared pool's)."""
    from runtime.transport.launch import LaunchError, spawn

    if entry.config is None:
        return Result("n/a", entry.reason)
    from runtime.parallel.tensor_stages import tp_problems

    problems = tp_problems(entry.config, 2)
    if problems:  # what pipecut train --tp refuses from config.json before anything is built
        return Result("refused", f"TensorParallelError (from the config): {'; '.join(problems)}")
    try:
        results = (spawner or spawn)(tp_worker, 4, entry.model_type, timeout=300)
    except LaunchError as err:
        lines = str(err).strip().splitlines()  # the first line names the rank, the last its exception
        return Result("error", f"LaunchError: {lines[0][:200]} {lines[-1][:300] if len(lines) > 1 else ''}")
    statuses = {r["status"] for r in results}
    worst = next((r for s in ("differs", "error", "refused") for r in results if r["status"] == s), results[0])
    if len(statuses) > 1 and worst["status"] == "refused":
        worst = {**worst, "status": "error", "detail": f"ranks disagree ({sorted(statuses)}): {worst['detail']}"}
    return Result(worst["status"], worst["detail"])
