"""The DFlash context pool: the paged block forward equals the eager one and the reference from scratch
over a ragged life of sequences (windows sliding round their rings, carried KV moved, blocks reused),
and the pool refuses what it cannot hold without changing anything and gets every block back."""

from __future__ import annotations

import pytest
import torch

from specsplit.shared.errors import AlreadyExists, CapacityExceeded
from specsplit.shared.proposer import ProposeRequest
from tests.test_dflash import GAMMA, History, assert_confidence_close, assert_same, make, reference, snapshot, step


def check_batch(drafter, histories: dict[int, History], anchor: int = 7) -> None:
    """One propose of every sequence in `histories`, on the paged path and then the eager one (its
    context gathered out of the pool): the same drafts as the reference from scratch, and confidences
    within its rounding."""
    requests = [ProposeRequest(seq, anchor + seq, h.next_pos, GAMMA - 1, want_confidence=True)
                for seq, h in histories.items()]
    paged = drafter.propose(requests)
    graphs, drafter.propose_graphs = drafter.propose_graphs, None
    try:
        eager = drafter.propose(requests)
    finally:
        drafter.propose_graphs = graphs
    for request, got, plain in zip(requests, paged, eager):
        tokens, conf, scale = reference(drafter, histories[request.seq_id], request.last_token, GAMMA - 1,
                                        window=drafter.spec.window)
        assert got.tokens == plain.tokens == tokens
        assert_confidence_close(got.confidence, conf, scale)
        assert_confidence_close(plain.confidence, conf, scale)


def paged(window: int, **kw):
    drafter = make(window=window, **kw)
    drafter.use_static_forwards(use_graphs=False)
    assert drafter.propose_graphs is not None
    return drafter


def start(drafter, histories: dict[int, History], seq: int, budget: int, length: int) -> None:
    history = histories[seq] = History(drafter, 100 + seq)
    drafter.alloc(seq, budget)
    rows = history.fresh(length)
    drafter.prefill(seq, [1] * length, rows)
    history.add(rows, 0)


def steps(drafter, histories: dict[int, History], accepts: list[int]) -> None:
    with drafter.batched_appends():
        for seq, accept in zip(histories, accepts):
            step(drafter, seq, histories[seq], accept)


def test_paged_forward_equals_eager_and_reference_over_a_ragged_life():
    window = 12  # rings of 2 blocks; a budget of 10 gets 1
    drafter = paged(window, max_batch=4, pool_blocks=12)
    histories: dict[int, History] = {}
    for seq, budget, length in ((0, 200, 3), (1, 200, 30), (2, 10, 4), (3, 200, 0)):
        start(drafter, histories, seq, budget, length)
    check_batch(drafter, histories)
    assert len(drafter.store.get(2).ring) == 1

    # Carried KV installed where the window is wider than its ring holds: the rows move to a bigger ring.
    carried = drafter.take_kv(2)
    drafter.free(2)
    drafter.alloc(4, 200)
    drafter.install_kv(4, carried.handle)
    histories[4] = histories.pop(2)
    assert len(drafter.store.get(4).ring) == 2
    check_batch(drafter, histories)

    for i in range(14):
        steps(drafter, histories, [(i + seq) % GAMMA for seq in histories])
        if i == 2:  # a freed sequence's blocks, stale rows and all, go to the next one
            ring = drafter.store.get(0).ring
            drafter.free(0)
            del histories[0]
            start(drafter, histories, 5, 200, 7)
            assert sorted(drafter.store.get(5).ring) == sorted(ring)
        check_batch(drafter, histories)
    period = 2 * drafter.pool.block_size
    assert all(h.next_pos > period for h in histories.values())  # every window went round its ring


@pytest.mark.parametrize("window", [11, 12, 27])
def test_windows_slide_round_their_rings(window):
    """11 and 27: the ring holds exactly W + γ positions, so each propose reads every slot of it; a
    slot reused one position too early would show."""
    drafter = paged(window, max_batch=2)
    histories: dict[int, History] = {}
    start(drafter, histories, 0, 400, 5)
    start(drafter, histories, 1, 400, 40)
    period = len(drafter.store.get(0).ring) * drafter.pool.block_size
    assert period == -(-(window + GAMMA) // 16) * 16
    for i in range(24):
        check_batch(drafter, histories)
        steps(drafter, histories, [(3 * i) % GAMMA, (i + 2) % GAMMA])
    assert histories[0].next_pos > 2 * period


def test_an_exhausted_pool_refuses_and_changes_nothing():
    drafter = make(window=12, pool_blocks=4)  # two rings of 2 blocks
    for seq in (0, 1):
        drafter.alloc(seq, 100)
        drafter.prefill(seq, [1] * 3, torch.randn(3, drafter.spec.feature_dim))
    with pytest.raises(CapacityExceeded, match="context pool has 0 of 4 blocks free"):
        drafter.alloc(2, 100)
    assert 2 not in drafter.store and drafter.pool.num_free_blocks == 0
    drafter.stash(0, torch.randn(3, drafter.spec.feature_dim))
    before = snapshot(drafter, 0)
    with pytest.raises(CapacityExceeded):  # the fresh state that would replace it needs a ring
        drafter.take_kv(0)
    assert_same(snapshot(drafter, 0), before)
    assert drafter.store.num_carried == 0
    drafter.commit(0, 2, 3, [1, 2])  # the stash survived
    drafter.free(1)
    drafter.alloc(2, 100)


def test_every_block_comes_back():
    drafter = make(window=12, pool_blocks=10)
    full = drafter.pool.num_free_blocks
    width = drafter.spec.feature_dim
    drafter.alloc(0, 100)
    drafter.alloc(1, 8)
    drafter.prefill(0, [1] * 5, torch.randn(5, width))
    with pytest.raises(AlreadyExists):
        drafter.alloc(0, 100)
    into_smaller = drafter.take_kv(0)  # a ring of 2 installed where 1 would do: kept
    drafter.install_kv(1, into_smaller.handle)
    freed = drafter.take_kv(1)
    drafter.free_kv(freed.handle)
    drafter.prefill(1, [1] * 4, torch.randn(4, width))
    drafter.free(1)
    drafter.alloc(2, 6)
    drafter.prefill(2, [1] * 3, torch.randn(3, width))
    into_bigger = drafter.take_kv(2)  # a ring of 1 installed where 2 are needed: moved
    drafter.install_kv(0, into_bigger.handle)
    for seq in (0, 2):
        drafter.free(seq)
    assert drafter.pool.num_free_blocks == full and drafter.store.num_carried == 0


def test_sliding_layers_take_the_paged_path_when_their_window_fits():
    """A sliding layer masks causally at each query's own position; one wider than the ctx window
    would see rows that slid out of it, so that drafter proposes eagerly."""
    drafter = paged(12, layer_types=("sliding_attention", "full_attention"), sliding_window=6)
    histories: dict[int, History] = {}
    start(drafter, histories, 0, 200, 9)
    start(drafter, histories, 1, 200, 30)
    for i in range(10):
        check_batch(drafter, histories)
        steps(drafter, histories, [i % GAMMA, (i + 3) % GAMMA])
    wide = make(window=12, layer_types=("sliding_attention", "full_attention"), sliding_window=14)
    wide.use_static_forwards(use_graphs=False)
    assert wide.propose_graphs is None and wide.context_graphs is not None


def test_a_sequence_freed_inside_a_batched_block_takes_its_rows_with_it():
    drafter = make(window=12)
    histories: dict[int, History] = {}
    start(drafter, histories, 0, 100, 4)
    start(drafter, histories, 1, 100, 4)
    with drafter.batched_appends():
        step(drafter, 0, histories[0], 2)
        step(drafter, 1, histories[1], 3)
        drafter.free(0)
    del histories[0]
    check_batch(drafter, histories)
