"""The house rules of the source tree: which way each module imports, and how big rooms and modules get.

The import graph is read from the source (``layout_graph``): every ``import``, function-level and
``if TYPE_CHECKING:`` ones included, so a circle cannot hide inside a function.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from layout_graph import PACKAGES, ROOT, Layout

MAX_MODULES_PER_FOLDER = 12
MAX_MODULE_LINES = 600
MAX_TRAINER_PARAMETERS = 12


@pytest.fixture(scope="module")
def layout() -> Layout:
    return Layout.read()


def test_no_circle_between_modules(layout: Layout) -> None:
    assert layout.module_circles() == []


def test_no_circle_between_rooms(layout: Layout) -> None:
    assert layout.room_circles() == []


def test_packages_import_one_way(layout: Layout) -> None:
    # pipecut re-exports both; runtime runs partitioner's plans; partitioner knows neither.
    assert layout.package_edges() <= {("pipecut", "partitioner"), ("pipecut", "runtime"), ("runtime", "partitioner")}


def test_schedule_layer_imports_nothing_outside_itself(layout: Layout) -> None:
    outside = {
        (module, target)
        for module, target in layout.graph.edges
        if module.startswith("partitioner.schedule") and not target.startswith("partitioner.schedule")
    }
    assert outside == set()


def test_the_graph_sees_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "partitioner" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from partitioner.b import X\n"
    )
    (tmp_path / "partitioner" / "b.py").write_text("def f():\n    from . import a\n")
    layout = Layout.read(tmp_path)
    assert layout.module_circles() == [["partitioner.a", "partitioner.b"]]
    assert layout.room_circles() == [["partitioner.a", "partitioner.b"]]


def test_folders_and_modules_stay_small(layout: Layout) -> None:
    folders = layout.folders().items()
    crowded = {str(f.relative_to(ROOT)): len(ms) for f, ms in folders if len(ms) > MAX_MODULES_PER_FOLDER}
    assert crowded == {}
    long = {m: n for m, p in layout.modules.items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_every_subpackage_says_what_it_holds_in_one_line(layout: Layout) -> None:
    for name, path in layout.modules.items():
        if path.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text()))
            assert doc, f"{name} has no docstring"
            if name.count(".") == 1:  # a subpackage: its purpose in the first line, a sentence
                first = doc.strip().split("\n\n")[0]
                assert "\n" not in first and first.endswith("."), f"{name}: say the purpose in one line"


def test_trainer_takes_a_few_option_objects() -> None:
    from runtime.trainer import PipelineTrainer

    params = [p for p in inspect.signature(PipelineTrainer.__init__).parameters if p != "self"]
    assert len(params) <= MAX_TRAINER_PARAMETERS, params


def test_pipecut_reexports_the_public_api() -> None:
    import partitioner
    import pipecut
    import runtime

    own = {"load_generator", "FolderGenerator"}  # pipecut's own API: a Hugging Face folder's generator
    assert set(pipecut.__all__) == set(partitioner.__all__) | set(runtime.__all__) | own
    for name in set(pipecut.__all__) - own:
        assert getattr(pipecut, name) is getattr(partitioner, name, None) or getattr(runtime, name), name
    for name in ("partition", "Plan", "PipelineTrainer", "Cluster", "PipecutError"):
        assert name in pipecut.__all__


@pytest.mark.parametrize("module", ["pipecut", "partitioner", "runtime", "partitioner.schedule.registry"])
def test_each_package_imports_alone_in_a_fresh_interpreter(module: str) -> None:
    done = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# -- the picture in docs/architecture.md -------------------------------------------------------


def _block(page: str) -> str:
    text = (ROOT / page).read_text()
    return text.split("<!-- layout:begin -->")[1].split("<!-- layout:end -->")[0]


def _rows() -> list[list[str]]:
    rows = []
    for line in _block("docs/architecture.md").splitlines():
        names = re.findall(r"\b(?:pipecut|partitioner|runtime)(?:\.\w+)?\b", line)
        if names:
            rows.append(names)
    return rows


def test_architecture_picture_lists_every_room_once(layout: Layout) -> None:
    drawn = [room for row in _rows() for room in row]
    assert sorted(drawn) == sorted(set(drawn)), "a room is drawn twice"
    assert set(drawn) == set(layout.rooms.nodes)


def test_architecture_picture_points_down(layout: Layout) -> None:
    # Each room imports only rooms on lower rows of the picture: the picture is the import order.
    row_of = {room: i for i, row in enumerate(_rows()) for room in row}
    upward = sorted((a, b) for a, b in layout.rooms.edges if row_of[b] <= row_of[a])
    assert upward == []


def test_the_picture_is_drawn_on_one_page_only() -> None:
    # The README and CONTRIBUTING.md point to docs/architecture.md instead of carrying a copy that
    # the checks above would not read.
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
    drawn = [p.relative_to(ROOT).as_posix() for p in pages if "<!-- layout:begin -->" in p.read_text()]
    assert drawn == ["docs/architecture.md"]


def test_importlib_finds_every_module(layout: Layout) -> None:
    for name in layout.modules:
        if name.endswith("__main__"):
            continue
        importlib.import_module(name)


# -- the planner's entry points take a few option objects (partitioner.options) ---------------------

MAX_PLANNER_PARAMETERS = 8


def test_planner_entry_points_take_a_few_option_objects() -> None:
    # Every parameter counts: self, model, example_inputs and the **legacy catch-all of old keywords.
    from partitioner.api import partition
    from partitioner.options import _SECTIONS, ENTRY_POINTS
    from partitioner.search import LayoutSearch, plan_layout

    entry_points = {
        "partition": partition, "plan_layout": plan_layout, "LayoutSearch": LayoutSearch.__init__,
        "LayoutSearch.run": LayoutSearch.run, "LayoutSearch.space": LayoutSearch.space,
    }
    for name, fn in entry_points.items():
        params = inspect.signature(fn).parameters
        assert len(params) <= MAX_PLANNER_PARAMETERS, (name, list(params))
        # The table of each entry point's keywords (what its messages and old keywords follow) is its signature's.
        named = [p for p, v in params.items()
                 if v.kind is not v.VAR_KEYWORD and p not in ("self", "model", "example_inputs")]
        assert tuple(named) == ENTRY_POINTS[name], name
        # Each option object is passed by its own parameter, typed with its class.
        for section, cls in _SECTIONS.items():
            if section in params:
                assert cls.__name__ in str(params[section].annotation), (name, section)


def test_planner_modules_relay_objects_not_keyword_lists() -> None:
    # The objects are handed down whole: no function of the planner's top level takes a long list.
    for module in ("partitioner/api.py", "partitioner/search.py", "partitioner/options.py"):
        tree = ast.parse((ROOT / module).read_text())
        long = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                count = len([*a.posonlyargs, *a.args, *a.kwonlyargs]) + (a.vararg is not None) + (a.kwarg is not None)
                if count > MAX_PLANNER_PARAMETERS:
                    long[node.name] = count
        assert long == {}, module

# Returns PipelineTrainer(plan, ...) may make to a room it had left, while it builds a 2-stage
# pipeline in one process (benchmarks/source_layout.py's room walk: calls into the three packages,
# consecutive calls in one room collapsed). Each is a data dependency of the recipe
# resolve -> build -> wrap -> connect -> ready; a helper calling back into a room already left fails the test.
CONSTRUCTION_RETURNS = {
    # resolve_run, then assemble: the recipe's first two steps, both the assembly's.
    "runtime.assembly": 1,
    # The layout's replicas are applied once the transport is known (a replicated layout in one
    # process is refused), after the schedule is placed.
    "runtime.options": 1,
    # The placement's devices (runtime.transport) come after the schedule and the mesh.
    "runtime.transport": 1,
    # The mesh (resolve); the tied copies before the stages move to their devices and the
    # gradient exchange after (partitioner.tracing retargets the moved graphs in between).
    "runtime.parallel": 2,
    # Micro-batches and recomputation (resolve), then the stage runtimes (build).
    "runtime.execute": 1,
    # The policy (resolve), then the caller's autocast over the built stages' devices (ready).
    "runtime.precision": 1,
    # The plan's fields (resolve), then its split (build), which reads the graph through
    # partitioner.tracing: preserved() around it, the nodes and outputs, the wire forms, the stage
    # tensors before and after the tied names are installed.
    "partitioner.plan": 6,
    "partitioner.tracing": 6,
}


def test_trainer_construction_returns_to_no_room_beyond_the_listed_ones() -> None:
    import runpy

    import torch
    from torch import nn

    from partitioner import partition
    from runtime.trainer import PipelineTrainer

    bench = runpy.run_path(str(ROOT / "benchmarks" / "source_layout.py"), run_name="_layout_walk")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    plan = partition(model, (torch.randn(2, 8),), num_stages=2)
    _, calls, _ = bench["traced_calls"](lambda: PipelineTrainer(
        plan, nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1), transport="sequential"))
    walk = bench["room_walk"]([module for _, module in calls])
    visits = walk["visits"]
    # The recipe: the options, then resolve_run (the plan read once, first), ...
    assert visits[:4] == ["runtime.trainer", "runtime.options", "runtime.assembly", "partitioner.plan"], visits
    # ... then assemble (split, materialise, tie, replicate): the trainer never called back.
    assert visits.count("runtime.trainer") == 1 and visits.count("runtime.assembly") == 2, visits
    assert "runtime.options" not in visits[visits.index("runtime.assembly", 3):], visits
    over = {room: n for room, n in walk["return_rooms"].items() if n > CONSTRUCTION_RETURNS.get(room, 0)}
    assert not over, f"returns to rooms already left beyond CONSTRUCTION_RETURNS: {over}; the walk: {visits}"
