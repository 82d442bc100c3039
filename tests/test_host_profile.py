"""bench/host_profile.py's arithmetic over an engine's and a drafter's counters (the bench runs on the device)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.bench_modules import bench_module


@pytest.fixture(scope="module")
def host_profile():
    yield from bench_module("host_profile")


def test_a_runs_chain_tally_is_what_changed_in_it(host_profile):
    counters = SimpleNamespace(chained=10, chain_replays=4, chain_captures=1, chain_capture_seconds=0.5,
                               chain_programs_made=3, chain_programs_dropped=0)
    before = host_profile.chain_tally(counters)
    counters.chained, counters.chain_replays, counters.chain_captures = 145, 139, 2
    counters.chain_capture_seconds, counters.chain_programs_made, counters.chain_programs_dropped = 0.531, 5, 1
    line = host_profile.said_chain_tally(host_profile.chain_tally(counters), before, 7)
    assert line == "135 chained, 135 replayed, 1 captured (31 ms), programs 2 made, 1 dropped, 7 held"


def test_the_drafters_chained_steps_by_outcome_count_only_this_run(host_profile):
    before = {"uncaptured": 40.0, "captured": 5.0, "replayed": 100.0}
    after = {"uncaptured": 42.0, "captured": 6.0, "replayed": 233.0, "prepared": 3.0}
    assert host_profile.graph_line(before, after, "timed") == \
        "drafter (timed): chained steps uncaptured 2, captured 1, replayed 133, prepared 3"
    assert host_profile.graph_line(after, after, "profiled") == "drafter (profiled): chained steps none"


def test_the_serving_line_gives_the_median_timed_run_and_every_runs_step(host_profile):
    one = host_profile.timed_line([(0.5, 200, 4000)])
    assert one == "200 engine steps, 2.500 ms/step unprofiled (8,000 tok/s, 20.00 tokens a step)"
    runs = [(0.6, 200, 4000), (0.4, 200, 4000), (0.5, 196, 3920), (0.9, 200, 4000)]  # (even: the lower middle)
    assert host_profile.timed_line(runs) == ("196 engine steps, 2.551 ms/step unprofiled (7,840 tok/s, 20.00 tokens a "
                                             "step; median of 4 timed runs, in order 3.000 2.000 2.551 4.500 ms/step)")


@pytest.mark.parametrize("runs", [[], [(0.5, 0, 10)], [(0.0, 10, 10)]], ids=["none", "no-steps", "no-time"])
def test_timed_runs_without_steps_or_time_are_refused(host_profile, runs):
    with pytest.raises(ValueError, match="timed runs"):
        host_profile.timed_line(runs)
