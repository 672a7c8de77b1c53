"""timeline.py: metrics from spans, measured records as timelines, Chrome traces and Gantt charts.

Legend: ``p`` ranks, ``m`` micro-batches, ``S`` stages, ``s`` a stage, ``r`` a rank, ``mb`` a
micro-batch; times in seconds, trace times in microseconds.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from partitioner.schedule import timeline as tl
from partitioner.schedule.actions import Kind
from partitioner.schedule.errors import TimelineError
from partitioner.schedule.generators import one_f_one_b
from partitioner.schedule.registry import get_schedule
from partitioner.schedule.simulate import Link, StageCosts, simulate
from partitioner.schedule.zero_bubble import zbv
from runtime.execute.executor import ActionRecord
from schedule_cases import refuses

F, B, I, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT


def span(rank: int, label: str, start: float, end: float) -> tl.Span:
    stage, kind, mb = int(label[0]), label[1], int(label[2:])
    return tl.Span(rank, stage, kind, mb, start, end)  # type: ignore[arg-type]


def simulated(name: str = "1f1b", p: int = 3, m: int = 4, **kw: object) -> tl.Timeline:
    schedule = get_schedule(name, p, m, **kw)
    S = schedule.num_stages
    costs = StageCosts.uniform(S, activation_bytes=1e6, output_bytes=2e5)
    return simulate(schedule, costs, links=Link(latency=0.1, bandwidth=1e6)).timeline


# -- metrics -----------------------------------------------------------------------------------


def test_metrics_of_a_hand_built_timeline() -> None:
    # Rank 0: 0F0 [0, 1], 0F1 [1, 2], 0I0 [4, 5], 0W0 [5, 6], 0B1 [6, 8].
    # Rank 1: 1F0 [1, 2], 1B0 [2, 4], 1F1 [4, 5], 1B1 [5, 6].
    spans = (
        span(0, "0F0", 0, 1), span(0, "0F1", 1, 2), span(0, "0I0", 4, 5), span(0, "0W0", 5, 6),
        span(0, "0B1", 6, 8), span(1, "1F0", 1, 2), span(1, "1B0", 2, 4), span(1, "1F1", 4, 5),
        span(1, "1B1", 5, 6),
    )  # fmt: skip
    t = tl.Timeline(spans, activation_bytes=(100.0, 10.0))
    assert t.num_ranks == 2 and t.start == 0 and t.step_time == 8
    assert t.busy == (6.0, 5.0) and t.bubble == (2 / 8, 3 / 8)
    assert t.bubble_total == pytest.approx(5 / 16)
    assert t.memory(0) == (
        (0, 1, 100.0), (1, 2, 200.0), (6, 1, 100.0), (8, 0, 0.0)
    )  # fmt: skip  # 0F0 is held until 0W0 ends, not 0I0
    assert t.memory(1) == ((1, 1, 10.0), (4, 0, 0.0), (4, 1, 10.0), (6, 0, 0.0))
    assert t.peak_inflight == (2, 1) and t.peak_bytes == (200.0, 10.0)
    assert tl.Timeline(spans).peak_bytes is None
    assert [x.label for x in t.of_rank(1)] == ["1F0", "1B0", "1F1", "1B1"]


def test_forward_only_and_empty_timelines_hold_nothing() -> None:
    t = tl.Timeline((span(0, "0F0", 0, 1), span(1, "1F0", 1, 2)), num_ranks=3)
    assert t.num_ranks == 3 and t.peak_inflight == (0, 0, 0) and t.bubble[2] == 1.0
    empty = tl.Timeline(())
    assert (empty.step_time, empty.bubble, empty.bubble_total) == (0.0, (), 0.0)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: tl.Timeline((span(0, "0F0", 2, 1),)), "runs from 2 to 1"),
        (lambda: tl.Timeline((span(0, "0F0", 0, float("nan")),)), "must be finite"),
        (lambda: tl.Span(0, 0, "X", 0, 0, 1), "span kind 'X' is not one of F, B, I, W"),  # type: ignore[arg-type]
        (lambda: tl.Timeline((span(0, "1F0", 0, 1),), activation_bytes=(1.0,)),
         "activation_bytes has 1 entries but spans run stages 0..1"),
        (lambda: tl.Timeline((span(0, "0F0", 0, 1),), (tl.Message(0, 2, 1, 2, 0, 1, F, 0),)),
         r"ranks must be in 0..0"),
        (lambda: tl.Timeline((span(0, "0F0", 0, 1), span(1, "1F0", 0, 1)),
                          (tl.Message(0, 1, 2, 1, 0, 1, F, 0),)), "recv >= send"),
    ],
)  # fmt: skip
def test_timeline_says_what_is_wrong(build: Callable[[], object], match: str) -> None:
    refuses(TimelineError, build, match)


# -- measured runs -----------------------------------------------------------------------------


def test_from_records_shifts_time_and_infers_hand_overs() -> None:
    t0 = 1000.0  # perf_counter has an arbitrary origin
    records = [
        ActionRecord(0, 0, "F", 0, t0 + 0.0, t0 + 1.0),
        ActionRecord(1, 1, "F", 0, t0 + 1.5, t0 + 2.0),
        ActionRecord(1, 2, "F", 0, t0 + 2.0, t0 + 3.0),  # stage 2 on rank 1 too: no message
        ActionRecord(1, 2, "I", 0, t0 + 3.0, t0 + 4.0),
        ActionRecord(1, 1, "B", 0, t0 + 4.0, t0 + 5.0),
        ActionRecord(0, 0, "B", 0, t0 + 5.5, t0 + 7.0),
        ActionRecord(1, 2, "W", 0, t0 + 5.0, t0 + 6.0),
    ]
    t = tl.from_records(records, act_bytes=[1.0, 2.0, 4.0])
    assert t.start == 0.0 and t.step_time == 7.0 and t.num_ranks == 2
    assert all(isinstance(x.kind, Kind) for x in t.spans)
    assert [(m.src, m.dst, m.what, m.src_stage, m.dst_stage, m.send, m.recv) for m in t.messages] == [
        (0, 1, "act", 0, 1, 1.0, 1.5),
        (1, 0, "grad", 1, 0, 5.0, 5.5),
    ]  # fmt: skip
    assert t.peak_inflight == (1, 2) and t.peak_bytes == (1.0, 6.0)
    assert tl.from_records(records, infer_messages=False).messages == ()
    with pytest.raises(TimelineError, match="has kind 'Z'"):
        tl.from_records([ActionRecord(0, 0, "Z", 0, 0.0, 1.0)])


def test_a_simulation_read_back_as_records_gives_the_same_metrics() -> None:
    for name, kw in [("1f1b", {}), ("zbh1", {}), ("interleaved", {"v": 2}), ("zbv", {})]:
        sim = simulated(name, 3, 6, **kw)
        again = tl.from_records(sim.spans, sim.activation_bytes)
        assert again.spans == sim.spans
        assert again.bubble == sim.bubble and again.peak_bytes == sim.peak_bytes
        # Inferred hand-overs are the simulated messages, received when their reader starts.
        assert {(m.src, m.dst, m.src_stage, m.kind, m.mb, m.send) for m in again.messages} == {
            (m.src, m.dst, m.src_stage, m.kind, m.mb, m.send) for m in sim.messages
        }


# -- Chrome trace ------------------------------------------------------------------------------


def test_chrome_trace_has_a_track_per_rank_flows_and_memory() -> None:
    t = simulated("1f1b", 3, 4)
    trace = tl.to_chrome_trace(t, name="demo")
    json.dumps(trace)  # serialisable as is
    events = trace["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] in ("process_name", "thread_name")}
    assert names == {"demo", "rank 0", "rank 1", "rank 2"}
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == len(t.spans) == 3 * 2 * 4
    first = next(e for e in slices if e["name"] == "1F3")
    x = next(x for x in t.spans if x.label == "1F3")
    assert first["tid"] == x.rank == 1 and first["cat"] == "F"
    assert first["args"] == {"stage": 1, "mb": 3, "kind": "F"}
    assert first["ts"] == pytest.approx(x.start * 1e6) and first["dur"] == pytest.approx(
        x.duration * 1e6
    )
    # A flow arrow per message: from inside the sender's slice to the start of the reader's.
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert len(starts) == len(ends) == len(t.messages) == 2 * 2 * 4
    by_label = {(e["tid"], e["name"]): e for e in slices}
    for i, msg in enumerate(t.messages):
        s, f = starts[i], ends[i]
        assert (s["tid"], f["tid"], s["cat"], s["name"]) == (msg.src, msg.dst, f["cat"], f["name"])
        assert f["bp"] == "e" and s["name"] == ("act" if msg.kind is F else "grad")
        producer = by_label[(msg.src, f"{msg.src_stage}{msg.kind.value}{msg.mb}")]
        assert producer["ts"] <= s["ts"] < producer["ts"] + producer["dur"]
        reader = "F" if msg.kind is F else "B"
        assert f["ts"] == by_label[(msg.dst, f"{msg.dst_stage}{reader}{msg.mb}")]["ts"]
        assert s["args"]["arrived (us)"] == pytest.approx(msg.recv * 1e6)
    # Memory: a counter track per rank, in bytes, ending at zero.
    for r in range(3):
        counter = [e for e in events if e["ph"] == "C" and e["tid"] == r]
        assert {e["name"] for e in counter} == {f"rank {r} activations (bytes)"}
        assert max(e["args"]["held"] for e in counter) == t.peak_bytes[r]  # type: ignore[index]
        assert counter[-1]["args"]["held"] == 0


def test_chrome_trace_of_measured_records_counts_micro_batches(tmp_path: Path) -> None:
    records = [ActionRecord(0, 0, "F", 0, 5.0, 5.5), ActionRecord(0, 0, "B", 0, 6.0, 7.0)]
    path = tl.save_chrome_trace(tl.from_records(records), tmp_path / "trace.json")
    events = json.loads(path.read_text())["traceEvents"]
    counter = [(e["name"], e["ts"], e["args"]["held"]) for e in events if e["ph"] == "C"]
    assert counter == [
        ("rank 0 activations (micro-batches)", 0.0, 1),
        ("rank 0 activations (micro-batches)", 2e6, 0),
    ]
    assert [e["ts"] for e in events if e["ph"] == "X"] == [0.0, 1e6]


def test_chrome_trace_of_a_v_schedule_keeps_local_hand_overs_off_the_wire() -> None:
    sim = simulate(zbv(2, 3), StageCosts.uniform(4), links=Link(latency=0.5))
    events = tl.to_chrome_trace(sim.timeline)["traceEvents"]
    flows = [e for e in events if e["ph"] == "s"]
    assert len(flows) == len(sim.timeline.messages) == 2 * 2 * 3  # stages 0<->1 and 2<->3 only
    assert all(e["args"]["from stage"] + e["args"]["to stage"] in (1, 5) for e in flows)


# -- Gantt chart -------------------------------------------------------------------------------


def test_gantt_png_is_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    t = simulated("zbh1", 4, 8)
    path = tl.save_gantt_png(t, tmp_path / "gantt.png", title="ZB-H1")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    tl.save_gantt_png(tl.Timeline(()), tmp_path / "empty.png")  # nothing to draw is not an error


def test_gantt_png_without_matplotlib_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        tl.save_gantt_png(tl.Timeline((span(0, "0F0", 0, 1),)), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_one_f_one_b_trace_round_trips_through_json(tmp_path: Path) -> None:
    sim = simulate(one_f_one_b(2, 2), StageCosts.uniform(2))
    path = tl.save_chrome_trace(sim.timeline, tmp_path / "t.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(tl.to_chrome_trace(sim.timeline)))
