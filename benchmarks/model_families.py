"""Benchmark: every model family of the test matrix, planned and trained, with its plan's quality.

Run (CPU, one thread, about a minute and a half; needs the ``dev`` extra for transformers)::

    python benchmarks/model_families.py
    python benchmarks/model_families.py --families llama,t5 --stages 2,4 --out benchmarks/results/model_families.json

For each family of ``tests/families.py`` (tiny Hugging Face configs, dropout zeroed) and each
stage count ``p``: ``partition()`` on one micro-batch, then one step of each schedule in one
process against the unpartitioned model on the same batch. Reported per (family, p):

* ``bottleneck / lower bound``: the plan's largest stage time over the bound no partition beats
  (1.0 is optimal; tiny 2-layer models cut into 4 stages sit far above it, since a unit cannot
  be split);
* the predicted bubble of the plan's schedule (1F1B), from the event simulator;
* the seconds ``partition()`` took (trace, cost, cut, simulate);
* per schedule, the loss's and the gradients' largest deviation from the unpartitioned model,
  relative to the largest reference gradient, and whether they pass the test suite's tolerance.

Exit status 1 when any family fails (a plan raises, grad mode is left off, or a schedule's
gradients differ), so the script doubles as a check.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
# The packages first: tests/ holds partitioner/ and runtime/ folders too, which would shadow them.
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
sys.path.append(str(ROOT / "tests"))

from families import FAMILIES, ROWS, SEED, TOL, loss_fn, make_plan, reference  # noqa: E402
from lib.common import git_state  # noqa: E402
from runtime import Execution, PipelineTrainer  # noqa: E402

SCHEDULES = ("1f1b", "zbh1")


def measure(name: str, stages: list[int]) -> list[dict[str, Any]]:
    """One row per stage count for family ``name``: plan quality and each schedule's parity."""
    fam = FAMILIES[name]
    model = fam.build()
    x, y = fam.batch(ROWS, torch.Generator().manual_seed(SEED))
    want_loss, want = reference(copy.deepcopy(model), loss_fn, x, y)
    scale = max(g.abs().max().item() for g in want.values())
    rows = []
    for p in stages:
        row: dict[str, Any] = {"family": name, "stages": p, "params": sum(t.numel() for t in model.parameters())}
        t0 = time.perf_counter()
        try:
            plan = make_plan(model, x, p)
        except Exception as err:  # reported as the family's result
            row.update(ok=False, error=f"{type(err).__name__}: {err}")
            rows.append(row)
            continue
        row.update(
            partition_s=time.perf_counter() - t0,
            grad_mode_kept=torch.is_grad_enabled(),
            trace_method=plan.trace_method,
            bottleneck_s=plan.bottleneck,
            lower_bound_s=plan.lower_bound,
            ratio=plan.bottleneck / plan.lower_bound,
            bubble=plan.prediction(plan.schedule).bubble,
        )
        ok = row["grad_mode_kept"]
        for schedule in SCHEDULES:
            trainer = PipelineTrainer(plan, loss_fn, execution=Execution(schedule=schedule, transport="local"))
            trainer.zero_grad()
            loss = trainer.forward_backward(x, y)
            worst = 0.0
            passed = torch.allclose(loss, want_loss, **TOL)
            for pname, prm in trainer.named_parameters():
                if not prm.requires_grad:
                    passed = passed and prm.grad is None
                    continue
                if prm.grad is None:
                    worst, passed = float("inf"), False
                    continue
                worst = max(worst, (prm.grad - want[pname]).abs().max().item() / scale)
                passed = passed and torch.allclose(prm.grad, want[pname], **TOL)
            row[schedule] = {"loss_diff": abs(loss.item() - want_loss.item()), "grad_rel_diff": worst, "ok": passed}
            ok = ok and passed
        row["ok"] = ok
        rows.append(row)
    return rows


def _print(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Model families: plan quality and pipeline parity (one process)")
    for col in ("family", "p", "params", "trace", "bottleneck / bound", "bubble", "partition s",
                *(f"{s} grad diff" for s in SCHEDULES), "ok"):
        table.add_column(col, justify="left" if col in ("family", "trace") else "right")
    for r in rows:
        if "error" in r:
            table.add_row(r["family"], str(r["stages"]), f"{r['params']:,}", "", r["error"][:60], "", "", "", "", "no")
            continue
        table.add_row(
            r["family"], str(r["stages"]), f"{r['params']:,}", r["trace_method"], f"{r['ratio']:.3f}",
            f"{r['bubble']:.1%}", f"{r['partition_s']:.2f}", *(f"{r[s]['grad_rel_diff']:.1e}" for s in SCHEDULES),
            "yes" if r["ok"] else "NO",
        )
    Console(width=140).print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated names from tests/families.py")
    ap.add_argument("--stages", default="2,4", help="comma-separated stage counts")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    names = [n for n in args.families.split(",") if n]
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    stages = [int(s) for s in args.stages.split(",") if s]
    rows = [row for name in names for row in measure(name, stages)]
    _print(rows)
    if args.out:
        meta = {"benchmark": "model_families",
                "command": "python benchmarks/model_families.py " + " ".join(argv or sys.argv[1:]),
                "torch": torch.__version__, "python": platform.python_version(), "git": git_state()}
        try:
            import transformers

            meta["transformers"] = transformers.__version__
        except ImportError:
            pass
        Path(args.out).write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
