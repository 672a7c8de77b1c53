"""benchmarks/lib/tensor_peak.py counts CPU tensor bytes exactly: known tensors give known peaks."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from bench_script import load_script

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20


@pytest.fixture(scope="module")
def tp() -> ModuleType:
    module = load_script("lib/tensor_peak", "_bench_tensor_peak")
    return module


def test_known_tensors_give_exact_peaks(tp: ModuleType) -> None:
    before = torch.empty(5 * MIB, dtype=torch.uint8)  # allocated before the window: never counted
    with tp.TensorTrace(ops=True) as trace:
        state = torch.empty(MIB, dtype=torch.uint8)  # live as the step starts
        with trace.span("step 0"):
            a = torch.empty(3 * MIB, dtype=torch.uint8)
            view = a[: MIB]  # no allocation
            del a, view
            b = torch.zeros(2, MIB, dtype=torch.float32)  # 8 MiB
            del before  # its free is not reported: the count does not drop below this window's bytes
            c = torch.empty(MIB, dtype=torch.float64)  # 8 MiB on top of b: the peak, 1 + 8 + 8 MiB
            del b, c
            kept = torch.empty(2 * MIB, dtype=torch.uint8)
        with trace.span("step 1"):
            d = torch.ones(MIB, dtype=torch.int16)  # 2 MiB
            del d
        del state, kept
    s0, s1 = trace.spans("step")
    assert (s0.name, s0.start, s0.peak, s0.end) == ("step 0", MIB, 17 * MIB, 3 * MIB)
    assert (s1.start, s1.peak, s1.end) == (3 * MIB, 5 * MIB, 3 * MIB)
    assert trace.peak == 17 * MIB and trace.bytes_at(s1.end_ns + 10**9) == 0
    at_peak = trace.live_at(s0.peak_ns)
    assert [a.nbytes for a in at_peak] == [8 * MIB, 8 * MIB, MIB]
    assert at_peak[0].ops[0] == "pipecut.span::step 0" and "aten::zeros" in at_peak[1].ops + at_peak[0].ops


def test_without_ops_only_ranges_are_recorded(tp: ModuleType) -> None:
    trace = tp.TensorTrace()  # the default: record_function ranges, every allocation
    with trace, trace.span("step"):
        a = torch.zeros(MIB, dtype=torch.uint8)
        with torch.profiler.record_function("inner"):
            b = torch.zeros(2 * MIB, dtype=torch.uint8)
        del a, b
    (s,) = trace.spans()
    assert s.peak == 3 * MIB
    assert sorted(a.ops for a in trace.live_at(s.peak_ns)) == [("pipecut.span::step",),
                                                               ("pipecut.span::step", "inner")]


def test_a_span_with_no_allocation_peaks_at_its_start(tp: ModuleType) -> None:
    with tp.TensorTrace() as trace:
        x = torch.empty(MIB, dtype=torch.uint8)
        with trace.span("idle"):
            pass
        del x
    (s,) = trace.spans()
    assert (s.start, s.peak, s.end) == (MIB, MIB, MIB)


def test_frees_unseen_or_stamped_late_are_inferred_from_reused_addresses(tp: ModuleType) -> None:
    def replay(events: list[tuple[int, int, int]]) -> tuple[list[int], int]:
        trace = tp.TensorTrace()
        trace._events = [(ns, nbytes, ptr, ()) for ns, nbytes, ptr in events]
        trace._replay_blocks(None)
        return trace._live, trace.reused

    # Another thread freed block 1 unseen; its address came back for block 2, freed in view.
    assert replay([(1, 10, 7), (2, 20, 7), (3, -20, 7)]) == ([10, 20, 0], 1)
    # Block 1's free was stamped after its address's reuse: two frees follow, the late one skipped.
    assert replay([(1, 10, 7), (2, 10, 7), (3, -10, 7), (4, -10, 7)]) == ([10, 10, 10, 0], 1)


def test_mapped_files_are_counted_apart(tp: ModuleType, tmp_path: Path) -> None:
    # safetensors maps a whole file per safe_open, which c10 reports as an allocation of the file's size.
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "a.safetensors"
    save_file({"a": torch.zeros(MIB, dtype=torch.uint8), "b": torch.zeros(2 * MIB, dtype=torch.uint8)}, path)
    size = path.stat().st_size
    for exclude, counted, mapped in (((), size + MIB, 0), ((size,), MIB, size)):
        with tp.TensorTrace(exclude=exclude) as trace, safe_open(str(path), framework="pt") as f:
            copy = f.get_tensor("a").clone()  # the one heap block
            del copy
        assert (trace.peak, trace.excluded_peak) == (counted, mapped)
