"""bench/pair_bench.py's arithmetic over a run's counters (the bench itself runs on the device)."""

from __future__ import annotations


import pytest

from tests.bench_modules import bench_module


@pytest.fixture(scope="module")
def pair_bench():
    yield from bench_module("pair_bench")


def test_the_step_shape_is_the_requests_steps_and_the_wall_time_over_the_targets_steps(pair_bench):
    # 8 requests of 50 steps each (a prefill and 49 verifies) over 80 target steps in 2 s: 4.9 sequences a
    # step, 25 ms a step
    shape = pair_bench.step_shape(8 * 50, 8, 2.0, 80)
    assert shape == pytest.approx({"sequences_per_step": 4.9, "wall_ms_per_step": 25.0})
    assert pair_bench.said_shape(shape) == ", 4.90 sequences a step, 25.000 ms a step (wall)"


def test_without_steps_counted_no_shape_is_claimed(pair_bench):
    assert pair_bench.step_shape(400, 8, 2.0, 0) == {}
    assert pair_bench.said_shape({}) == ""
