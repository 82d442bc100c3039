"""A chained step's greedy acceptance in one launch (`kernels.chain_accept`): its torch reference against a walk of
each chain, and the Triton kernel against the reference under the Triton interpreter here (a child process, see
tests/kernel_checks.py), on CUDA and inside a CUDA graph in the gpu tests."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.chain_accept import accept_chain_step, accept_chain_step_reference, accept_chain_step_triton
from tests.kernel_checks import captured, run_interpreted

SHAPES = ((5, 15, 16), (3, 1, 2), (8, 7, 16), (2, 4, 5))  # (sequences, drafts, the bucket's picks a row)


def case(batch: int, k: int, q: int, seed: int, device="cpu"):
    """Drafts, picks that follow them for a random stretch (every count from none to all among the rows), as a
    bucket's view, and an outcome view of a flat buffer holding a marker."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.randint(0, 50, (batch, k), generator=gen)
    bucket = torch.randint(50, 100, (batch + 2, q), generator=gen)  # (a bucket wider than the chains)
    for b in range(batch):
        keep = (b + seed) % (k + 1)
        bucket[b, :keep] = drafts[b, :keep]
    outcome = torch.full((batch * (k + 2),), -7, dtype=torch.int64)
    return drafts.to(device), bucket.to(device)[:batch], outcome.to(device).view(batch, k + 2)


@pytest.mark.parametrize("seed", range(2))
def test_the_reference_accepts_the_longest_matching_prefix(seed):
    for batch, k, q in SHAPES:
        drafts, picks, outcome = case(batch, k, q, seed)
        accepted, final = accept_chain_step_reference(drafts, picks, outcome)
        for b in range(batch):
            count = next((i for i in range(k) if drafts[b, i] != picks[b, i]), k)
            assert accepted[b].item() == count and final[b].item() == picks[b, count].item()
            assert outcome[b, :count + 1].tolist() == drafts[b, :count].tolist() + [picks[b, count].item()]
            assert outcome[b, k + 1].item() == count


def assert_matches_reference(step, seed: int, device="cpu") -> None:
    for shape in SHAPES:
        drafts, picks, outcome = case(*shape, seed, device)
        _, _, want_outcome = case(*shape, seed, device)
        got = step(drafts, picks, outcome)
        want = accept_chain_step_reference(drafts, picks, want_outcome)
        assert torch.equal(outcome, want_outcome), (shape, outcome, want_outcome)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), shape


def test_off_cuda_the_step_is_the_reference():
    assert_matches_reference(accept_chain_step, 0)


def check_triton_interpreted() -> None:
    """Run with TRITON_INTERPRET=1 set before triton is imported (test_triton_interpreted does)."""
    for seed in range(3):
        assert_matches_reference(accept_chain_step_triton, seed)
    print("interpreted chain accept ok")


@pytest.mark.slow  # (the default run stays under five minutes; CI runs the slow ones after it)
def test_triton_interpreted():
    run_interpreted(__file__, "chain accept ok")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_accepts_as_the_reference_on_cuda_and_in_a_graph():
    for seed in range(3):
        assert_matches_reference(accept_chain_step_triton, seed, "cuda")
    drafts, picks, outcome = case(8, 15, 16, 4, "cuda")
    graph, got = captured(lambda: accept_chain_step_triton(drafts, picks, outcome))
    other = case(8, 15, 16, 5, "cuda")
    drafts.copy_(other[0])
    picks.copy_(other[1])
    graph.replay()
    want_outcome = other[2].clone()
    want = accept_chain_step_reference(drafts, picks, want_outcome)
    assert torch.equal(outcome, want_outcome) and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


if __name__ == "__main__":
    check_triton_interpreted()
