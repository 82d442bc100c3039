"""drafter_service.session: within a Step the drafter borrows the target's rows until its batched block ends,
so the one wait for its reads comes after that block, before anything is released or answered, whatever
failed (review finding: a step without proposes answered while the block's reads were still queued)."""

from __future__ import annotations

import itertools

import pytest
import torch

from specsplit.drafter_service.session import Session
from specsplit.shared import wire
from specsplit.shared.transport import encode_inline
from tests.test_drafter_server import make_drafter


@pytest.fixture
def session(monkeypatch):
    drafter = make_drafter()
    ids = itertools.count()
    made = Session(drafter, client_id="c", new_seq_id=lambda: next(ids), head=None, device=torch.device("cpu"))
    events: list[str] = []
    batch = drafter.append_rows_batch
    monkeypatch.setattr(drafter, "append_rows_batch", lambda appends: (events.append("read rows"), batch(appends)))
    monkeypatch.setattr(made, "_finish_reads", lambda: events.append("wait"))
    made.events = events
    width = drafter.spec.feature_dim
    for seq in (0, 1):
        made.alloc(seq, 64)
        made.prefill(seq, wire.RowsOp((1, 2, 3), encode_inline(torch.randn(3, width)), 0))
    events.clear()
    return made


def verify_step(session: Session, seqs=(0, 1), proposes=()) -> wire.StepBatch:
    width = session.proposer.spec.feature_dim
    steps = tuple(wire.SeqStep(s, stash=encode_inline(torch.randn(4, width)), commit=wire.CommitOp(2, 3, (5, 6)),
                               trim=1) for s in seqs)
    return wire.StepBatch(1, steps, tuple(proposes))


def test_a_step_without_proposes_waits_once_after_the_block_has_read_the_rows(session):
    result = session.step(verify_step(session))
    assert not result.errors
    assert session.events == ["read rows", "wait"]


def test_a_step_whose_sequence_fails_still_waits_after_the_block(session):
    bad = verify_step(session, seqs=(0, 7))  # sequence 7 was never allocated
    result = session.step(bad)
    assert [e.seq_id for e in result.errors] == [7]
    assert session.events == ["read rows", "wait"]


def test_a_unary_stash_waits_at_once(session):
    width = session.proposer.spec.feature_dim
    session.apply(wire.SeqStep(0, stash=encode_inline(torch.randn(4, width))))
    assert session.events == ["wait"]


def test_a_step_with_proposes_waits_once_after_them(session, monkeypatch):
    """The proposes are queued behind the block's reads and read their drafts back, so the one wait
    comes after them: the GPU goes from the context forward to the propose without a host wait."""
    session._default_head = session.proposer.head  # the drafter's own head: no buffers to register here
    propose = session.proposer.propose
    monkeypatch.setattr(session.proposer, "propose", lambda requests: (session.events.append("propose"), propose(requests))[1])
    result = session.step(verify_step(session, proposes=(wire.ProposeRequest(0, 7, 5, 2),)))
    assert not result.errors and len(result.proposals[0].tokens) == 2
    assert session.events == ["read rows", "propose", "wait"]


def test_a_step_whose_block_fails_still_waits(session, monkeypatch):
    def broken(appends):
        session.events.append("read rows")
        raise RuntimeError("the context forward failed")

    monkeypatch.setattr(session.proposer, "append_rows_batch", broken)
    with pytest.raises(RuntimeError):
        session.step(verify_step(session, proposes=(wire.ProposeRequest(0, 7, 5, 2),)))
    assert session.events == ["read rows", "wait"]
