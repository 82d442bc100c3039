"""The one-launch top-k log-probabilities (`kernels.top_k`, a draft tree's candidates) against log_softmax and topk:
under Triton's CPU interpreter here (a child process, see tests/kernel_checks.py), on CUDA and inside a CUDA graph
in the gpu tests. Ties, a vocabulary that is not a multiple of the kernel's block, and K past a block's width."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.top_k import BLOCK, scored, top_k_logp, top_k_logp_reference, top_k_logp_triton
from specsplit.kernels.workspace import arrival_counters
from tests.kernel_checks import captured, run_interpreted


def rows(vocab: int, seed: int, count: int = 6, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Random rows, then: a tie of the best across two blocks, the best in the last (partial) block, a row whose
    K best all lie in one block."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(count, vocab, generator=gen) * 4
    x[1, 3] = x[1, vocab - 2] = 60.0
    x[2, vocab - 1] = 70.0
    x[3, :16] = torch.arange(50.0, 66.0)
    return x.to(dtype=dtype, device=device)


def assert_same(got, want, x) -> None:
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    # columns: the same values in the same order (ties may take either column), and the first among ties here
    torch.testing.assert_close(x.float().gather(1, got[1]), x.float().gather(1, want[1]), atol=0, rtol=0)
    assert got[1][1, :2].tolist() == [3, x.shape[1] - 2]


def test_off_cuda_it_is_the_reference():
    x = rows(BLOCK + 77, 0)
    got = top_k_logp(x, 8, arrival_counters(8, "cpu"))
    want = top_k_logp_reference(x, 8)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def score_params(block_rows: int, device="cpu") -> torch.Tensor:
    """Tree scores' (a, b, c) for a block of rows, a slice of a wider fit's (its row stride not its width)."""
    gen = torch.Generator().manual_seed(9)
    fit = torch.stack([torch.randn(block_rows + 4, generator=gen), 1.5 + torch.rand(block_rows + 4, generator=gen),
                       torch.randn(block_rows + 4, generator=gen) * 0.3])
    return fit.to(device)[:, :block_rows]


def assert_scored(top_k, device="cpu", dtype=torch.float32) -> None:
    """With scores, each kept value is its log-probability's score at its row's place in its block (the columns
    unchanged), as `scored` makes them: the tree scores' math (`drafter_service.tree_scores`)."""
    x = rows(BLOCK + 300, 7, 12, dtype, device)  # (four blocks of three rows)
    params = score_params(3, device)
    got = top_k(x, 5, params)
    logp, index = top_k_logp_reference(x, 5)
    want = scored(logp.view(4, 3, 5), params).view(12, 5)
    torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.float().gather(1, got[1]), x.float().gather(1, index), atol=0, rtol=0)
    assert bool((got[0] < 0).all()) and not torch.allclose(got[0], logp)


def test_scored_candidates_off_cuda_and_their_checks():
    assert_scored(lambda x, k, params: top_k_logp(x, k, arrival_counters(12, "cpu"), params))
    from specsplit.drafter_service.tree_scores import TreeScores

    fit = TreeScores((0.5, -0.2), (2.0, 1.5), (0.1, 0.3))
    logp = torch.log_softmax(torch.randn(3, 2, 6), -1).sort(-1, descending=True).values
    assert torch.equal(fit.apply(logp), scored(logp, fit.on("cpu")))  # (one math for both)
    with pytest.raises(ValueError):
        top_k_logp(rows(300, 0, 6), 4, None, score_params(4))  # (6 rows are no whole blocks of 4)


def check_triton_interpreted() -> None:
    """Run with TRITON_INTERPRET=1 set before triton is imported (test_triton_interpreted does)."""
    workspace = arrival_counters(8, "cpu")
    for vocab, k, seed in ((2 * BLOCK + 100, 8, 1), (BLOCK, 3, 2), (300, 16, 3)):
        x = rows(vocab, seed)
        for _ in range(2):  # twice: the first call must leave the counters ready
            assert_same(top_k_logp_triton(x, k, workspace), top_k_logp_reference(x, k), x)
        assert not workspace.any(), "the arrival counters must be left zero"
    assert_scored(lambda x, k, params: top_k_logp_triton(x, k, arrival_counters(12, "cpu"), params))
    print("interpreted top k ok")


@pytest.mark.slow  # (the default run stays under five minutes; CI runs the slow ones after it)
def test_triton_interpreted():
    run_interpreted(__file__, "top k ok")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_the_reference_on_cuda_and_in_a_graph(dtype):
    workspace = arrival_counters(256, "cuda")
    for vocab, k in ((49152, 8), (151936, 4), (1000, 16)):
        x = rows(vocab, 4, 240, dtype, "cuda")
        for _ in range(2):
            assert_same(top_k_logp_triton(x, k, workspace), top_k_logp_reference(x, k), x)
    x = rows(49152, 5, 16, dtype, "cuda")
    graph, got = captured(lambda: top_k_logp_triton(x, 8, workspace))
    x.copy_(rows(49152, 6, 16, dtype, "cuda"))
    graph.replay()
    assert_same(got, top_k_logp_reference(x, 8), x)
    assert not workspace.any()
    assert_scored(lambda x, k, params: top_k_logp_triton(x, k, workspace, params), "cuda", dtype)
    assert_scored(lambda x, k, params: top_k_logp(x, k, workspace, params), "cuda", dtype)  # (as switched)


if __name__ == "__main__":
    check_triton_interpreted()
