"""One error root: every error pipecut raises is a ``PipecutError`` and the builtin a caller expects.

The source is read, not sampled: an AST walk over ``partitioner/`` and ``runtime/`` resolves the
class of every ``raise X(...)`` / ``raise mod.X(...)`` and checks it, so a new bare
``raise ValueError(...)`` fails here. A raise that only guards an internal invariant (a bug in
pipecut, not a misuse) may stay a builtin when its line says ``# internal invariant``.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import pkgutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

import partitioner
import pipecut
import pipecut.errors
import runtime
from layout_graph import module_name, source_files
from partitioner import errors as perr
from partitioner.errors import PipecutError

_ROOT = Path(__file__).resolve().parents[1]
_PACKAGES = (partitioner, runtime, pipecut)
_MARK = "# internal invariant"


def _dotted(node: ast.expr) -> list[str] | None:
    """``['mod', 'X']`` for ``mod.X``; ``None`` for anything but names and attribute access."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else [*head, node.attr]
    return None


def _resolve(module: ModuleType, names: list[str]) -> Any:
    """The object ``names`` denotes in ``module``'s globals (or builtins); ``None`` for a local."""
    scope = vars(module)
    if names[0] in scope:
        obj = scope[names[0]]
    elif hasattr(builtins, names[0]):
        obj = getattr(builtins, names[0])
    else:
        return None  # a local variable (`raise e`) or a parameter
    for attr in names[1:]:
        obj = getattr(obj, attr, None)
    return obj


def bare_raises(files: list[Path], root: Path = _ROOT) -> list[str]:
    """``file:line: Class`` for each raise of a class that is not a ``PipecutError``."""
    found = []
    for path in files:
        text = path.read_text()
        lines = text.splitlines()
        module = importlib.import_module(module_name(path, root))
        for node in ast.walk(ast.parse(text)):  # (not in line order; sorted below)
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            callee = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            names = _dotted(callee)
            if names is None:
                continue  # `raise fail(...)`, `raise errors[0]`: a helper's or a caught error
            cls = _resolve(module, names)
            if not (isinstance(cls, type) and issubclass(cls, BaseException)):
                continue  # a function building the error, or a caught exception re-raised
            if issubclass(cls, PipecutError):
                continue
            end = node.end_lineno or node.lineno
            if any(_MARK in line for line in lines[node.lineno - 1 : end]):
                continue
            found.append(f"{path.relative_to(root).as_posix()}:{node.lineno}: {'.'.join(names)}")
    return sorted(found, key=lambda f: (f.split(":")[0], int(f.split(":")[1])))


def test_every_raise_is_a_pipecut_error() -> None:
    bare = bare_raises(list(source_files().values()))
    assert not bare, f"{len(bare)} raise(s) of classes outside PipecutError:\n" + "\n".join(bare)


def test_the_walk_flags_builtin_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The check above is only as good as its walk: it must see each form of a bare raise.
    (tmp_path / "_raising.py").write_text(
        "import argparse\n"
        "from partitioner.errors import PlanFormatError\n"
        "def f(x):\n"
        "    if x == 1:\n"
        "        raise ValueError('bad')\n"
        "    if x == 2:\n"
        "        raise argparse.ArgumentTypeError('bad')\n"
        "    if x == 3:\n"
        "        raise NotImplementedError\n"
        "    if x == 4:\n"
        "        raise RuntimeError('a bug')  # internal invariant\n"
        "    try:\n"
        "        raise PlanFormatError('typed')\n"
        "    except PlanFormatError as e:\n"
        "        raise e\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    found = bare_raises([tmp_path / "_raising.py"], tmp_path)
    assert found == [
        "_raising.py:5: ValueError", "_raising.py:7: argparse.ArgumentTypeError", "_raising.py:9: NotImplementedError",
    ]


def _error_classes() -> list[tuple[str, str, type[BaseException]]]:
    """(module, name, class) for each public exception class defined in the packages."""
    out = []
    for pkg in _PACKAGES:
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            module = importlib.import_module(info.name)
            file = getattr(module, "__file__", None)
            if file is None:
                continue
            for name, obj in vars(module).items():
                if (
                    isinstance(obj, type) and issubclass(obj, BaseException)
                    and obj.__module__ == module.__name__ and not name.startswith("_")
                ):
                    out.append((module.__name__, name, obj))
    return out


def test_every_error_class_is_a_pipecut_error_in_pipecut_errors() -> None:
    classes = _error_classes()
    assert len(classes) > 40  # the walk found the packages' errors
    outside = [f"{m}.{n}" for m, n, c in classes if not issubclass(c, PipecutError)]
    assert not outside, f"not PipecutError subclasses: {outside}"
    missing = [f"{m}.{n}" for m, n, c in classes if getattr(pipecut.errors, n, None) is not c]
    assert not missing, f"not importable from pipecut.errors: {missing}"


def test_pipecut_errors_exports_errors_only() -> None:
    assert len(pipecut.errors.__all__) == len(set(pipecut.errors.__all__))
    for name in pipecut.errors.__all__:
        cls = getattr(pipecut.errors, name)
        assert isinstance(cls, type) and issubclass(cls, BaseException), name
        assert issubclass(cls, PipecutError), name
        # Every one but the root is also a builtin error a caller may already catch.
        builtin = [b for b in cls.__mro__ if b.__module__ in ("builtins", "argparse")]
        assert name == "PipecutError" or builtin[0] is not Exception, f"{name}: no builtin but Exception"



# -- the real API raises them --------------------------------------------------------------------


def _mlp() -> tuple[nn.Module, tuple[torch.Tensor]]:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), (torch.randn(4, 8),)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_stages": 2, "method": "magic"}, "unknown method 'magic'"),
        ({"num_stages": 0}, "num_stages must be at least 1, got 0"),
        ({}, "give num_stages or a cluster"),
        ({"num_stages": 2, "microbatches": 0}, "microbatches must be a positive int or 'auto'"),
        ({"num_stages": 2, "granularity": "layer"}, "granularity must be 'node' or 'module'"),
    ],
)
def test_partition_rejects_a_bad_option(kwargs: dict[str, Any], match: str) -> None:
    model, inputs = _mlp()
    with pytest.raises(perr.PartitionOptionError, match=match) as info:
        partitioner.partition(model, inputs, **kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, PipecutError)


def test_cluster_checks_itself() -> None:
    with pytest.raises(perr.ClusterError, match="at least 1, got 0") as info:
        partitioner.Cluster.uniform(0)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ValueError, match="cluster has 2 devices, asked for 3"):
        partitioner.Cluster.uniform(2).with_devices(3)


def test_missing_prediction_is_a_key_error() -> None:
    model, inputs = _mlp()
    plan = partitioner.partition(model, inputs, num_stages=2)
    with pytest.raises(KeyError, match="no prediction for schedule 'nope'") as info:
        plan.prediction("nope")
    assert isinstance(info.value, perr.MissingPredictionError)


def test_model_spec_errors() -> None:
    from partitioner.zoo import load_model

    with pytest.raises(perr.ModelSpecError, match="unknown model 'nope'"):
        load_model("nope")
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        load_model("/no/such/file.py:make")
    assert isinstance(info.value, perr.ModelFileNotFoundError)
