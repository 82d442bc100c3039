"""The row max kernel (the greedy pick) against torch.max: under Triton's CPU interpreter here (a child
process, as tests/test_paged_attention.py explains), on CUDA and inside a CUDA graph in the gpu tests.
Ties, NaN, all -inf rows and a vocabulary that is not a multiple of the kernel's block included."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.row_max import BLOCK, row_max, row_max_reference, row_max_triton
from specsplit.kernels.workspace import arrival_counters
from tests.kernel_checks import captured, run_interpreted

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def hard_rows(vocab: int, seed: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Random rows, then: a tie of the maximum in two splits, a tie inside one split, NaN twice, a row
    of -inf, a maximum in the last (partial) block, rows of one repeated value."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(9, vocab, generator=gen)
    x[1, 5] = x[1, vocab - 3] = 50.0  # a tie across splits: the first wins
    inside = BLOCK if vocab > BLOCK + 10 else 0
    x[2, inside + 7] = x[2, inside + 9] = 40.0  # a tie inside a split
    x[3, vocab - 2], x[3, 11] = float("nan"), float("nan")  # the first NaN wins
    x[4] = float("-inf")
    x[5, vocab - 1] = 99.0
    x[6] = 0.25
    x[7, min(BLOCK, vocab) - 1] = float("inf")
    return x.to(dtype=dtype, device=device)


def assert_same(got, expected) -> None:
    torch.testing.assert_close(got[0], expected[0].float(), equal_nan=True, atol=0, rtol=0)
    assert torch.equal(got[1], expected[1]), (got[1], expected[1])


def test_reference_is_torch_first_max():
    x = hard_rows(3 * BLOCK + 100, 0)
    values, indices = row_max_reference(x)
    assert indices[1] == 5 and indices[2] == BLOCK + 7 and indices[3] == 11 and indices[5] == 3 * BLOCK + 99
    assert torch.isnan(values[3]) and values[4] == float("-inf") and indices[6] == 0


def test_without_a_workspace_or_a_gpu_is_torch():
    x = hard_rows(BLOCK + 5, 1)
    assert_same(row_max(x, arrival_counters(16, "cpu")), row_max_reference(x))
    assert_same(row_max(x), row_max_reference(x))


def check_triton_interpreted() -> None:
    """Run with TRITON_INTERPRET=1 set before triton is imported (test_triton_interpreted does)."""
    workspace = arrival_counters(16, "cpu")
    for vocab, seed in ((3 * BLOCK + 100, 2), (BLOCK, 3), (77, 4)):
        x = hard_rows(vocab, seed)
        for _ in range(2):  # twice: the first call must leave the counters ready
            assert_same(row_max_triton(x, workspace), row_max_reference(x))
        assert not workspace.any(), "the arrival counters must be left zero"
    print("interpreted row max ok")


@pytest.mark.slow  # (the default run stays under five minutes; CI runs the slow ones after it)
def test_triton_interpreted():
    run_interpreted(__file__, "row max ok")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [49152, 151936, 1000])
def test_triton_matches_torch_cuda(vocab, dtype):
    workspace = arrival_counters(64, "cuda")
    x = hard_rows(vocab, 5, dtype, "cuda")
    wide = torch.randn(64, vocab, device="cuda").to(dtype)
    for _ in range(3):
        assert_same(row_max_triton(x, workspace), row_max_reference(x))
        assert_same(row_max_triton(wide, workspace), row_max_reference(wide))
    assert not workspace.any()


@pytest.mark.gpu
@gpu
def test_triton_in_cuda_graph():
    workspace = arrival_counters(16, "cuda")
    static = hard_rows(49152, 6, device="cuda")
    # the same counters twice, one call after the other in the graph
    graph, (got, again) = captured(lambda: (row_max_triton(static, workspace), row_max_triton(static[1:], workspace)))
    for seed in (7, 8, 9):
        fresh = hard_rows(49152, seed, device="cuda")[torch.randperm(9, generator=torch.Generator().manual_seed(seed))]
        static.copy_(fresh)
        graph.replay()
        assert_same(got, row_max_reference(fresh))
        assert_same(again, row_max_reference(fresh[1:]))
    assert not workspace.any()


if __name__ == "__main__":
    check_triton_interpreted()
