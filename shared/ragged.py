"""Index arithmetic over ragged batches (host numpy), so a step's bookkeeping is a few array ops, not a
Python loop per sequence."""

from __future__ import annotations

import numpy as np


def ragged_arange(lengths: np.ndarray) -> np.ndarray:
    """0..lengths[0]-1, 0..lengths[1]-1, ... concatenated (int64)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    return np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64) - np.repeat(ends - lengths, lengths)
