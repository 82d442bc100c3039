"""target_service.drafter_client.RowStager: rows staged per sequence, written to the shared buffer at seal."""

import torch

from specsplit.shared.transport import BufferExporter
from specsplit.target_service.drafter_client import LinkStats, RowStager, _coalesce


def test_back_to_back_slices_of_one_tensor_become_one_copy():
    out = torch.randn(10, 4)
    merged = _coalesce([(0, out[0:3]), (3, out[3:4]), (4, out[4:9])])
    assert len(merged) == 1 and merged[0][0] == 0 and torch.equal(merged[0][1], out[0:9])


def test_gaps_other_tensors_and_strides_stay_separate():
    a, b = torch.randn(10, 4), torch.randn(10, 4)
    wide = torch.randn(10, 8)[:, :4]  # a row stride of 8: not mergeable with a
    cases = [
        [(0, a[0:3]), (4, a[3:5])],  # the destination skips a row
        [(0, a[0:3]), (3, a[4:6])],  # the source skips a row
        [(0, a[0:3]), (3, b[3:5])],  # another tensor
        [(0, wide[0:3]), (3, a[3:5])],
    ]
    for copies in cases:
        assert len(_coalesce(copies)) == 2


def test_sealed_buffer_holds_each_sequences_rows_where_referenced():
    exporter = BufferExporter()
    stager = RowStager(exporter, rows=32, cols=4, dtype=torch.float32, device=torch.device("cpu"), stats=LinkStats())
    out = torch.randn(12, 4)
    other = torch.randn(2, 4)
    staged = [(stager.put(out[0:5]), out[0:5]), (stager.put(out[5:6]), out[5:6]),
              (stager.put(other), other), (stager.put(out[6:12]), out[6:12])]
    stager.seal()
    for offset, rows in staged:
        assert torch.equal(stager.buffer.tensor[offset:offset + rows.shape[0]], rows)

