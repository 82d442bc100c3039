"""bench/pair_bench.py's arithmetic over a run's counters (the bench itself runs on the device)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench"


@pytest.fixture(scope="module")
def pair_bench():
    sys.path.insert(0, str(BENCH))  # (it imports a sibling)
    try:
        spec = importlib.util.spec_from_file_location("pair_bench", BENCH / "pair_bench.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def test_the_step_shape_is_the_requests_steps_and_the_wall_time_over_the_targets_steps(pair_bench):
    # 8 requests of 50 steps each (a prefill and 49 verifies) over 80 target steps in 2 s: 4.9 sequences a
    # step, 25 ms a step
    shape = pair_bench.step_shape(8 * 50, 8, 2.0, 80)
    assert shape == pytest.approx({"sequences_per_step": 4.9, "wall_ms_per_step": 25.0})
    assert pair_bench.said_shape(shape) == ", 4.90 sequences a step, 25.000 ms a step (wall)"


def test_without_steps_counted_no_shape_is_claimed(pair_bench):
    assert pair_bench.step_shape(400, 8, 2.0, 0) == {}
    assert pair_bench.said_shape({}) == ""
