"""What each gloo process of the ``pipecut generate`` failure tests runs (module-level, so ``spawn`` can pickle it)."""

from __future__ import annotations

import contextlib
import io
from typing import Any

from pipecut.cli import main


def _main(argv: list[str]) -> tuple[int, str, str]:
    """``pipecut generate`` on this rank: its exit code, its stdout and its stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["generate", *argv])
    return code, out.getvalue(), err.getvalue()


def failures(rank: int, world: int, good: list[str], broken: list[str]) -> dict[str, Any]:
    """On a 2-rank job: a layout that is not the world's, a checkpoint only rank 1 fails to load, then
    rank 1 failing in the middle of generating (last: this rank's process then leaves the job)."""
    from runtime.generate.stage import StageRunner

    got: dict[str, Any] = {"layout": _main([*good, "--pp", "3", "--dp", "1"]), "loading": _main(broken)}
    real = StageRunner.__call__
    calls = [0]

    def failing(self: StageRunner, hop: Any) -> Any:
        calls[0] += 1
        if rank == 1 and calls[0] == 3:  # rank 1's stage, at its third step
            raise RuntimeError("injected failure in rank 1's stage")
        return real(self, hop)

    StageRunner.__call__ = failing  # type: ignore[method-assign]
    try:
        got["generating"] = _main(good)
    finally:
        StageRunner.__call__ = real  # type: ignore[method-assign]
    return got
