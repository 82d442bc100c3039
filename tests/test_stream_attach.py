"""A sequence attached on the Step stream (DrafterDescription.step_attach, SeqStep.alloc_budget_tokens): its
allocation and its prompt's rows ride the next Step instead of a PrefillDrafter call; a refusal is that
sequence's alone, the drafter then holding nothing of it; and the engine's tokens are target-only's."""

from __future__ import annotations

import pytest

from specsplit.shared import wire
from specsplit.shared.errors import CapacityExceeded, DrafterUnavailable, InvalidRequest, StateConflict
from specsplit.shared.proposer import ProposeRequest
from specsplit.shared.transport import RowBuffer
from tests.test_drafter_server import (BUDGET, GAMMA, alloc_prefill, env, make_drafter, rows, same,  # noqa: F401
                                       serve_remote)


@pytest.fixture(autouse=True)
def rows_referenced_once_recorded(monkeypatch):
    """Every buffer as strict as a CUDA one: its rows referenced only once the generation's writes are recorded
    (an attach's rows referenced before their Step sealed the bulk buffer failed on the GPU alone)."""
    bump = RowBuffer.bump

    def strict_bump(self):
        generation = bump(self)
        self._recorded = False
        return generation

    monkeypatch.setattr(RowBuffer, "bump", strict_bump)


def test_an_attach_on_the_stream_rides_the_next_step_and_leaves_what_a_prefill_leaves(serve_remote):
    """Queued, nothing reaches the drafter; the next Step carries it, its answer tells the target, and the
    drafter holds what alloc + prefill would have left: the same drafts as a drafter called directly."""
    drafter, twin = make_drafter(), make_drafter()
    _, proposer = serve_remote(drafter, max_batch=4)
    assert proposer._conn.step_attach
    prompts = {0: [3, 4, 5], 1: [6, 7, 8, 9]}
    for seq_id, prompt in prompts.items():
        assert proposer.attach_on_stream(seq_id, BUDGET, prompt, rows(len(prompt), seq_id))
        twin.alloc(seq_id, BUDGET)
        twin.prefill(seq_id, prompt, rows(len(prompt), seq_id), 0)
    assert not drafter.store and proposer.attach_outcome(0, read=True) is None  # (queued: read alone sends nothing)
    with pytest.raises(StateConflict):  # one attach a sequence
        proposer.attach_on_stream(0, BUDGET, [3], rows(1, 0))
    proposer.send_pending()  # a Step sent ahead carries both
    assert proposer.attach_outcome(1, read=False) is None and proposer._unanswered
    assert proposer.attach_outcome(1) is True  # (read: the answer to that Step)
    assert proposer.attach_outcome(0, read=False) is True
    with pytest.raises(StateConflict):  # taken once
        proposer.attach_outcome(0)
    assert sorted(drafter.store) == [0, 1] and not proposer.link.unary_calls
    asked = [ProposeRequest(0, 7, 3, GAMMA - 1), ProposeRequest(1, 7, 4, GAMMA - 1)]
    same(proposer.propose(asked), twin.propose(asked), twin)


def test_a_refused_attach_is_its_sequences_alone_and_a_free_in_its_step_makes_room(serve_remote):
    """Two attaches in one Step with room for one: the second is refused (CapacityExceeded, the drafter holding
    nothing of it), the connection goes on. A free queued before an attach goes first in their Step."""
    drafter = make_drafter()
    _, proposer = serve_remote(drafter, limits={"max_sequences": 1}, max_batch=4)
    assert proposer.attach_on_stream(0, BUDGET, [3, 4, 5], rows(3, 0))
    assert proposer.attach_on_stream(1, BUDGET, [3, 4], rows(2, 1))
    assert proposer.attach_outcome(0, wait=True) is True  # (sent now: a Step of their own)
    with pytest.raises(CapacityExceeded):
        proposer.attach_outcome(1)
    assert list(drafter.store) == [0] and proposer.available()
    proposer.free(0)  # queued...
    assert proposer.attach_on_stream(2, BUDGET, [5, 6], rows(2, 2))  # ... and this attach goes after it
    assert proposer.attach_outcome(2, wait=True) is True
    assert len(drafter.store) == 1 and proposer.available() and not proposer.link.unary_calls
    assert len(proposer.propose([ProposeRequest(2, 7, 2, GAMMA - 1)])[0].tokens) == GAMMA - 1


def test_a_sequence_freed_while_its_attach_is_queued_or_out_is_left_with_nothing_on_the_drafter(serve_remote):
    drafter = make_drafter()
    _, proposer = serve_remote(drafter, max_batch=4)
    assert proposer.attach_on_stream(0, BUDGET, [3, 4], rows(2, 0))
    proposer.free(0)  # never sent
    proposer.flush()
    assert not drafter.store and not proposer._pending
    with pytest.raises(StateConflict):
        proposer.attach_outcome(0)
    assert proposer.attach_on_stream(1, BUDGET, [3, 4], rows(2, 1))
    proposer.send_pending()
    proposer.free(1)  # its attach in a Step still out: that answer first, then the free rides the next Step
    proposer.flush()
    assert not drafter.store and proposer.available()


def test_a_drafter_without_step_attach_is_attached_by_prefill(serve_remote):
    drafter = make_drafter()
    _, proposer = serve_remote(drafter, max_batch=4)
    proposer._conn.step_attach = False  # (as an older drafter describes itself)
    assert not proposer.attach_on_stream(0, BUDGET, [3, 4], rows(2, 0))
    assert not proposer._pending and not drafter.store


def test_a_bulk_buffer_too_small_for_a_steps_attaches_leaves_the_rest_to_prefill(serve_remote):
    drafter = make_drafter()
    _, proposer = serve_remote(drafter, max_batch=4)
    room = proposer._conn.bulk.buffer.tensor.shape[0]
    assert proposer.attach_on_stream(0, room + 8, [3] * (room - 1), rows(room - 1, 0))
    assert not proposer.attach_on_stream(1, BUDGET, [3, 4], rows(2, 1))  # (its rows would not fit this Step's)
    assert proposer.attach_outcome(0, wait=True) is True


def test_hostile_attaches_on_the_stream_are_refused_one_sequence_at_a_time_and_leave_nothing(env):
    """A SeqStep allocating a sequence the connection holds (ALREADY_EXISTS), with a budget below 1
    (INVALID_ARGUMENT as parsed), or with a catch-up the drafter refuses after the allocation (FAILED_PRECONDITION:
    rows not from position 0 of a fresh sequence; then freed): each refused alone, the others applied, the
    stream goes on, and the drafter holds only what was applied."""
    client, twin = env.client("target-a"), env.twin
    alloc_prefill(client, twin, 0, [20, 21, 22], seed=0)
    client.open()
    good = rows(3, 5)
    step = wire.step_to_proto(wire.StepBatch(1, seqs=[
        wire.SeqStep(0, catchup=wire.RowsOp((1, 2), client.shm(rows(2, 1)), 0), alloc=BUDGET),  # held already
        wire.SeqStep(2, catchup=wire.RowsOp((1, 2), client.shm(rows(2, 2)), 4), alloc=BUDGET),  # not from 0
        wire.SeqStep(3, catchup=wire.RowsOp((7, 8, 9), client.shm(good), 0), alloc=BUDGET),
    ]))
    zero = step.seqs.add(seq_id=4)
    zero.alloc_budget_tokens = 0
    client.outbox.put(step)
    result = wire.step_result_from_proto(next(client.responses))
    codes = {e.seq_id: e.code for e in result.errors}
    assert codes == {0: "ALREADY_EXISTS", 2: "FAILED_PRECONDITION", 4: "INVALID_ARGUMENT"}, codes
    assert len(env.drafter.store) == 2  # sequences 0 (as it was) and 3 (the refused one's allocation freed)
    twin.alloc(3, BUDGET)
    twin.prefill(3, [7, 8, 9], good, 0)
    asked = [ProposeRequest(0, 4, 3, GAMMA - 1), ProposeRequest(3, 6, 3, GAMMA - 1)]
    result = client.step(wire.StepBatch(2, proposes=asked))
    assert not result.errors
    same(list(result.proposals.values()), twin.propose(asked), twin)
    client.close_stream()


def test_a_seq_step_allocating_carries_its_budget_both_ways():
    step = wire.SeqStep(7, alloc=12)
    pb = wire.seq_step_to_proto(step)
    assert pb.HasField("alloc_budget_tokens") and wire.seq_step_from_proto(pb) == step
    assert not wire.seq_step_to_proto(wire.SeqStep(7)).HasField("alloc_budget_tokens")
    with pytest.raises(InvalidRequest):
        wire.SeqStep(7, alloc=0)
    spec = make_drafter().spec
    for offered in (False, True):
        pb = wire.description_to_proto(wire.DrafterDescription(spec, step_attach=offered))
        assert pb.step_attach == offered and wire.description_from_proto(pb).step_attach == offered


@pytest.mark.parametrize("max_sequences", [None, 3], ids=["room", "one-refused"])
def test_requests_attached_on_the_stream_decode_as_target_only_with_no_call_of_their_own(tiny_chat_dir, tmp_path,
                                                                                          max_sequences):
    """Six requests through four slots, arriving as others end, chained through the drafter service: each
    attach rides a Step (no PrefillDrafter), the sequence joining the chained step after the one whose
    propose, sent ahead, asked for it too; the target's host waits for a Step answer only to connect, for the
    first requests' attaches (nothing else to run), at the first chained step and for the last free. With
    room for three sequences at the drafter, the fourth is refused: it decodes without speculation, the
    others speculate on. Tokens are target-only's either way."""
    from specsplit.drafter_service.server import DrafterServer, serve
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.drafter_client import RemoteProposer
    from specsplit.target_service.sequence import Request
    from tests.test_chain import _drafter_pair
    from tests.test_remote_chain import PROMPTS, _engine

    target, (_, remote) = _drafter_pair(tiny_chat_dir)
    limits = {} if max_sequences is None else {"max_sequences": max_sequences}
    server_obj = DrafterServer(remote, head=remote.head, device="cpu", **limits)
    address = f"unix:{tmp_path}/d.sock"
    server = serve(server_obj, [address])
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    lengths = (20, 30, 40, 50, 25, 35)

    def requests():
        return [Request(f"r{i}", tokenizer.encode(PROMPTS[i % len(PROMPTS)]), SamplingParams(max_tokens=n, ignore_eos=True))
                for i, n in enumerate(lengths)]

    proposer = RemoteProposer(address, max_batch=4)
    try:
        alone = _engine(target, None, chain=False).generate(requests())
        engine = _engine(target, proposer, stream_attach=True)
        got = engine.generate(requests())
        assert {r: [t for e in got[r] for t in e.token_ids] for r in got} \
            == {r: [t for e in alone[r] for t in e.token_ids] for r in alone}
        assert not proposer.link.unary_calls and engine.counters.fallbacks == 0 and engine.counters.chained > 20
        assert engine.counters.refusals == (0 if max_sequences is None else 1)
        if max_sequences is None:
            waited = len(proposer.link.step_seconds)
            assert waited <= 4, f"{waited} Step answers waited for in {engine.counters.steps} steps"
            assert proposer.link.chain_taken_regrouped >= len(lengths) - 4
        assert not engine._attaching and not proposer._attaches
    finally:
        proposer.close()
        server.stop(None).wait()
        server_obj.close()
    assert server_obj.num_sessions == 0


def test_a_prefill_after_queued_attaches_sends_them_first_so_its_retry_finds_its_rows(serve_remote):
    """A sequence attached by PrefillDrafter (its rows too many for this Step's share of the bulk buffer) while
    another's attach is queued, and refused for room until the queued frees go: the queued attach goes first, in
    a Step of its own, so the flush before the prefill's retry stages nothing over the prefill's rows."""
    drafter = make_drafter()
    _, proposer = serve_remote(drafter, limits={"max_sequences": 2}, max_batch=4)
    for s in (0, 1):
        proposer.alloc(s, BUDGET)
        proposer.prefill(s, [3, 4, 5], rows(3, s), 0)
    proposer.free(0)
    proposer.free(1)  # both queued: room for two once sent
    assert proposer.attach_on_stream(2, BUDGET, [3, 4], rows(2, 2))
    proposer.alloc(3, BUDGET)  # left for its prefill, which allocates it
    assert proposer.prefill(3, [6, 7, 8], rows(3, 3), 0) == 3
    assert proposer.attach_outcome(2) is True and len(drafter.store) == 2
    asked = [ProposeRequest(2, 7, 2, GAMMA - 1), ProposeRequest(3, 7, 3, GAMMA - 1)]
    assert [len(p.tokens) for p in proposer.propose(asked)] == [GAMMA - 1] * 2


def test_another_sequences_failure_in_the_attachs_step_drops_the_drafter_not_the_attach(serve_remote):
    """The Step that carries an attach fails for another sequence (a state mismatch: the connection drops): the
    attach's outcome is the drafter's unavailability, not a refusal of the attaching sequence."""
    drafter = make_drafter()
    _, proposer = serve_remote(drafter, max_batch=4)
    proposer.alloc(5, BUDGET)
    proposer.prefill(5, [3, 4, 5], rows(3, 5), 0)
    proposer.catchup(5, [7], rows(1, 9), 10)  # not where sequence 5 is: the drafter refuses it
    assert proposer.attach_on_stream(6, BUDGET, [3, 4], rows(2, 6))
    with pytest.raises(DrafterUnavailable, match="carrying sequence 6"):
        proposer.attach_outcome(6, wait=True)
    assert proposer._conn is None


def test_a_verb_queued_for_an_attaching_sequence_sends_the_attach_first(serve_remote):
    drafter, twin = make_drafter(), make_drafter()
    _, proposer = serve_remote(drafter, max_batch=4)
    assert proposer.attach_on_stream(0, BUDGET, [3, 4, 5], rows(3, 0))
    steps = proposer._step_id
    proposer.catchup(0, [6], rows(1, 7), 3)  # (the engine sends none before the attach is answered: all the same)
    assert proposer._step_id == steps + 1 and proposer.attach_outcome(0) is True
    proposer.flush()
    twin.alloc(0, BUDGET)
    twin.prefill(0, [3, 4, 5], rows(3, 0), 0)
    twin.catchup(0, [6], rows(1, 7), 3)
    asked = [ProposeRequest(0, 8, 4, GAMMA - 1)]
    same(proposer.propose(asked), twin.propose(asked), twin)


@pytest.mark.parametrize("step_socket", [False, True], ids=["grpc", "step-socket"])
def test_a_drafter_ending_the_stream_of_a_step_out_with_an_attach_is_unavailable_not_a_refusal(
        serve_remote, monkeypatch, step_socket):
    """The Step sent ahead that carries an attach ends the stream (a status for the whole Step): the attach's
    outcome is the drafter's unavailability, over gRPC (whose stream's end carries that status) as over the step
    socket, never a refusal of the attaching sequence."""
    import time

    from specsplit.drafter_service.server import DrafterServer

    step_once = DrafterServer._step_once

    def failing(self, session, stream, request):
        if any(s.HasField("alloc_budget_tokens") for s in request.seqs):
            raise StateConflict("a refusal of the whole Step")
        return step_once(self, session, stream, request)

    monkeypatch.setattr(DrafterServer, "_step_once", failing)
    _, proposer = serve_remote(make_drafter(), max_batch=4, step_socket=step_socket)
    assert proposer.attach_on_stream(1, BUDGET, [3, 4], rows(2, 1))
    proposer.send_pending()
    time.sleep(0.3)  # (the stream's end arrives before the answer is read, as an engine's step of work allows)
    with pytest.raises(DrafterUnavailable):
        proposer.attach_outcome(1)
    assert proposer._conn is None
