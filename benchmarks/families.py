"""Benchmark: the family sweep, every causal-LM family transformers ships, trained and generated as the plain model.

Run (CPU, one thread per process; needs the ``dev`` extra for transformers)::

    python benchmarks/families.py                          # every family and axis, 2 processes
    python benchmarks/families.py --families llama,gemma2 --jobs 1
    python benchmarks/families.py --axes tp --merge benchmarks/results/families.json --out ...
    python benchmarks/families.py --out benchmarks/results/families.json --doc docs/families.md

``tests/tiny_configs.py`` makes a tiny config for every entry of transformers'
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` from the config's own names, or says why an entry is not a
decoder-only family or does not build small. ``tests/family_sweep.py`` checks each swept family:

* **train**: a 2-stage 1F1B step's loss and every gradient against the plain model;
* **generate**: greedy tokens and every step's logits against ``model.generate`` on ragged
  prompts, on 2 and 4 stages;
* **tp**: 2 pp x 2 tp over 4 gloo processes, one 1F1B step's loss and every gradient (shards
  gathered) against the plain model, with the family's ``base_model_tp_plan`` (or pipecut's own).

Each result is ``exact``, ``refused`` (a typed pipecut error, before anything different is
computed), ``n/a`` (``model.generate`` itself cannot run the tiny model), ``differs`` (a silently
different answer) or ``error`` (an untyped exception: a bug). The table goes to the terminal and,
with ``--doc``, to a Markdown page; ``--out`` writes the JSON.

Exit status 1 when any family ``differs`` on any axis.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The packages first: tests/ holds partitioner/ and runtime/ folders too, which would shadow them;
# then tests/ (its families module, not this script, is the one the sweep's checks import).
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
sys.path.append(str(ROOT / "benchmarks"))

AXES = ("train", "generate", "tp")
AXIS_TEXT = {
    "train": "- **train**: a 2-stage 1F1B step's loss and every gradient;",
    "generate": ("- **generate**: greedy tokens and every step's logits against `model.generate` on ragged prompts, "
                 "2 and 4 stages;"),
    "tp": ("- **tp**: 2 pp x 2 tp over 4 gloo processes (the family's own `base_model_tp_plan`, or pipecut's "
           "derived one), one 1F1B step's loss and every gradient, shards gathered;"),
}


def _quiet() -> None:
    import logging
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)


def measure(task: tuple[str, tuple[str, ...]]) -> dict[str, Any]:
    """One family's row: its classification, then each axis's result (``task``: the model type
    and the axes to run)."""
    _quiet()
    from family_sweep import check_generate, check_tp, check_train
    from tiny_configs import sweep_entries

    model_type, axes = task
    (entry,) = sweep_entries([model_type])
    row: dict[str, Any] = {"family": model_type, "model": entry.model}
    if entry.config is None:
        row["swept"] = False
        row["reason"] = entry.reason
        return row
    row["swept"] = True
    checks = {"train": check_train, "generate": check_generate, "tp": check_tp}
    for axis in axes:
        t0 = time.perf_counter()
        result = checks[axis](entry)
        row[axis] = {**result.as_dict(), "seconds": round(time.perf_counter() - t0, 1)}
    print(f"{model_type}: " + ", ".join(f"{a} {row[a]['status']}" for a in axes), flush=True)
    return row


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts per axis and status, over the swept families, and the share exact."""
    swept = [r for r in rows if r.get("swept")]
    out: dict[str, Any] = {"entries": len(rows), "swept": len(swept)}
    for axis in [a for a in AXES if any(a in r for r in swept)]:
        ran = [r for r in swept if axis in r]  # an axis run on some families only (--families, --merge)
        counts = Counter(r[axis]["status"] for r in ran)
        out[axis] = dict(sorted(counts.items()))
        out[f"{axis}_families"] = len(ran)
        out[f"{axis}_exact_share"] = round(counts["exact"] / len(ran), 3) if ran else 0.0
    return out


def _result(row: dict[str, Any], axis: str) -> dict[str, Any]:
    return row.get(axis) or {"status": "not run", "detail": "", "seconds": 0.0}


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The page ``docs/families.md``: the counts, one row per swept family, then the entries not swept."""
    s = summary(rows)
    axes = [a for a in AXES if a in s]
    lines = [
        "# Model families: exact or refused",
        "",
        (f"Generated by `{meta['command']}` at commit {str(meta.get('git', {}).get('commit', '?'))[:7]} with "
         f"transformers {meta.get('transformers', '?')} and torch {meta['torch']}; do not edit by hand. "
         "Each entry of transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` gets a tiny config from its own "
         "names (`tests/tiny_configs.py`); each swept family is checked against the plain model "
         "(`tests/family_sweep.py`):"),
        "",
        *(AXIS_TEXT[a] for a in axes),
        "",
        *([(f"The rows were measured into {meta['rows']} by `python benchmarks/families.py --axes AXES --rows "
            "FILE` (every entry for train and generate; the families named for tp) and joined by `--from-rows`."), ""]
          if meta.get("rows") else []),
        ("`exact`: within the test suite's tolerance. `refused`: a typed pipecut error, raised before anything "
         "different is computed (the reason is given). `n/a`: `model.generate` itself cannot run the tiny model. "
         "`differs` would be a silently different answer, and `error` an untyped exception."),
        "",
        f"{s['entries']} entries, {s['swept']} decoder-only families swept.",
        "",
        "| axis | " + " | ".join(sorted({k for a in axes for k in s[a]})) + " | exact share |",
        "|---|" + "---|" * (len({k for a in axes for k in s[a]}) + 1),
    ]
    keys = sorted({k for a in axes for k in s[a]})
    for axis in axes:
        counts = " | ".join(str(s[axis].get(k, 0)) for k in keys)
        lines.append(f"| {axis} ({s[f'{axis}_families']} families) | {counts} | {s[f'{axis}_exact_share']:.0%} |")
    lines += ["", "## Swept families", "", "| family | model | " + " | ".join(axes) + " |",
              "|---|---|" + "---|" * len(axes)]

    def cell(result: dict[str, Any]) -> str:
        if result["status"] in ("exact", "not run"):
            return result["status"]
        detail = result["detail"].replace("|", "\\|").replace("\n", " ")[:160]
        return f"**{result['status']}**: {detail}"

    for r in rows:
        if r.get("swept"):
            lines.append(f"| {r['family']} | {r['model']} | " + " | ".join(cell(_result(r, a)) for a in axes) + " |")
    lines += ["", "## Entries not swept", "", "| entry | model | why |", "|---|---|---|"]
    for r in rows:
        if not r.get("swept"):
            lines.append(f"| {r['family']} | {r['model']} | {r['reason'].replace('|', '/')[:200]} |")
    return "\n".join(lines) + "\n"


def _print(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    axes = [a for a in AXES if any(a in r for r in rows)]
    table = Table(title="Family sweep: each axis against the plain model")
    for col in ("family", *axes, "detail"):
        table.add_column(col)
    for r in rows:
        if not r.get("swept"):
            continue
        bad = next((_result(r, a) for a in axes if _result(r, a)["status"] not in ("exact", "not run")), None)
        table.add_row(r["family"], *(_result(r, a)["status"] for a in axes), "" if bad is None else bad["detail"][:90])
    Console(width=160).print(table)
    print(json.dumps(summary(rows)))


def _kept(row: dict[str, Any], path: str | None) -> dict[str, Any]:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="", help="comma-separated model types (default: every entry)")
    ap.add_argument("--jobs", type=int, default=2, help="processes (a family per task, one thread each)")
    ap.add_argument("--axes", default=",".join(AXES), help=f"comma-separated, of {', '.join(AXES)} (tp spawns 4 "
                    "gloo processes per family)")
    ap.add_argument("--merge", default=None, help="a JSON this script wrote: its rows' other axes are kept")
    ap.add_argument("--rows", default=None, help="append each family's row to this JSON-lines file as it ends")
    ap.add_argument("--from-rows", default=None,
                    help="make the table from --rows files (comma-separated) instead of measuring")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--doc", default=None, help="write the Markdown table here (docs/families.md)")
    args = ap.parse_args(argv)
    _quiet()
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from lib.common import git_state

    names = [n for n in args.families.split(",") if n] or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    unknown = sorted(set(names) - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    if unknown:
        ap.error(f"unknown model types {unknown}; see transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    axes = tuple(a for a in args.axes.split(",") if a)
    if set(axes) - set(AXES):
        ap.error(f"unknown axes {sorted(set(axes) - set(AXES))}; known: {', '.join(AXES)}")
    t0 = time.perf_counter()
    tasks = [(n, axes) for n in names]
    if args.from_rows:  # several files: a family's rows are merged, the later file's axes winning
        got: dict[str, dict[str, Any]] = {}
        for path in args.from_rows.split(","):
            for r in map(json.loads, Path(path).read_text().splitlines()):
                got[r["family"]] = {**got.get(r["family"], {}), **r}
        rows = [got[n] for n in names if n in got]
    elif args.jobs > 1:
        # Not a multiprocessing.Pool: its workers are daemons, which cannot start the tp check's ranks.
        # (No max_tasks_per_child: Python 3.11's executor stops handing out tasks once a worker retires.)
        with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
            futures = [pool.submit(measure, t) for t in tasks]
            rows = [_kept(f.result(), args.rows) for f in as_completed(futures)]
    else:
        rows = [_kept(measure(t), args.rows) for t in tasks]
    rows.sort(key=lambda r: r["family"])
    if args.merge:
        before = {r["family"]: r for r in json.loads(Path(args.merge).read_text())["results"]}
        rows = [{**before.get(r["family"], {}), **r} for r in rows]
    _print(rows)
    meta = {"benchmark": "families", "command": "python benchmarks/families.py " + " ".join(argv or sys.argv[1:]),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "git": git_state(), "seconds": round(time.perf_counter() - t0, 1),
            "summary": summary(rows)}
    if args.from_rows:
        meta["rows"] = ", ".join(f"`{p}`" for p in args.from_rows.split(","))
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    if args.doc:
        Path(args.doc).write_text(markdown(rows, meta))
    return 1 if any(r.get("swept") and r.get(a, {}).get("status") == "differs" for r in rows for a in AXES) else 0


if __name__ == "__main__":
    sys.exit(main())
