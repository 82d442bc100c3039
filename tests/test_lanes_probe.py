"""bench/lanes_probe.py: requests dealt to lanes, and lanes stepped in turn emit what one engine does (the bench
itself measures on the device)."""

from __future__ import annotations

import pytest

from tests.bench_modules import bench_module


@pytest.fixture(scope="module")
def lanes_probe():
    yield from bench_module("lanes_probe")


def test_requests_are_dealt_to_the_lanes_in_turn(lanes_probe):
    assert lanes_probe.deal(5, 1) == [[0, 1, 2, 3, 4]]
    assert lanes_probe.deal(5, 2) == [[0, 2, 4], [1, 3]]
    assert lanes_probe.deal(2, 4) == [[0], [1], [], []]
    with pytest.raises(ValueError):
        lanes_probe.deal(3, 0)


def test_lanes_share_the_slots_evenly_or_not_at_all(lanes_probe):
    assert lanes_probe.lane_slots(8, 1) == 8
    assert lanes_probe.lane_slots(8, 4) == 2
    with pytest.raises(ValueError):
        lanes_probe.lane_slots(8, 3)
    with pytest.raises(ValueError):
        lanes_probe.lane_slots(8, 0)


@pytest.mark.slow
def test_two_lanes_stepped_in_turn_emit_what_one_engine_emits(lanes_probe, smollm2, smollm2_tokenizer):
    """float32 on the CPU: every request's tokens through two engines of two slots, stepped in turn, equal those
    through one engine of four, target only and drafted; and the tally counts what each run emitted."""
    from specsplit.local import LocalSetup

    setup = LocalSetup(drafter="dflash", device="cpu")
    model, tokenizer = smollm2, smollm2_tokenizer
    prompts = [tokenizer.encode(text) for text in ("Name three colours.", "What is 2 + 2?", "Say hello.")]
    for drafted in (False, True):
        runs = []
        for lanes in (1, 2):
            engines, streams = lanes_probe.build_lanes(model, setup, tokenizer, lanes, 4, drafted, 0)
            runs.append(lanes_probe.serve(engines, streams, prompts, 6, "r", "cpu"))
        one, two = runs
        assert sorted(one.tokens) == ["0", "1", "2"]
        assert all(1 <= len(ids) <= 6 for ids in one.tokens.values())
        assert lanes_probe.matching(two, one) == 3
        assert one.emitted == two.emitted > 3
        assert two.steps > two.rounds  # (both lanes stepped in the same turns)
