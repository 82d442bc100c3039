"""The draft-length tuner finds, per batch size, the k with the most tokens per second of step, from
measured step times and acceptance; the engine using it stays lossless."""

from __future__ import annotations

import itertools
import random

import pytest

from specsplit.target_service.draft_tuner import RETRY_STEPS, DraftTuner


def step_seconds(batch: int, k: int) -> float:
    """A device that is idle at small batch (a longer verify costs little) and full at large batch."""
    tokens = batch * (k + 1)
    return 1e-3 * (1.0 + 0.4 * (k > 0) + max(0, tokens - 64) / 64)


ACCEPT = 0.7  # each next draft is accepted with this probability, given the ones before were


def expected(k: int) -> float:
    return 1 + sum(ACCEPT ** (j + 1) for j in range(k))


def best_k(batch: int, choices) -> int:
    return max(choices, key=lambda k: expected(k) / step_seconds(batch, k))


def drive(tuner: DraftTuner, batch: int, steps: int, rng: random.Random, noise: float = 0.05) -> list[int]:
    chosen = []
    for _ in range(steps):
        k = tuner.choose(batch)
        assert tuner.choose(batch) == k  # no side effects: prefetch and propose must agree
        verified = []
        for _ in range(batch):
            accepted = 0
            while accepted < k and rng.random() < ACCEPT:
                accepted += 1
            verified.append((k, accepted))
        tuner.observe(batch, k, step_seconds(batch, k) * (1 + noise * rng.uniform(-1, 1)), verified)
        chosen.append(k)
    return chosen


@pytest.mark.parametrize("batch", [1, 4, 16, 64])
def test_the_tuner_settles_on_the_fastest_draft_length_per_batch(batch):
    tuner = DraftTuner(15)
    chosen = drive(tuner, batch, 400, random.Random(batch))
    want = best_k(batch, tuner.choices)
    assert set(chosen[:15]) == set(tuner.choices)  # each tried first, largest first
    assert chosen[0] == 15
    late = chosen[200:]
    rate = [expected(k) / step_seconds(batch, k) for k in late]
    # then the best, or one within the noise of it (±5 % step times here), with the occasional retry
    assert sum(rate) / len(rate) >= 0.95 * expected(want) / step_seconds(batch, want)
    if batch in (1, 16, 64):  # a clear winner (4: 15 and 7 drafts are 5 % apart)
        assert late.count(want) >= 0.9 * len(late) and tuner.best(batch) == want
    # The picks differ by batch size here: 15 at one sequence, none at 64.
    assert best_k(1, tuner.choices) == 15 and best_k(64, tuner.choices) == 0


def test_buckets_learn_apart_and_retries_notice_a_change():
    tuner = DraftTuner(15, retry_every=8)
    rng = random.Random(0)
    drive(tuner, 1, 100, rng)
    drive(tuner, 64, 100, rng)
    assert tuner.best(1) == best_k(1, tuner.choices) and tuner.best(64) == best_k(64, tuner.choices)
    # Acceptance collapses (a drafter that no longer fits the traffic): k = 0 becomes the best at one
    # sequence too; the retries measure it, since the observed acceptance drops. (A position forgets only at
    # steps that offer drafts there, and the 64-sequence steps above left much to forget: ~400 steps here.)
    for _ in range(500):
        k = tuner.choose(1)
        tuner.observe(1, k, step_seconds(1, k), [(k, 0)])
    assert tuner.best(1) == 0


def test_first_step_of_a_shape_is_not_counted_and_caps_hold():
    tuner = DraftTuner(5)
    assert tuner.choices == (5, 3, 1, 0)  # candidates above the most are replaced by it
    tuner.observe(2, 5, 10.0, [(5, 5), (5, 5)])  # a capture: slow, and not counted
    tuner.observe(2, 5, 0.001, [(5, 5), (5, 5)])
    assert tuner._buckets[2].seconds[5] == pytest.approx(0.001)
    assert tuner.expected_tokens(5) == pytest.approx(6.0)
    with pytest.raises(ValueError):
        DraftTuner(-1)
    assert DraftTuner(0).choices == (0,)


def test_steps_without_a_comparable_time_teach_acceptance_only():
    """The engine passes no time for a chained step that followed a changed batch or a prefill (their
    device work lands in the next read whatever k ran). Those steps still teach acceptance, and the
    choice rests on the steady steps' times: timed with them, every k looked alike and a rarely timed
    one won."""
    tuner = DraftTuner(15)
    tuner.observe(8, 15, None, [(15, 0)] * 8)  # nothing accepted: E(k) falls, no time recorded
    assert tuner.expected_tokens(15) < 2.0 and tuner.snapshot()["buckets"][8] == {}
    assert tuner.choose(8) == 15  # still to be measured: a step without a time did not count as a sample
    tuner, rng = DraftTuner(15), random.Random(5)
    for step in range(600):
        k = tuner.choose(16)
        verified = [(k, next(a for a in range(k + 1) if a == k or rng.random() >= ACCEPT)) for _ in range(16)]
        churn = step % 3 == 0  # a request came or went: the read also holds ~4 ms of k-independent work
        tuner.observe(16, k, None if churn else step_seconds(16, k), verified)
    assert tuner.best(16) == best_k(16, tuner.choices)


def test_a_position_not_offered_keeps_what_was_seen_of_it():
    """While the tuner runs a shorter k, the far positions are not forgotten: E(15) stays what the long
    drafts showed (before, it decayed at every step until a few retries' samples, mostly rejections, made
    E(15) equal E(7) on the H200 at eight streams)."""
    tuner = DraftTuner(15)
    rng = random.Random(3)
    for _ in range(200):  # 15 drafts, each next one accepted with ACCEPT
        verified = [(15, next(a for a in range(16) if a == 15 or rng.random() >= ACCEPT)) for _ in range(8)]
        tuner.observe(8, 15, 1e-3, verified)
    far = tuner.expected_tokens(15) - tuner.expected_tokens(7)
    assert far == pytest.approx(expected(15) - expected(7), rel=0.3)
    for _ in range(500):  # then 7 drafts only ...
        verified = [(7, next(a for a in range(8) if a == 7 or rng.random() >= ACCEPT)) for _ in range(8)]
        tuner.observe(8, 7, 1e-3, verified)
    tuner.observe(8, 15, 1e-3, [(15, 7)] * 8)  # ... and a retry of 15 whose eight proposals all stop at the 8th
    assert tuner.expected_tokens(15) - tuner.expected_tokens(7) == pytest.approx(far, rel=0.3)


def test_a_retry_runs_its_k_three_steps_in_a_row():
    """The engine times a chained step only between two of the same k, so a retry lasts three steps (its
    middle one timed), all asked for before the first of them is observed as timed."""
    tuner = DraftTuner(15, retry_every=16)
    for _ in range(200):
        k = tuner.choose(1)
        tuner.observe(1, k, step_seconds(1, k), [(k, k)])
    runs, chosen = [], []
    for _ in range(160):
        k = tuner.choose(1)
        chosen.append(k)
        tuner.observe(1, k, step_seconds(1, k), [(k, k)])
    best = tuner.best(1)
    for i, k in enumerate(chosen):
        if k != best and (i == 0 or chosen[i - 1] != k):
            runs.append(len(list(itertools.takewhile(lambda x: x == k, chosen[i:]))))
    assert runs and all(n == RETRY_STEPS for n in runs), (runs, chosen)


def test_the_engine_tuning_its_draft_length_is_lossless(tiny_chat_dir):
    import torch

    from specsplit.drafter_service.checkpoint import random_drafter
    from specsplit.local import target_head, target_info
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.engine import Engine, EngineConfig
    from specsplit.target_service.model import load_target
    from specsplit.target_service.sequence import Request
    from tests.oracle import OracleDrafter

    target = load_target(tiny_chat_dir, dtype=torch.float32)
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time"]

    def run(proposer, **config):
        engine = Engine(target, proposer, EngineConfig(max_batch=4, **config))
        events = engine.generate([Request(f"r{i}", tokenizer.encode(p), SamplingParams(max_tokens=60, ignore_eos=True))
                                  for i, p in enumerate(prompts)])
        return {rid: [t for e in evs for t in e.token_ids] for rid, evs in events.items()}, engine

    want, _ = run(None)
    inner = random_drafter("dflash", target_info(target), target_head(target), seed=0, dtype=torch.float32,
                           block_size=8)
    oracle = OracleDrafter(inner, {tuple(tokenizer.encode(p)): tokenizer.encode(p) + want[f"r{i}"]
                                   for i, p in enumerate(prompts)}, mistake_rate=0.15)
    asked = set()
    propose = oracle.propose
    oracle.propose = lambda rs: asked.update(r.num_drafts for r in rs) or propose(rs)
    got, engine = run(oracle, auto_drafts=True)
    assert got == want
    assert engine.tuner is not None and engine.tuner.choices == (7, 3, 1, 0)
    assert {7, 3, 1} <= asked  # it tried the lengths (0 asks the drafter nothing)
    # Every length was timed in the bucket the steps ran in (3 sequences, then fewer).
    assert set(engine.tuner._buckets[4].seconds) == {7, 3, 1, 0}


def test_a_configured_cap_limits_what_the_tuner_tries():
    tuner = DraftTuner(15)
    drive_capped = []
    for _ in range(40):
        k = tuner.choose(8, 3)
        drive_capped.append(k)
        tuner.observe(8, k, step_seconds(8, k), [(k, k)] * 8)
    assert set(drive_capped) == {3, 1, 0}  # 15 and 7 would run as 3: never tried at this batch size
    assert tuner.best(8, 3) in (3, 1, 0) and tuner.choose(8, 5) in (3, 1, 0)


def test_a_one_off_slow_step_does_not_keep_a_draft_length_out():
    """A graph captured mid-run (the MTP chain captures one per new cache length) makes one step of a k
    a hundred times slower: the tuner still settles on that k, and a lasting slowdown still counts."""
    tuner = DraftTuner(3, retry_every=8)
    rng = random.Random(3)
    drive(tuner, 1, 20, rng)
    want = best_k(1, tuner.choices)
    assert want == 3 and tuner.best(1) == want
    tuner.observe(1, want, 100 * step_seconds(1, want), [(want, 2)])  # a capture
    assert tuner.best(1) == want
    chosen = drive(tuner, 1, 40, rng)
    assert chosen[-8:].count(want) >= 8 - RETRY_STEPS  # (all but a retry's steps: one every 8 here)
    # the first counted step of a k a one-off (a capture on the step after its first): taken over at once
    fresh = DraftTuner(3)
    for k, seconds in ((3, 1.0), (3, 0.5), (3, step_seconds(1, 3))):
        fresh.observe(1, k, seconds, [(k, 3)])
    assert fresh._buckets[1].seconds[3] == pytest.approx(step_seconds(1, 3))
    # past its warm-up, one short step of a k (fewer drafts near a request's end) only moves its average
    settled = tuner._buckets[1].seconds[want]
    tuner.observe(1, want, settled / 10, [(want, 2)])
    assert tuner._buckets[1].seconds[want] == pytest.approx(settled + 0.25 * (settled / 10 - settled))
    # a lasting slowdown of the best k: after some steps another k wins
    for _ in range(60):
        k = tuner.choose(1)
        tuner.observe(1, k, step_seconds(1, k) * (10 if k == want else 1), [(k, min(k, 2))])
    assert tuner.best(1) != want


def test_the_snapshot_shows_what_the_choice_rests_on():
    tuner = DraftTuner(15)
    chosen = drive(tuner, 8, 60, random.Random(8))
    snap = tuner.snapshot()
    assert snap["learned"] == {8: tuner.best(8)} and chosen
    assert list(snap["expected_tokens"]) == list(tuner.choices)
    assert snap["expected_tokens"][0] == 1.0 and snap["expected_tokens"][15] == tuner.expected_tokens(15)
    measured = snap["buckets"][8]
    assert set(measured) == set(tuner.choices)  # every candidate was measured past its first step
    for k, row in measured.items():
        assert row["ms"] == pytest.approx(1e3 * tuner._buckets[8].seconds[k])
        assert row["tokens_per_s_per_sequence"] == pytest.approx(tuner.expected_tokens(k) / tuner._buckets[8].seconds[k])
    # the learned k is the one with the most tokens per second of step
    assert max(measured, key=lambda k: (measured[k]["tokens_per_s_per_sequence"], -k)) == tuner.best(8)
    assert DraftTuner(3).snapshot() == {"expected_tokens": {3: 4.0, 1: 2.0, 0: 1.0}, "buckets": {}, "learned": {}}
