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


def test_put_into_fills_a_static_buffer_and_checks_its_shape():
    staging = HostStaging("cpu")
    dst = torch.full((2, 3), -1, dtype=torch.int64)
    address = dst.data_ptr()
    staging.put_into(dst, [[1, 2, 3], [4, 5, 6]])
    assert dst.tolist() == [[1, 2, 3], [4, 5, 6]] and dst.data_ptr() == address
    with pytest.raises(ValueError):
        staging.put_into(dst, [1, 2, 3])
    with pytest.raises(ValueError):
        staging.put_into(dst.to(torch.int32), [[1, 2, 3], [4, 5, 6]])


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


@pytest.mark.gpu
@CUDA
def test_put_into_and_to_host_reuse_their_buffers_safely():
    staging = HostStaging("cuda", words=16)
    dst = torch.zeros(2, 4, dtype=torch.int64, device="cuda")
    for i in range(50):  # the ring wraps; the landing buffer is reused and grows
        torch.cuda._sleep(20_000)
        staging.put_into(dst, [[i] * 4, [i + 1] * 4])
        wide = torch.arange(i * 100, dtype=torch.float16, device="cuda")
        rows, flags, half = to_host(dst[:, 1:], dst[0] > i - 1, wide[::2])  # a strided view too
        assert rows == [[i] * 3, [i + 1] * 3] and flags == [True] * 4 and half == wide[::2].tolist()
