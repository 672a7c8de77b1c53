"""A file of prompts for ``pipecut generate``: JSON lines with a ``"prompt"`` field, or plain text lines.

A line whose first non-blank character is ``{`` is a JSON object and must hold a string
``"prompt"`` (other fields are ignored); any other non-blank line is a prompt as written (its
line break removed). Blank lines are skipped. A file without one prompt is refused, as is a line
that is neither, with its line number.

Example:
    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "prompts.jsonl"
    >>> _ = p.write_text('{"prompt": "Once upon a time"}\\n\\nthe quick brown fox\\n')
    >>> [(q.line, q.text) for q in read_prompts(p)]
    [(1, 'Once upon a time'), (3, 'the quick brown fox')]
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from partitioner.errors import PipecutError

__all__ = ["Prompt", "PromptsError", "read_prompts"]


class PromptsError(PipecutError, ValueError):
    """A prompts file that is missing, empty, or holds a line that is no prompt."""


@dataclass(frozen=True)
class Prompt:
    """One prompt of the file and the line it came from (1-based), for error messages."""

    line: int
    text: str


def read_prompts(path: str | os.PathLike[str]) -> list[Prompt]:
    """The prompts of ``path``, in file order.

    Raises:
        PromptsError: the file does not exist or cannot be read as UTF-8, a JSON line is not an
            object with a string ``"prompt"``, or the file holds no prompt.
    """
    p = Path(path)
    if not p.is_file():
        raise PromptsError(
            f"prompts file {p} does not exist: pass a file of JSON lines ({{\"prompt\": \"...\"}}) or of "
            "plain text lines, one prompt a line"
        )
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptsError(f"cannot read prompts file {p} as UTF-8 text ({e})") from e
    prompts = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        prompts.append(Prompt(number, _json_prompt(p, number, raw) if raw.lstrip().startswith("{") else raw))
    if not prompts:
        raise PromptsError(
            f"prompts file {p} holds no prompt ({len(lines)} lines, all blank): write one prompt a line, as "
            "{\"prompt\": \"...\"} or as plain text"
        )
    return prompts


def _json_prompt(path: Path, number: int, raw: str) -> str:
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as e:
        raise PromptsError(
            f"{path}:{number}: the line starts with '{{' but is not JSON ({e.msg} at column {e.colno}): write "
            "{\"prompt\": \"...\"} with the text escaped as JSON, or a plain text line not starting with '{'"
        ) from e
    text = record.get("prompt") if isinstance(record, dict) else None
    if not isinstance(text, str):
        found = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise PromptsError(
            f"{path}:{number}: a JSON line needs a string \"prompt\" field, got {found}: write "
            "{\"prompt\": \"...\"}"
        )
    return text
