"""FSDP2 as the data-parallel engine: 2 replicas of a 2-rank pipeline on 4 gloo processes, each
stage's parameters sharded over its 2 replicas, train exactly as the unpartitioned model on the
global batch (loss, clipped AdamW steps, every parameter after them)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from runtime.options import DataParallel
from runtime.transport.launch import spawn
from tests.runtime.parity import TOL, _fresh, _fresh_y, case, make_trainer, reference_grads


def _fsdp_case(name: str, schedule: str, dp: int, ranks: int, **opts: Any) -> dict[str, Any]:
    """One (model, schedule) on this rank: forward_backward, then 2 clipped AdamW steps, each
    compared with the unpartitioned model; the parameters gathered from their shards at the end."""
    from torch.distributed.tensor import DTensor

    reshard = opts.pop("reshard_after_forward", True)
    stages = 2 * ranks if schedule in ("interleaved", "zbv") else ranks
    c = case(name, stages)
    ref = copy.deepcopy(c["model"])
    # Adam divides by sqrt(v): on a gradient near 0 the round-off of another summation order (the
    # reduce-scatter's) becomes a visible step. eps=1e-6 bounds that amplification to TOL.
    opt = lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, eps=1e-6)  # noqa: E731
    trainer = make_trainer(c, stages, schedule, transport="dist", optimizer=opt,
                           data_parallel=DataParallel(size=dp, engine="fsdp", reshard_after_forward=reshard), **opts)
    gen = torch.Generator().manual_seed(7)  # the same global batch on every rank
    rows = dp * c["x"].shape[0]
    fresh = lambda: (_fresh({"x": c["x"].new_empty(rows, *c["x"].shape[1:])}, gen),  # noqa: E731
                     _fresh_y({"y": c["y"].new_empty(rows, *c["y"].shape[1:])}, gen))
    x, y = fresh()
    loss = trainer.forward_backward(*trainer.local_batch(x, y))
    want_loss, want = reference_grads(c, ref, x, y)
    torch.testing.assert_close(loss, want_loss, **TOL)
    checked = []
    for n, prm in trainer.named_parameters():
        assert isinstance(prm, DTensor), n
        assert prm.grad is not None, f"{n} got no gradient"
        torch.testing.assert_close(prm.grad.full_tensor(), want[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
        checked.append(n)
    ref_opt = opt(list(ref.parameters()))
    norms, losses = [], []
    for _ in range(2):
        x, y = fresh()
        losses.append(float(trainer.step(*trainer.local_batch(x, y), max_norm=0.5)))
        ref_opt.zero_grad()
        ref_loss = c["loss"](ref(x), y)
        ref_loss.backward()
        norms.append((float(trainer.last_grad_norm), float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))))
        ref_opt.step()
        assert losses[-1] == pytest.approx(float(ref_loss.detach()), rel=1e-5)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for n, prm in trainer.named_parameters():
        torch.testing.assert_close(prm.detach().full_tensor(), ref_params[n].detach(), **TOL,
                                   msg=lambda m, n=n: f"{n}: {m}")
    local = sum(p.to_local().numel() for p in trainer.parameters())
    whole = sum(p.numel() for p in trainer.parameters())
    return {"checked": checked, "norms": norms, "local": local, "whole": whole,
            "dp_rank": trainer.mesh.dp_rank, "pp_rank": trainer.mesh.pp_rank}


# Every FSDP run of this file, in one spawn of 4 processes (2 replicas x 2 ranks):
# label: (model, schedule, options).
_RUNS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2/1f1b": ("gpt2", "1f1b", {}),
    "gpt2/1f1b/gathered": ("gpt2", "1f1b", {"reshard_after_forward": False}),
    "gpt2/zbh1": ("gpt2", "zbh1", {}),
    "gpt2/gpipe": ("gpt2", "gpipe", {}),
    "gpt2/interleaved": ("gpt2", "interleaved", {}),
    "mlp/zbv": ("mlp", "zbv", {}),
    "gpt2/zbh1/unfused": ("gpt2", "zbh1", {"fuse_wgrad": False}),
}


def _worker(rank: int, world: int, runs: dict[str, tuple[str, str, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, (name, schedule, opts) in runs.items():
        try:
            out[label] = _fsdp_case(name, schedule, 2, world // 2, **opts)
        except Exception as e:  # reported by the test, with the label
            import traceback

            out[label] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    return out


@pytest.fixture(scope="module")
def sharded() -> list[dict[str, Any]]:
    """Each rank's results of every run in ``_RUNS``: one spawn for the file."""
    return spawn(_worker, 4, _RUNS, timeout=900)


@pytest.mark.multiprocess
@pytest.mark.parametrize("label", list(_RUNS))
def test_fsdp_over_two_replicas_equals_the_plain_model(sharded: list[dict[str, Any]], label: str) -> None:
    results = [r[label] for r in sharded]
    for r in results:
        assert "error" not in r, r.get("error")
    assert [(r["dp_rank"], r["pp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        for got, want in r["norms"]:
            assert got == pytest.approx(want, rel=1e-5), label
        assert r["local"] <= r["whole"] // 2 + 64  # each replica holds half of its stages (rows rounded up)
