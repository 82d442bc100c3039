"""bench/timeline.py's summary: two processes' traces on one clock, each idle gap charged to a cause."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("timeline", Path(__file__).parents[1] / "bench" / "timeline.py")
timeline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(timeline)


def trace(base_ns: int, launches, kernels, steps=()) -> dict:
    """launches: (correlation, start, end); kernels: (correlation, start, end); steps: starts — in µs
    from the trace's own base."""
    events = [{"ph": "M", "name": "process_name", "ts": 0, "pid": 1, "args": {"name": "python"}}]
    events += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": s, "dur": e - s,
                "args": {"correlation": c}} for c, s, e in launches]
    events += [{"ph": "X", "cat": "kernel", "name": "k", "ts": s, "dur": e - s, "args": {"correlation": c}}
               for c, s, e in kernels]
    events += [{"ph": "X", "cat": "user_annotation", "name": timeline.STEP_MARK, "ts": s, "dur": 5} for s in steps]
    return {"baseTimeNanoseconds": base_ns, "traceEvents": events}


def two_sides():
    # The target's trace counts from 5,000 µs, the drafter's from 0: on one clock they interleave.
    target = trace(5_000_000, launches=[(1, 0, 10), (2, 200, 250), (3, 400, 410)],
                   kernels=[(1, 20, 120), (2, 260, 360), (3, 420, 500)], steps=[0, 200, 400])
    drafter = trace(0, launches=[(6, 4950, 4960), (7, 5090, 5100), (8, 5290, 5300), (9, 5450, 5460)],
                    kernels=[(6, 4970, 4990), (7, 5130, 5180), (8, 5340, 5400), (9, 5510, 5560)])
    return target, drafter


def test_each_gap_goes_to_the_side_whose_work_came_next_and_why():
    """Window 5,000–5,400 µs (two whole target steps). Busy: the target alone 180 µs, the drafter alone
    90, both 20 (time-sliced). Idle 110: 5,000–5,020 before the target's kernel, whose launch returned at
    5,010 (10 host-late, 10 waiting); 5,120–5,130 before the drafter's, launched long before (10
    waiting); 5,180–5,260 before the target's, launched at 5,250 (70 late, 10 waiting)."""
    target, drafter = two_sides()
    s = timeline.summarize({"target": target, "drafter": drafter}, "target")
    assert s["steps"] == 2 and s["step_ms"] == pytest.approx(0.2)
    expected = {"target_gpu_only_ms": 0.090, "drafter_gpu_only_ms": 0.045, "both_gpu_ms": 0.010,
                "target_host_late_ms": 0.040, "target_gpu_waiting_ms": 0.010,
                "drafter_host_late_ms": 0.0, "drafter_gpu_waiting_ms": 0.005, "idle_ms": 0.055}
    for key, value in expected.items():
        assert s[key] == pytest.approx(value, abs=1e-9), key
    busy = s["target_gpu_only_ms"] + s["drafter_gpu_only_ms"] + s["both_gpu_ms"]
    assert busy + s["idle_ms"] == pytest.approx(s["step_ms"])  # every µs of the window accounted once


def test_one_side_alone_and_traces_read_gzipped(tmp_path):
    target, _ = two_sides()
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(target, f)
    s = timeline.summarize({"target": timeline.load_trace(path)}, "target")
    assert s["target_gpu_only_ms"] == pytest.approx(0.1) and "both_gpu_ms" not in s
    # alone, the gap 5,120–5,260 is the target's own: its launch returned at 5,250 (130 late, 10 waiting)
    assert s["target_host_late_ms"] == pytest.approx(0.07) and s["target_gpu_waiting_ms"] == pytest.approx(0.01)


def test_traces_without_gpu_work_or_steps_are_refused():
    target, drafter = two_sides()
    with pytest.raises(ValueError, match="no GPU activity"):
        timeline.summarize({"target": target, "drafter": trace(0, [], [])}, "target")
    late = trace(9_000_000, [(1, 0, 1)], [(1, 2, 3)])  # recorded after the target's window: no overlap
    with pytest.raises(ValueError, match="fewer than two"):
        timeline.summarize({"target": target, "drafter": late}, "target")
