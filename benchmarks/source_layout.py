"""Benchmark of the source tree's shape: rooms, circles, long code, and the walk of one training step.

Run (CPU, a few seconds; writes ``benchmarks/results/source_layout.json``)::

    python benchmarks/source_layout.py
    python benchmarks/source_layout.py --root /path/to/another/checkout --out /tmp/source_layout.json

What it measures, from the source under ``--root`` (the import graph of ``tests/layout_graph.py``:
every import, function-level and ``TYPE_CHECKING`` ones included):

* modules per folder (``__init__`` aside) and lines of the longest modules;
* circles between modules and between rooms (a room is a subfolder, or a module at a package's
  top), and which top-level packages import which;
* functions over 80 lines (with their docstring, and without it) and the longest bodies;
* ``PipelineTrainer.__init__``: its parameters and lines;
* the walk of one ``trainer.step()`` (a 2-stage 1F1B pipeline of a small MLP, in one process, 4
  micro-batches; only with the checkout this script belongs to): every call into a function of
  the three packages is traced with ``sys.setprofile``. *Modules passed*: distinct modules
  entered; *hand-offs*: calls from one module into another; *re-entries*: calls into a module
  already on the call stack below the caller's (control returning by call to a module it left,
  such as a helper calling back into the trainer).
"""

from __future__ import annotations

import argparse
import ast
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from layout_graph import Layout, room_of  # noqa: E402
from lib.common import git_state, write_result  # noqa: E402

LONG_FUNCTION = 80


def functions(layout: Layout) -> list[dict[str, Any]]:
    """Every function and method: its module, name, lines with and without its docstring."""
    rows = []
    for module, path in layout.modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                doc = node.body[0] if node.body else None
                is_doc = isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(
                    doc.value.value, str
                )
                doc_lines = ((doc.end_lineno or doc.lineno) - doc.lineno + 1) if is_doc and doc else 0
                rows.append({"module": module, "function": node.name, "lines": lines, "code_lines": lines - doc_lines})
    return sorted(rows, key=lambda r: (-r["lines"], r["module"], r["function"]))


def trainer_init(layout: Layout) -> dict[str, Any]:
    """Parameters (``self`` aside) and lines of ``PipelineTrainer.__init__``."""
    tree = ast.parse(layout.modules["runtime.trainer"].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "PipelineTrainer":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    a = item.args
                    params = len(a.posonlyargs) + len(a.args) - 1 + len(a.kwonlyargs)
                    params += (a.vararg is not None) + (a.kwarg is not None)
                    body = (item.end_lineno or 0) - item.body[0].lineno + 1
                    return {"parameters": params, "lines": (item.end_lineno or 0) - item.lineno + 1, "body_lines": body}
    raise LookupError("PipelineTrainer.__init__ not found")


def _module_of(path: str) -> str | None:
    """The project module a code object's file is (``runtime.trainer``), or None outside the three packages."""
    if not path.startswith(_PREFIXES):
        return None
    return ".".join(Path(path).relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


_PREFIXES = tuple(str(ROOT / pkg) for pkg in ("partitioner", "runtime", "pipecut"))


def traced_calls(fn: Callable[[], Any]) -> tuple[Any, list[tuple[str | None, str]], list[tuple[str, str]]]:
    """Run ``fn`` under ``sys.setprofile``; return its result, every call into a function of the
    three packages as ``(calling project module or None, called module)`` in call order, and the
    re-entries: calls into a module already on the call stack below the caller's."""
    stack: list[str | None] = []
    calls: list[tuple[str | None, str]] = []
    reentries: list[tuple[str, str]] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            mod = _module_of(frame.f_code.co_filename)
            if mod is not None:
                caller = next((m for m in reversed(stack) if m is not None), None)
                calls.append((caller, mod))
                if caller is not None and mod != caller and mod in stack:
                    reentries.append((caller, mod))
            stack.append(mod)
        elif event == "return" and stack:
            stack.pop()

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        result = fn()
    finally:
        sys.setprofile(previous)
    return result, calls, reentries


def room_walk(modules: Sequence[str]) -> dict[str, Any]:
    """The walk at the scale of rooms (``layout_graph.room_of``): the called modules' rooms in call
    order, consecutive calls in one room collapsed into one visit. *Rooms passed*: distinct rooms;
    *hand-offs*: moves from one room to the next (visits - 1); *returns*: visits to a room control
    had already left for another (visits - rooms passed).

    Example:
        >>> w = room_walk(["runtime.trainer", "runtime.precision", "runtime.precision", "runtime.trainer"])
        >>> w["rooms_passed"], w["handoffs"], w["returns"], w["return_rooms"]
        (2, 2, 1, {'runtime.trainer': 1})
    """
    visits: list[str] = []
    for mod in modules:
        room = room_of(mod)
        if not visits or visits[-1] != room:
            visits.append(room)
    returns: dict[str, int] = {}
    seen: set[str] = set()
    for room in visits:
        if room in seen:
            returns[room] = returns.get(room, 0) + 1
        seen.add(room)
    return {
        "rooms": sorted(seen), "rooms_passed": len(seen), "handoffs": max(len(visits) - 1, 0),
        "returns": len(visits) - len(seen), "return_rooms": dict(sorted(returns.items())), "visits": visits,
    }


def _walk_figures(calls: list[tuple[str | None, str]], reentries: list[tuple[str, str]]) -> dict[str, Any]:
    """Module-scale figures of a traced call list, and its room walk (:func:`room_walk`)."""
    handoffs = [(a, b) for a, b in calls if a is not None and a != b]
    return {
        "modules": sorted({m for _, m in calls}),
        "modules_passed": len({m for _, m in calls}),
        "calls": len(calls),
        "handoffs": len(set(handoffs)),
        "handoff_calls": len(handoffs),
        "reentries": len(reentries),
        "reentry_pairs": sorted({f"{a} -> {b}" for a, b in reentries}),
        "room_walk": room_walk([m for _, m in calls]),
    }


def walk_one_step() -> dict[str, Any]:
    """Trace one in-process training step and count how it moves between the project's modules."""
    import torch
    from torch import nn

    import partitioner
    import runtime

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    plan = partitioner.partition(model, (x[:2],), num_stages=2)
    trainer = runtime.PipelineTrainer(
        plan, nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1), schedule="1f1b", microbatches=4,
        transport="sequential",
    )
    trainer.step(x, y)  # warm-up: first-step setup (shapes, buffers) is not the steady walk
    _, calls, reentries = traced_calls(lambda: trainer.step(x, y))
    return _walk_figures(calls, reentries)


def gpt2_case(seed: int = 0) -> tuple[Any, Any]:
    """A tiny Hugging Face GPT-2 (2 layers, width 32, no dropout) and its example input ids (1, 8)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg), torch.randint(0, 64, (1, 8))


def _lm_loss(out: Any, y: Any) -> Any:
    import torch

    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def walk_construction(model: Any, example: Any, **trainer_options: Any) -> dict[str, Any]:
    """Partition ``model`` into 2 stages (4 micro-batches), then trace ``PipelineTrainer(plan, ...)``
    built with ``trainer_options`` (an SGD optimizer); the walk's figures (:func:`_walk_figures`)."""
    import torch

    import partitioner
    import runtime

    plan = partitioner.partition(model, (example,), num_stages=2, microbatches=4)
    _, calls, reentries = traced_calls(lambda: runtime.PipelineTrainer(
        plan, _lm_loss, lambda ps: torch.optim.SGD(ps, lr=0.1), **trainer_options))
    return _walk_figures(calls, reentries)


def _distributed_worker(rank: int, world: int, engine: str) -> dict[str, Any] | None:
    """One rank of a 2 x 2 job: rank 0's walk through the construction of a replicated or FSDP trainer."""
    from runtime.options import DataParallel

    model, example = gpt2_case()
    walk = walk_construction(model, example, transport="dist",
                             data_parallel=DataParallel(size=world // 2, engine=engine))
    return walk if rank == 0 else None


def walk_constructions(distributed: bool) -> dict[str, Any]:
    """The construction walks: a 2-stage GPT-2 in one process; with ``distributed``, rank 0 of a
    2 dp x 2 pp replicated GPT-2 and of a 2 x 2 FSDP one (4 gloo processes each)."""
    import torch

    from runtime.transport.launch import spawn

    torch.set_num_threads(1)
    model, example = gpt2_case()
    out = {"gpt2_2stage": walk_construction(model, example)}
    if distributed:
        for name, engine in (("gpt2_2x2_replicate", "replicate"), ("gpt2_2x2_fsdp", "fsdp")):
            out[name] = spawn(_distributed_worker, 4, engine, timeout=600)[0]
    return out


def measure(root: Path, walk: bool, distributed: bool = False) -> dict[str, Any]:
    """Everything the module docstring lists, for the tree under ``root``."""
    layout = Layout.read(root)
    folders = {str(f.relative_to(root)): len(ms) for f, ms in sorted(layout.folders().items())}
    lines = {m: len(p.read_text().splitlines()) for m, p in layout.modules.items()}
    funcs = functions(layout)
    result: dict[str, Any] = {
        "modules": len(layout.modules),
        "modules_per_folder": folders,
        "longest_modules": sorted(lines.items(), key=lambda kv: -kv[1])[:6],
        "module_circles": layout.module_circles(),
        "room_circles": layout.room_circles(),
        "package_imports": sorted(f"{a} -> {b}" for a, b in layout.package_edges()),
        "functions_over_80_lines": [f for f in funcs if f["lines"] > LONG_FUNCTION],
        "longest_code_bodies": sorted(funcs, key=lambda f: -f["code_lines"])[:5],
        "trainer_init": trainer_init(layout),
        "trainer_lines": lines.get("runtime.trainer"),
    }
    if walk:
        result["step_walk"] = walk_one_step()
        result["construction_walks"] = walk_constructions(distributed)
    return result


def report(result: dict[str, Any]) -> None:
    """Print the measurements as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    table = Table(title="Modules per folder (__init__ aside)")
    table.add_column("folder")
    table.add_column("modules", justify="right")
    for folder, n in result["modules_per_folder"].items():
        table.add_row(folder, str(n))
    console.print(table)
    table = Table(title=f"Functions over {LONG_FUNCTION} lines")
    for col in ("module", "function", "lines", "without docstring"):
        table.add_column(col, justify="right" if col != "module" and col != "function" else "left")
    for f in result["functions_over_80_lines"]:
        table.add_row(f["module"], f["function"], str(f["lines"]), str(f["code_lines"]))
    console.print(table)
    console.print(f"longest modules: {result['longest_modules']}")
    console.print(f"circles: modules {result['module_circles']}, rooms {result['room_circles']}")
    console.print(f"package imports: {result['package_imports']}")
    console.print(f"PipelineTrainer.__init__: {result['trainer_init']}")
    if "step_walk" in result:
        w = result["step_walk"]
        console.print(
            f"one trainer.step(): {w['modules_passed']} modules, {w['handoffs']} hand-offs "
            f"({w['handoff_calls']} calls across modules, {w['calls']} calls in all), {w['reentries']} re-entries "
            f"{w['reentry_pairs']}"
        )
        table = Table(title="The walk at the scale of rooms (consecutive calls in one room collapsed)")
        for col in ("walk", "rooms passed", "hand-offs", "returns", "returns by room"):
            table.add_column(col, justify="left" if col in ("walk", "returns by room") else "right")
        walks = {"one trainer.step()": w}
        walks.update({f"PipelineTrainer() {k}": v for k, v in result["construction_walks"].items()})
        for name, v in walks.items():
            r = v["room_walk"]
            table.add_row(name, str(r["rooms_passed"]), str(r["handoffs"]), str(r["returns"]), str(r["return_rooms"]))
        console.print(table)


def main(argv: list[str] | None = None) -> int:
    """Measure, print, and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure (default: this one)")
    ap.add_argument("--no-walk", action="store_true", help="skip the traced training step")
    ap.add_argument("--distributed", action="store_true",
                    help="also walk rank 0's construction of a 2 x 2 replicated and FSDP GPT-2 (4 gloo processes each)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "source_layout.json"))
    args = ap.parse_args(argv)
    started = time.time()
    result = measure(args.root.resolve(), walk=not args.no_walk and args.root.resolve() == ROOT,
                     distributed=args.distributed)
    report(result)
    write_result(args.out, {
        "benchmark": "source_layout",
        "command": " ".join(["python benchmarks/source_layout.py", *(argv if argv is not None else sys.argv[1:])]),
        "git": git_state(),
        "seconds": round(time.time() - started, 2),
        "results": result,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
