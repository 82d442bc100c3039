"""The draft length by measurement (specsplit.calibrate) and the demo's side-by-side report."""

from __future__ import annotations

import pytest
import torch

from specsplit.calibrate import Calibration, Trial, calibrate
from specsplit.demo import Pass, choice_line, print_summary, split_drafts
from specsplit.drafter_service.checkpoint import random_drafter
from specsplit.local import target_head, target_info
from specsplit.target_service.model import load_target


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    model = load_target(tiny_llama_dir, dtype=torch.float32)
    drafter = random_drafter("dflash", target_info(model), target_head(model), seed=0, dtype=torch.float32,
                             block_size=8)  # at most 7 drafts
    return model, drafter


def test_calibrate_tries_each_length_clipped_to_the_drafter(tiny):
    model, drafter = tiny
    # No trial may be cut short here (that is the next test's): a patience no timing noise can exhaust.
    result = calibrate(model, drafter, [5, 6, 7, 8], draft_lengths=(0, 2, 15), max_tokens=12, patience=1e6)
    assert [t.num_drafts for t in result.trials] == [0, 2, 7]
    alone = result.trials[0]
    assert (alone.generated, alone.tau, alone.acceptance) == (12, 1.0, 0.0)
    assert all(t.generated == 12 and t.seconds > 0 and not t.stopped for t in result.trials)
    assert result.fastest in result.trials and result.fastest_drafting.num_drafts in (2, 7)


def test_a_trial_that_cannot_win_is_stopped(tiny):
    model, drafter = tiny
    result = calibrate(model, drafter, [5, 6, 7, 8], draft_lengths=(0, 4), max_tokens=40, rounds=1, patience=0.0)
    alone, drafting = result.trials
    assert not alone.stopped and alone.generated == 40
    assert drafting.stopped and drafting.generated < 40  # one step, then past a zero deadline


def trial(k: int, tokens_per_s: float) -> Trial:
    return Trial(k, generated=32, seconds=32 / tokens_per_s, tau=1.0 + k / 10, acceptance=0.3 if k else 0.0)


@pytest.mark.parametrize("speeds, fastest, drafting, says", [
    ({0: 18.0, 2: 15.0, 4: 13.0}, 0, 2, "target alone is fastest"),
    ({0: 18.0, 2: 25.0, 4: 30.0}, 4, 4, "4 drafts per step, the fastest"),
])
def test_the_choice_and_what_the_demo_says_about_it(speeds, fastest, drafting, says):
    result = Calibration(tuple(trial(k, v) for k, v in speeds.items()), max_tokens=32)
    assert (result.fastest.num_drafts, result.fastest_drafting.num_drafts) == (fastest, drafting)
    assert says in choice_line(result)
    table = "\n".join(result.table())
    assert "vs target alone" in table and f"{speeds[2] / speeds[0]:.2f}x" in table


@pytest.mark.parametrize("speeds, device, args, says", [
    ({0: 18.0, 2: 25.0, 4: 30.0}, "cuda", (), "4 drafts per step, verified as draft trees"),
    ({0: 18.0, 2: 25.0, 4: 30.0}, "cuda:1", (), "4 drafts per step, verified as draft trees"),
    ({0: 18.0, 2: 35.0, 4: 30.0}, "cuda", ("--num-drafts", "2"), "2 drafts per step"),
    ({0: 18.0, 2: 25.0, 4: 30.0}, "cpu", ("--num-drafts", "4"), "4 drafts per step"),
    ({0: 40.0, 2: 25.0, 4: 30.0}, "cuda", (), "4 drafts per step, verified as draft trees"),
])
def test_the_demo_verifies_trees_on_a_gpu_where_the_drafters_own_length_is_fastest(speeds, device, args, says):
    # (as `specsplit up` pairs them: the target given no --num-drafts verifies trees at the drafter's length)
    result = Calibration(tuple(trial(k, v) for k, v in speeds.items()), max_tokens=32)
    assert split_drafts(result, device) == (args, says)


def test_demo_summary_shows_both_speeds_tau_and_acceptance_per_prompt_and_in_total(capsys):
    fast = [Pass((1, 2, 3, 4), 1.0, 2, 4, 2), Pass((5, 6), 0.5, 1, 2, 1)]
    alone = [Pass((1, 2, 3, 4), 0.5, 4, 0, 0), Pass((5, 7), 0.25, 2, 0, 0)]
    print_summary(list(zip(fast, alone)), "2 drafts per step")
    lines = capsys.readouterr().out.splitlines()
    assert "speculative tok/s" in lines[1] and "target alone tok/s" in lines[1] and "acceptance" in lines[1]
    assert lines[2].split() == ["1", "4", "4.0", "8.0", "0.50x", "2.00", "50%", "yes"]
    assert lines[3].split()[-1] == "NO"
    assert lines[4].split() == ["total", "6", "4.0", "8.0", "0.50x", "2.00", "50%", "1", "of", "2"]
