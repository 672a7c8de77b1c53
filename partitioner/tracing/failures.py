"""How a failure reads to the user: an exception's first line, the user's frame, trace's advice."""

from __future__ import annotations

import os
import traceback
from collections.abc import Collection

import torch
from torch import nn

__all__ = ["first_line", "user_frame", "trace_failure_message"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_MAX_REASON = 1200  # torch.export's messages run to pages; the head says what broke


def first_line(e: BaseException | None) -> str:
    """The first line of ``e``'s message, or its type name when the message is empty.

    Example:
        >>> first_line(ValueError("bad shape\\nmore detail")), first_line(KeyError())
        ('bad shape', 'KeyError')
    """
    text = str(e).strip() if e is not None else ""
    return text.splitlines()[0] if text else type(e).__name__


def user_frame(e: BaseException, skip: Collection[str] = ()) -> str:
    """The innermost traceback frame outside torch and ``skip``, as 'file:line in fn: code'.

    Follows ``__cause__``/``__context__`` chains; ``skip`` holds absolute paths of our own
    modules, whose frames say nothing about where the user's code broke. ``''`` if none is left.
    """
    found = ""
    seen: set[int] = set()
    exc: BaseException | None = e
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for fr in traceback.extract_tb(exc.__traceback__):
            path = os.path.abspath(fr.filename)
            if path.startswith(_TORCH_DIR) or path in skip or "<" in fr.filename:
                continue
            found = f"{fr.filename}:{fr.lineno} in {fr.name}: {(fr.line or '').strip()}"
        exc = exc.__cause__ or exc.__context__
    return found


def trace_failure_message(
    model: nn.Module,
    failures: list[tuple[str, BaseException]],
    method: str,
    skip: Collection[str] = (),
    hint: str | None = None,
) -> str:
    """What each tracer said, where in the user's code, and what to change (``TraceError``'s text).

    Args:
        model: the model that could not be traced.
        failures: (tracer name, its exception), in the order they were tried.
        method: the ``method`` the user asked ``trace`` for.
        skip: absolute paths of the tracing modules, left out when looking for the user's frame.
        hint: the fix that applies to this kind of model (``hf.failure_hint`` for a Hugging Face
            model), in place of the general advice (leaf modules, exportable code).
    """
    lines = [f"could not trace {type(model).__name__} (method={method!r})."]
    for tracer, e in failures:
        reason = str(e).strip() or type(e).__name__
        if len(reason) > _MAX_REASON:
            reason = reason[:_MAX_REASON] + " ..."
        where = user_frame(e, skip)
        lines.append(f"- {tracer} failed with {type(e).__name__}: {reason}")
        if where:
            lines.append(f"  at {where}")
    if hint is not None:
        lines.append(hint)
        return "\n".join(lines)
    lines.append(
        "To fix: mark the module that holds the failing code as a leaf, "
        "trace(..., leaf_modules=[TheModuleClass or 'its.qualified.name']) (fx keeps leaves as "
        "single nodes); or make it exportable (replace Python control flow on tensor values with "
        "torch.where / torch.cond, avoid .item() and data-dependent shapes) and use "
        "method='export'."
    )
    return "\n".join(lines)
