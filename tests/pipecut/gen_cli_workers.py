"""What each gloo process of the ``pipecut generate`` job tests runs (module-level, so the pool can pickle it)."""

from __future__ import annotations

import contextlib
import io
from typing import Any

from pipecut.cli import main

__all__ = ["generate", "failure"]


def _main(argv: list[str]) -> tuple[int, str, str]:
    """``pipecut generate`` on this rank: its exit code, its stdout and its stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["generate", *argv])
    return code, out.getvalue(), err.getvalue()


def generate(rank: int, world: int, argv: list[str]) -> tuple[int, str, str]:
    """``pipecut generate argv`` on this rank of the job, as torchrun would start it."""
    return _main(argv)


def failure(rank: int, world: int, case: str, good: list[str], broken: list[str]) -> tuple[int, str, str]:
    """One failure of a 2-rank job: ``'layout'``, a layout that is not the world's; ``'loading'``, a
    checkpoint only rank 1 fails to load; ``'generating'``, rank 1 failing in the middle of generating."""
    from runtime.generate.stage import StageRunner

    if case == "layout":
        return _main([*good, "--pp", "3", "--dp", "1"])
    if case == "loading":
        return _main(broken)
    assert case == "generating", case
    real = StageRunner.__call__
    calls = [0]

    def failing(self: StageRunner, hop: Any) -> Any:
        calls[0] += 1
        if rank == 1 and calls[0] == 3:  # rank 1's stage, at its third step
            raise RuntimeError("injected failure in rank 1's stage")
        return real(self, hop)

    StageRunner.__call__ = failing  # type: ignore[method-assign]
    try:
        return _main(good)
    finally:
        StageRunner.__call__ = real  # type: ignore[method-assign]
