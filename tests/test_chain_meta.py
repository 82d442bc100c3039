"""The drafter's chained inputs in one launch each (`kernels.chain_meta`): the torch references against what each
input means, and the Triton kernel against them under the Triton interpreter here (a child process, see
tests/kernel_checks.py), on CUDA and inside a CUDA graph in the gpu tests."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.chain_meta import (_launch, commit_meta, commit_meta_reference, propose_meta,
                                          propose_meta_reference)
from tests.kernel_checks import captured, run_interpreted

BLOCK = 4
SCRATCH = 11
WINDOW = 24


def ring_case(batch: int, rows: int, count: int, seed: int, device="cpu"):
    """Sequences with rings of 2..5 blocks (tables repeating their ring), positions past a window or not, and a
    meta [3 or 2, rows] holding junk."""
    gen = torch.Generator().manual_seed(seed)
    width = 12
    rings = [torch.randperm(40, generator=gen)[:int(torch.randint(2, 6, (), generator=gen))] for _ in range(batch)]
    stacked = torch.stack([ring.repeat(width)[:width] for ring in rings]).int()
    periods = torch.tensor([len(ring) * BLOCK for ring in rings])
    positions = torch.randint(0, 90, (batch,), generator=gen)
    anchors = torch.randint(0, 1000, (batch,), generator=gen)
    junk = torch.randint(-9, 9, (3, rows), generator=gen)
    return tuple(t.to(device) for t in (anchors, positions, stacked, periods, junk)) + (rings,)


CASES = ((1, 1, 1), (3, 8, 2), (4, 64, 16), (2, 40, 16), (5, 16, 3))  # (sequences, bucket columns, rows each)


@pytest.mark.parametrize("seed", range(2))
def test_the_references_write_what_each_input_means(seed):
    for batch, rows, count in CASES:
        anchors, positions, stacked, periods, junk, rings = ring_case(batch, max(rows, batch * count), count, seed)
        meta = junk.clone()
        propose_meta_reference(anchors, positions, WINDOW, periods, meta)
        for b in range(batch):
            first = max(positions[b].item() - WINDOW, 0)
            assert meta[:, b].tolist() == [anchors[b].item(), positions[b].item(),
                                           first - first % periods[b].item()]
        assert not meta[:, batch:].any()
        meta = junk[:2].clone()
        commit_meta_reference(positions, count, stacked, periods, BLOCK, SCRATCH, meta)
        for b in range(batch):
            for c in range(count):
                at = positions[b].item() + c
                block = rings[b][(at // BLOCK) % len(rings[b])].item()
                assert meta[:, b * count + c].tolist() == [at, block * BLOCK + at % BLOCK]
        assert not meta[0, batch * count:].any() and bool((meta[1, batch * count:] == SCRATCH).all())


def assert_matches_references(propose, commit, seed: int, device="cpu") -> None:
    for batch, rows, count in CASES:
        anchors, positions, stacked, periods, junk, _ = ring_case(batch, max(rows, batch * count), count, seed,
                                                                  device)
        got, want = junk.clone(), junk.clone()
        propose(anchors, positions, WINDOW, periods, got)
        propose_meta_reference(anchors, positions, WINDOW, periods, want)
        assert torch.equal(got, want), (batch, rows, got, want)
        got, want = junk[:2].clone(), junk[:2].clone()
        commit(positions, count, stacked, periods, BLOCK, SCRATCH, got)
        commit_meta_reference(positions, count, stacked, periods, BLOCK, SCRATCH, want)
        assert torch.equal(got, want), (batch, rows, count, got, want)


def test_off_cuda_the_writes_are_the_references():
    assert_matches_references(propose_meta, commit_meta, 0)


def triton_propose(anchors, positions, window, periods, meta):
    _launch(meta, anchors, positions, periods, window=window)


def triton_commit(positions, count, stacked, periods, block_size, scratch_slot, meta):
    _launch(meta, positions, positions, periods, count=count, stacked=stacked, block_size=block_size,
            scratch_slot=scratch_slot)


def check_triton_interpreted() -> None:
    """Run with TRITON_INTERPRET=1 set before triton is imported (test_triton_interpreted does)."""
    for seed in range(2):
        assert_matches_references(triton_propose, triton_commit, seed)
    print("interpreted chain meta ok")


@pytest.mark.slow  # (the default run stays under five minutes; CI runs the slow ones after it)
def test_triton_interpreted():
    run_interpreted(__file__, "chain meta ok")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_writes_as_the_references_on_cuda_and_in_a_graph():
    for seed in range(3):
        assert_matches_references(triton_propose, triton_commit, seed, "cuda")
    anchors, positions, stacked, periods, junk, _ = ring_case(4, 64, 16, 5, "cuda")
    meta = junk[:2].clone()
    graph, _ = captured(lambda: triton_commit(positions, 16, stacked, periods, BLOCK, SCRATCH, meta))
    other = ring_case(4, 64, 16, 6, "cuda")
    for into, values in zip((positions, stacked, periods), (other[1], other[2], other[3])):
        into.copy_(values)
    graph.replay()
    want = junk[:2].clone()
    commit_meta_reference(positions, 16, stacked, periods, BLOCK, SCRATCH, want)
    assert torch.equal(meta, want)


if __name__ == "__main__":
    check_triton_interpreted()
