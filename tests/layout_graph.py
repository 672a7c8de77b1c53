"""The project's import graph, read from the source with ast: every import, function-level ones too.

Shared by ``tests/test_layout.py`` and ``benchmarks/source_layout.py``.

Legend: a *module* is a dotted name (``partitioner.plan.split``; a package's ``__init__`` is the
package's name); a *room* is a subpackage (``partitioner.plan``) or, for a module at a package's
top, the module itself (``partitioner.api``, ``runtime.trainer``, the ``runtime`` facade).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("partitioner", "runtime", "pipecut")


def module_name(path: Path, root: Path = ROOT) -> str:
    """``partitioner/plan/split.py`` -> ``partitioner.plan.split``; ``__init__.py`` names its package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the three packages, by dotted name."""
    return {module_name(p, root): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}


def _absolute(node: ast.ImportFrom, me: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = me.split(".") if is_package else me.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path, me: str, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports, anywhere in the file (``if TYPE_CHECKING:`` included)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(node, me, path.name == "__init__.py")
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:  # `from pkg import module`
                    out.add(f"{target}.{alias.name}")
                elif target in modules:
                    out.add(target)
    out.discard(me)
    return out


def room_of(module: str) -> str:
    """The subpackage holding ``module`` (``partitioner.plan``), or ``module`` itself at a package's top."""
    return ".".join(module.split(".")[:2])


@dataclass
class Layout:
    """The module graph and the room graph of a source tree."""

    modules: dict[str, Path]
    graph: nx.DiGraph = field(default_factory=nx.DiGraph)
    rooms: nx.DiGraph = field(default_factory=nx.DiGraph)

    @classmethod
    def read(cls, root: Path = ROOT) -> Layout:
        """Build both graphs from the files under ``root``."""
        modules = source_files(root)
        layout = cls(modules)
        names = set(modules)
        for name, path in modules.items():
            layout.graph.add_node(name)
            layout.rooms.add_node(room_of(name))
            for target in imports_of(path, name, names):
                layout.graph.add_edge(name, target)
                a, b = room_of(name), room_of(target)
                if a != b:
                    layout.rooms.add_edge(a, b)
        return layout

    def module_circles(self) -> list[list[str]]:
        """Each group of modules that import each other round a circle (strongly connected, > 1)."""
        return sorted(sorted(c) for c in nx.strongly_connected_components(self.graph) if len(c) > 1)

    def room_circles(self) -> list[list[str]]:
        """Each group of rooms that import each other round a circle."""
        return sorted(sorted(c) for c in nx.strongly_connected_components(self.rooms) if len(c) > 1)

    def package_edges(self) -> set[tuple[str, str]]:
        """``(a, b)`` for each top-level package ``a`` that imports something of package ``b``."""
        return {(u.split(".")[0], v.split(".")[0]) for u, v in self.graph.edges if u.split(".")[0] != v.split(".")[0]}

    def folders(self) -> dict[Path, list[str]]:
        """Each folder and the modules in it, ``__init__`` aside."""
        out: dict[Path, list[str]] = {}
        for path in self.modules.values():
            out.setdefault(path.parent, [])
            if path.name != "__init__.py":
                out[path.parent].append(path.name)
        return out
