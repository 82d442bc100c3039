"""drafter_service.base.Rows: the per-sequence row store (DFlash context window, MTP caches)."""

import random

import torch

from specsplit.drafter_service.base import Rows

SCHEMA = {"x": ((3,), torch.float32), "pos": ((), torch.long)}


def _new(n: int, base: int) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(base, base + 3 * n, dtype=torch.float32).view(n, 3),
            "pos": torch.arange(base, base + n)}


def test_append_many_equals_appends_one_by_one():
    # Several stores, each appended to several times in one batch (so buffers grow and compact while
    # copies into them are pending), with and without a window: the same rows as plain appends.
    rng = random.Random(0)
    for limit in (None, 5, 9):
        batched = [Rows(SCHEMA, torch.device("cpu"), limit=limit) for _ in range(3)]
        plain = [Rows(SCHEMA, torch.device("cpu"), limit=limit) for _ in range(3)]
        base = 0
        for _ in range(40):
            items = []
            for _ in range(rng.randint(1, 5)):
                i, n = rng.randrange(3), rng.randint(1, 12)
                new = _new(n, base)
                base += 100
                items.append((batched[i], new))
                plain[i].append(**new)
            Rows.append_many(items)
            for b, p in zip(batched, plain):
                assert len(b) == len(p)
                assert torch.equal(b["x"], p["x"]) and torch.equal(b["pos"], p["pos"])


def test_window_keeps_the_newest_rows():
    rows = Rows(SCHEMA, torch.device("cpu"), limit=4)
    rows.append(**_new(3, 0))
    rows.append(**_new(3, 10))
    assert rows["pos"].tolist() == [2, 10, 11, 12]
    rows.append(**_new(6, 20))
    assert rows["pos"].tolist() == [22, 23, 24, 25]
