"""shared.ragged: the index arithmetic a step's host bookkeeping is built from."""

from __future__ import annotations

import numpy as np

from specsplit.shared.ragged import ragged_arange


def test_ragged_arange_counts_up_within_each_length():
    assert ragged_arange(np.array([2, 0, 3, 1])).tolist() == [0, 1, 0, 1, 2, 0]
    assert ragged_arange(np.array([], dtype=np.int64)).tolist() == []
    lengths = np.random.default_rng(0).integers(0, 9, size=50)
    assert ragged_arange(lengths).tolist() == [i for n in lengths for i in range(n)]
