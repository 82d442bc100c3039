"""shared.staging: host ints to the device through a pinned ring, and one-wait readback."""

import pytest
import torch

from specsplit.shared.staging import HostStaging, to_host

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_put_keeps_values_and_shape_on_cpu():
    staging = HostStaging("cpu")
    assert staging.put([3, 1, 2]).tolist() == [3, 1, 2]
    rows = staging.put([[1, 2], [3, 4], [5, 6]])
    assert rows.shape == (3, 2) and rows.dtype == torch.int64 and rows.tolist() == [[1, 2], [3, 4], [5, 6]]
    assert staging.put([]).numel() == 0


def test_to_host_reads_several_tensors():
    ids, logp = torch.tensor([[1, 2]]), torch.tensor([[-0.5, -1.0]])
    assert to_host(ids, logp) == [[[1, 2]], [[-0.5, -1.0]]]


@pytest.mark.gpu
@CUDA
def test_ring_wraps_without_overwriting_pending_copies():
    # A 16-word ring wraps every few puts; a kernel queued ahead keeps the copies pending, so a span
    # rewritten too early would show up as a wrong value.
    staging = HostStaging("cuda", words=16)
    out = []
    for i in range(200):
        torch.cuda._sleep(20_000)  # keep the stream busy: the copies below stay queued
        out.append((list(range(i, i + 5)), staging.put(list(range(i, i + 5)))))
    torch.cuda.synchronize()
    assert all(t.tolist() == want for want, t in out)
    big = list(range(40))  # larger than the ring: a plain copy
    assert staging.put(big).tolist() == big


@pytest.mark.gpu
@CUDA
def test_to_host_on_the_gpu():
    a = torch.arange(6, device="cuda").view(2, 3)
    b = torch.full((2,), 0.25, device="cuda")
    assert to_host(a, b) == [[[0, 1, 2], [3, 4, 5]], [0.25, 0.25]]
