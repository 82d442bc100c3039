"""Cache rows moved in one launch (`kernels.kv_move`): the torch reference against a row-by-row copy, and the
Triton kernel against the reference under the Triton interpreter here (a child process, see
tests/kernel_checks.py), on CUDA and inside a CUDA graph in the gpu tests."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.kv_move import move_rows, move_rows_reference, move_rows_triton
from tests.kernel_checks import captured, run_interpreted

SHAPES = ((2, 6, 4, 3, 64), (3, 5, 16, 2, 8), (1, 6, 4, 1, 80))  # (layers, blocks, block size, kv heads, head dim)


def pools(shape, seed: int, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(2))


def moves(rows: int, seed: int, device="cpu"):
    """A tree step's moves, a sequence's path at a time (groups of 7): each row to an earlier one that may be
    another's source, then scratch to scratch pairs (the nodes off the path)."""
    gen = torch.Generator().manual_seed(seed)
    scratch = rows - 1
    src, dst = [], []
    for start in (0, 9):
        taken = sorted(torch.randperm(7, generator=gen)[:4].tolist())  # (path nodes' verify rows, in order)
        for depth, node in enumerate(taken):
            src.append(start + 1 + node)
            dst.append(start + 1 + depth)  # (at or before its source: a later source may be written first)
        src += [scratch] * 3
        dst += [scratch] * 3
    return torch.tensor(src, device=device), torch.tensor(dst, device=device)


def test_the_reference_moves_each_row_as_read_before_any_write():
    for shape in SHAPES:
        k, v = pools(shape, 0)
        want_k, want_v = k.clone(), v.clone()
        src, dst = moves(shape[1] * shape[2], 1)
        move_rows_reference(k, v, src, dst)
        for want in (want_k, want_v):
            flat = want.view(shape[0], -1, *shape[3:])
            before = flat.clone()
            for s, d in zip(src.tolist(), dst.tolist()):
                flat[:, d] = before[:, s]
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
        assert not torch.equal(k, pools(shape, 0)[0])  # (something moved)


def assert_matches_reference(move, seed: int, device="cpu", dtype=torch.float32) -> None:
    for shape in SHAPES:
        for group in (None, 7):  # (all in one program's reads, or a sequence's path a program)
            got, want = pools(shape, seed, device, dtype), pools(shape, seed, device, dtype)
            src, dst = moves(shape[1] * shape[2], seed + 1, device)
            move(*got, src, dst, group)
            move_rows_reference(*want, src, dst)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (shape, group)


def test_groups_must_divide_the_moves():
    k, v = pools(SHAPES[0], 0)
    src, dst = moves(24, 1)
    for group in (0, 5):
        with pytest.raises(ValueError):
            move_rows(k, v, src, dst, group)


def test_off_cuda_the_move_is_the_reference():
    assert_matches_reference(move_rows, 0)


def check_triton_interpreted() -> None:
    """Run with TRITON_INTERPRET=1 set before triton is imported (test_triton_interpreted does)."""
    for seed in range(2):
        assert_matches_reference(move_rows_triton, seed)
    print("interpreted kv move ok")


@pytest.mark.slow  # (the default run stays under five minutes; CI runs the slow ones after it)
def test_triton_interpreted():
    run_interpreted(__file__, "kv move ok")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_moves_as_the_reference_on_cuda_and_in_a_graph():
    for seed in range(3):
        assert_matches_reference(move_rows_triton, seed, "cuda", torch.bfloat16)
    shape = (30, 40, 16, 3, 64)
    k, v = pools(shape, 4, "cuda", torch.bfloat16)
    src, dst = moves(40 * 16, 5, "cuda")
    graph, _ = captured(lambda: move_rows_triton(k, v, src, dst), warm_up=lambda: None)
    want = [t.clone() for t in (k, v)]
    other = moves(40 * 16, 6, "cuda")
    src.copy_(other[0])
    dst.copy_(other[1])
    graph.replay()
    move_rows_reference(*want, *other)
    assert torch.equal(k, want[0]) and torch.equal(v, want[1])


if __name__ == "__main__":
    check_triton_interpreted()
