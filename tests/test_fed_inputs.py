"""A fed verify's inputs in one launch (`kernels.fed_inputs`): its torch reference against what each input means,
and the Triton kernel against the reference under the Triton interpreter here (a child process, see
tests/kernel_checks.py), on CUDA and inside a CUDA graph in the gpu tests."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.fed_inputs import write_fed_inputs, write_fed_inputs_reference, write_fed_inputs_triton
from tests.kernel_checks import captured, run_interpreted

BLOCK = 4
SCRATCH = 3
CASES = ((3, 5, 16, 16, False), (3, 5, 16, 9, False), (1, 1, 1, 1, False), (2, 4, 8, 8, True), (4, 4, 16, 16, True),
         (1, 8, 3, 3, True))  # (fed sequences, bucket rows, queries a row, tokens a sequence, tree)


def case(batch: int, rows: int, q: int, n: int, tree: bool, seed: int, device="cpu"):
    """Inputs, and a bucket's buffers holding junk (the same junk for every call of one seed)."""
    gen = torch.Generator().manual_seed(seed)
    width = 12
    tokens = torch.randint(0, 1000, (batch, n + 2), generator=gen)[:, :n]  # (a row stride wider than n)
    starts = torch.randint(0, width * BLOCK - q, (batch,), generator=gen)
    tables = torch.stack([torch.randperm(50, generator=gen)[:width] for _ in range(rows)]).int()
    token_ids, slots = (torch.randint(-9, 9, (rows * q,), generator=gen) for _ in range(2))
    positions = torch.randint(0, 40, (rows, q), generator=gen)
    extra = None
    if tree:
        rotary, words = (torch.randint(0, 99, (batch, q + 1), generator=gen)[:, :q] for _ in range(2))
        extra = (rotary, words, torch.randint(-9, 9, (rows, q), generator=gen), torch.randint(-9, 9, (rows, q),
                                                                                             generator=gen))
    move = (lambda t: t.to(device))
    return (move(tokens), move(starts), move(tables), BLOCK, SCRATCH, move(token_ids), move(positions), move(slots),
            None if extra is None else tuple(map(move, extra)))


@pytest.mark.parametrize("seed", range(2))
def test_the_reference_writes_what_each_input_means(seed):
    for batch, rows, q, n, tree in CASES:
        tokens, starts, tables, _, _, token_ids, positions, slots, extra = args = case(batch, rows, q, n, tree, seed)
        pad_positions = positions[batch:].clone()
        junk_ids = token_ids.view(rows, q).clone()
        write_fed_inputs_reference(*args)
        for b in range(batch):
            for j in range(q):
                at = starts[b].item() + min(j, n - 1)
                assert positions[b, j].item() == at
                slot = tables[b, at // BLOCK].item() * BLOCK + at % BLOCK if j < n else SCRATCH
                assert slots[b * q + j].item() == slot
                assert token_ids[b * q + j].item() == (tokens[b, j].item() if j < n else junk_ids[b, j].item())
        assert torch.equal(positions[batch:], pad_positions)  # (padding rows: the host's)
        if tree:
            rotary, words, rotary_out, words_out = extra
            assert torch.equal(rotary_out[:batch], rotary) and torch.equal(words_out[:batch], words)
            assert torch.equal(rotary_out[batch:], pad_positions) and bool((words_out[batch:] == -1).all())


def assert_matches_reference(write, seed: int, device="cpu") -> None:
    for shape in CASES:
        got, want = case(*shape, seed, device), case(*shape, seed, device)
        write(*got)
        write_fed_inputs_reference(*want)
        for name, a, b in zip(("token_ids", "positions", "slots"), got[5:8], want[5:8]):
            assert torch.equal(a, b), (shape, name, a, b)
        if shape[-1]:
            assert torch.equal(got[8][2], want[8][2]) and torch.equal(got[8][3], want[8][3]), shape


def test_off_cuda_the_write_is_the_reference():
    assert_matches_reference(write_fed_inputs, 0)


def assert_past_the_table_writes_scratch(write, device="cpu") -> None:
    """Positions past a sequence's table (which the engine never feeds: the reference fails there) write the
    scratch slot, not a row of another sequence's block."""
    tokens, starts, tables, _, _, token_ids, positions, slots, _ = args = case(2, 2, 8, 8, False, 3, device)
    starts.copy_(torch.tensor([tables.shape[1] * BLOCK - 3, 0]))  # (sequence 0's last five tokens past its table)
    write(*args)
    assert slots[:8].tolist()[3:] == [SCRATCH] * 5 and SCRATCH not in slots[:3].tolist()


def check_triton_interpreted() -> None:
    """Run with TRITON_INTERPRET=1 set before triton is imported (test_triton_interpreted does)."""
    for seed in range(2):
        assert_matches_reference(write_fed_inputs_triton, seed)
    assert_past_the_table_writes_scratch(write_fed_inputs_triton)
    print("interpreted fed inputs ok")


@pytest.mark.slow  # (the default run stays under five minutes; CI runs the slow ones after it)
def test_triton_interpreted():
    run_interpreted(__file__, "fed inputs ok")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_writes_as_the_reference_on_cuda_and_in_a_graph():
    for seed in range(3):
        assert_matches_reference(write_fed_inputs_triton, seed, "cuda")
    assert_past_the_table_writes_scratch(write_fed_inputs_triton, "cuda")
    args = case(2, 4, 8, 8, True, 7, "cuda")  # (two padding rows)
    graph, _ = captured(lambda: write_fed_inputs_triton(*args))
    other = case(2, 4, 8, 8, True, 8, "cuda")
    for into, values in zip((*args[:3], *args[8][:2]), (*other[:3], *other[8][:2])):
        into.copy_(values)
    before = [t.clone() for t in (*args[5:8], *args[8][2:])]
    graph.replay()
    want = (*other[:5], *before[:3], (*other[8][:2], *before[3:]))
    write_fed_inputs_reference(*want)
    for got, expected in zip((*args[5:8], *args[8][2:]), (*want[5:8], *want[8][2:])):
        assert torch.equal(got, expected)


if __name__ == "__main__":
    check_triton_interpreted()
