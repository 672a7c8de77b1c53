"""docs/schedules.md shows what the code makes: the grids, the measured table, the example's output.

Legend: ``p`` ranks, ``m`` micro-batches, ``v`` chunks per rank.
"""

from __future__ import annotations

import contextlib
import io
import re

from partitioner.schedule.grid import format_grid
from partitioner.schedule.registry import get_schedule
from partitioner.schedule.simulate import StageCosts, simulate
from partitioner.schedule.validation import peak_inflight_per_rank
from schedule_cases import DOCS

PAGE = DOCS / "schedules.md"
NAMES: tuple[tuple[str, dict[str, int]], ...] = (
    ("gpipe", {}),
    ("1f1b", {}),
    ("interleaved", {"v": 2}),
    ("zbh1", {}),
    ("zbv", {}),
)


def measured_table(p: int = 4, ms: tuple[int, ...] = (4, 8, 16)) -> str:
    """The page's table: per schedule and m, the grid and the simulated step in F = I = W units."""
    lines = [
        "| schedule | m | grid steps | simulated step | bubble | peak in-flight per rank |",
        "|---|---|---|---|---|---|",
    ]
    for m in ms:
        for name, kw in NAMES:
            schedule = get_schedule(name, p, m, **kw)
            v = schedule.num_stages // p
            unit = 1 / v  # a chunk is 1/v of a rank's layers
            costs = StageCosts.uniform(
                schedule.num_stages, forward=unit, backward_input=unit, backward_weight=unit
            )
            sim = simulate(schedule, costs)
            grid_steps = len(format_grid(schedule).splitlines()[0].split()) - 1
            peaks = ", ".join(map(str, peak_inflight_per_rank(schedule)))
            lines.append(
                f"| `{name}` | {m} | {grid_steps} | {sim.step_time:g} | "
                f"{sim.bubble_total:.3f} | ({peaks}) |"
            )
    return "\n".join(lines)


def test_page_shows_the_generated_grids() -> None:
    page = PAGE.read_text()
    for name, kw in NAMES:
        assert f"```text\n{format_grid(get_schedule(name, 4, 8, **kw))}\n```" in page, (
            f"docs/schedules.md has a stale {name} grid"
        )


def test_page_shows_the_measured_table() -> None:
    assert measured_table() in PAGE.read_text(), "docs/schedules.md has a stale measured table"


def test_page_example_prints_what_the_page_says() -> None:
    page = PAGE.read_text()
    section = page[page.index("## Simulating a step") :]
    match = re.search(r"```python\n(.*?)```\n\n```text\n(.*?)```", section, re.DOTALL)
    assert match is not None, "the simulator example and its output are missing"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(match[1], {})  # our own page's example, run as a reader would
    assert out.getvalue() == match[2]
