"""Pools zeroed lazily on the CPU: zero, writable, and resident only where written."""

from __future__ import annotations

import pytest
import torch

from specsplit.drafter_service.context_pool import ContextPool
from specsplit.shared.memory import zeroed
from specsplit.target_service.kv_cache import PagedKVCache


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_zeroed_is_zero_and_writable(dtype):
    pool = zeroed((3, 5, 7), dtype=dtype, device="cpu")
    assert pool.shape == (3, 5, 7) and pool.dtype == dtype and pool.is_contiguous()
    assert not pool.any()
    pool[1, 2] = 1
    assert pool.sum().item() == 7 and pool[1, 2].all() and not pool[0].any()


def test_an_untouched_pool_holds_no_memory_and_a_touched_block_only_its_pages():
    before = _rss_mib()
    pool = zeroed((8, 64, 256, 1024), dtype=torch.float32, device="cpu")  # 512 MiB
    assert _rss_mib() - before < 32
    pool[0, :4] = 1.0  # 4 MiB written
    assert _rss_mib() - before < 40
    del pool


def test_kv_and_context_pools_start_zero_without_committing_their_size():
    before = _rss_mib()
    cache = PagedKVCache(num_layers=16, num_kv_heads=4, head_dim=64, num_blocks=4096)  # 2 x 256 MiB
    context = ContextPool(2048, layers=8, kv_heads=4, head_dim=64, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert _rss_mib() - before < 64
    assert not cache.k_pool[:, -1].any() and not cache.v_pool[:, :1].any()
    assert not context.k[:, context.scratch].any() and not context.v[:, :1].any()
