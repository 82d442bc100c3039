"""Protobuf ↔ domain conversion: round trips, and malformed protobuf input raises InvalidRequest."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from specsplit.protos.v1 import common_pb2, drafter_pb2, target_pb2
from specsplit.shared import wire
from specsplit.shared.errors import (
    AlreadyExists,
    CapacityExceeded,
    DrafterUnavailable,
    InvalidRequest,
    StateConflict,
    UnknownSequence,
)
from specsplit.shared.proposer import CarriedKV, DrafterKind, DrafterSpec, FeatureKind, Proposal, ProposeRequest, bool_to_bitmask
from specsplit.shared.sampling import SamplingParams
from specsplit.shared.transport import BufferDescriptor, BufferKind, BufferRole, RowRef, encode_inline
from specsplit.shared.wire import (
    CommitOp,
    GenerateCall,
    GenerateChunk,
    GenerationStats,
    RowsOp,
    SeqError,
    SeqStep,
    StepBatch,
    StepResult,
)

REF = RowRef(buffer_id=3, row_offset=5, rows=2, generation=9)
INLINE = encode_inline(torch.arange(6, dtype=torch.float32).view(2, 3))


def wire_trip(value, to_proto, from_proto, message_type):
    """Through bytes too, so what is compared is what a peer would parse."""
    data = to_proto(value).SerializeToString()
    return from_proto(message_type.FromString(data))


# --- rows, buffers, bitmasks --------------------------------------------------------------------


@pytest.mark.parametrize("source", [REF, INLINE])
def test_rows_round_trip(source):
    assert wire_trip(source, wire.rows_to_proto, wire.rows_from_proto, common_pb2.RowRef) == source


@pytest.mark.parametrize(
    "pb",
    [
        common_pb2.RowRef(buffer_id=0, rows=1),
        common_pb2.RowRef(buffer_id=1, row_offset=-1, rows=1),
        common_pb2.RowRef(buffer_id=1, rows=0),
        common_pb2.RowRef(buffer_id=1, rows=1, generation=-2),
        common_pb2.RowRef(inline=common_pb2.InlineRows(data=b"\0" * 4, dtype=common_pb2.DTYPE_FLOAT32, rows=1, cols=2)),
        common_pb2.RowRef(inline=common_pb2.InlineRows(data=b"\0" * 4, rows=1, cols=1)),  # dtype unset
    ],
)
def test_malformed_rows_are_refused(pb):
    with pytest.raises(InvalidRequest):
        wire.rows_from_proto(pb)


def test_descriptor_round_trip():
    shm = BufferDescriptor(4, BufferKind.SHM, "specsplit-1-0123456789abcdef", torch.bfloat16, 100, 64, "host")
    cuda = BufferDescriptor(
        5,
        BufferKind.CUDA_IPC,
        "specsplit-1-fedcba9876543210",
        torch.float16,
        7,
        3,
        "host",
        device_uuid="GPU-1",
        mem_handle=bytes(range(64)),
        event_handle=bytes(64),
        role=BufferRole.TARGET_LM_HEAD,
    )
    for d in (shm, cuda):
        assert wire_trip(d, wire.descriptor_to_proto, wire.descriptor_from_proto, common_pb2.BufferDescriptor) == d
    unset_kind = wire.descriptor_to_proto(shm)
    unset_kind.kind = common_pb2.BUFFER_KIND_UNSPECIFIED
    with pytest.raises(InvalidRequest, match="buffer kind"):
        wire.descriptor_from_proto(unset_kind)


def test_bitmask_round_trip_keeps_the_sign_bit():
    allowed = torch.zeros(100, dtype=torch.bool)
    allowed[[0, 31, 63, 99]] = True  # bit 31 makes a word negative
    words = bool_to_bitmask(allowed)
    back = wire_trip(words, wire.bitmask_to_proto, wire.bitmask_from_proto, common_pb2.Bitmask)
    assert back.dtype == torch.int32 and torch.equal(back, words)
    assert len(wire.bitmask_to_proto(words).words) == 4 * words.numel()
    for bad in (b"", b"\0" * 5):
        with pytest.raises(InvalidRequest):
            wire.bitmask_from_proto(common_pb2.Bitmask(words=bad))
    with pytest.raises(InvalidRequest):
        wire.bitmask_to_proto(words.to(torch.int64))


# --- sampling -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(
            max_tokens=7,
            temperature=0.7,
            top_k=40,
            top_p=0.9,
            seed=2**64 - 1,
            stop_token_ids=(2, 5),
            stop_strings=("\n\n", "END"),
            ignore_eos=True,
        ),
        SamplingParams(seed=0),
    ],
)
def test_sampling_round_trip(params):
    assert wire_trip(params, wire.sampling_to_proto, wire.sampling_from_proto, common_pb2.SamplingParams) == params


def test_sampling_unset_fields_take_defaults_and_bad_values_are_refused():
    assert wire.sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    for bad in (
        dict(temperature=-1.0),
        dict(top_k=-3),
        dict(top_p=1.5),
        dict(max_tokens=-1),
        dict(stop_token_ids=[-4]),
    ):
        with pytest.raises(InvalidRequest):
            wire.sampling_from_proto(common_pb2.SamplingParams(**bad))


# --- drafter description, carried KV ------------------------------------------------------------


def test_description_round_trip():
    spec = DrafterSpec(
        DrafterKind.DFLASH,
        FeatureKind.LAYER_CONCAT,
        feature_dim=3 * 64,
        hidden_size=64,
        vocab_size=1000,
        max_drafts=15,
        block_size=16,
        target_layer_ids=(1, 9, 17),
        max_batch=8,
        window=2048,
    )
    description = wire.DrafterDescription(spec, host_id="h", device_uuid="GPU-x", needs_target_head=True,
                                          step_columns=True, drafts_buffer=True)
    back = wire_trip(
        description, wire.description_to_proto, wire.description_from_proto, drafter_pb2.DrafterDescription
    )
    assert back == description
    mtp = wire.DrafterDescription(DrafterSpec(DrafterKind.MTP, FeatureKind.LAST_HIDDEN, 64, 64, 1000, 1))
    assert wire_trip(mtp, wire.description_to_proto, wire.description_from_proto, drafter_pb2.DrafterDescription) == mtp


@pytest.mark.parametrize(
    "field, value",
    [
        ("kind", 0),
        ("feature", 0),
        ("feature_dim", 0),
        ("vocab_size", -1),
        ("block_size", -1),
        ("max_drafts", 0),
        ("window", -1),  # 0 is valid: no window (MTP keeps every row)
    ],
)
def test_bad_description_is_refused(field, value):
    pb = wire.description_to_proto(
        wire.DrafterDescription(DrafterSpec(DrafterKind.MTP, FeatureKind.LAST_HIDDEN, 64, 64, 1000, 1))
    )
    setattr(pb, field, value)
    with pytest.raises(InvalidRequest):
        wire.description_from_proto(pb)


def test_carried_kv_round_trip():
    for kv in (CarriedKV(3, 120, 119), CarriedKV(4, 0, -1)):
        assert wire_trip(kv, wire.carried_kv_to_proto, wire.carried_kv_from_proto, drafter_pb2.CarriedKV) == kv
    with pytest.raises(InvalidRequest):
        wire.carried_kv_from_proto(drafter_pb2.CarriedKV(handle=1, rows=-1))


# --- propose ------------------------------------------------------------------------------------


def same_requests(a: ProposeRequest, b: ProposeRequest) -> bool:
    masks = (a.bitmask is None and b.bitmask is None) or torch.equal(a.bitmask, b.bitmask)
    return masks and (a.seq_id, a.last_token, a.position, a.num_drafts, a.want_confidence) == (
        b.seq_id,
        b.last_token,
        b.position,
        b.num_drafts,
        b.want_confidence,
    )


def test_propose_round_trip():
    requests = [
        ProposeRequest(seq_id=1, last_token=42, position=17, num_drafts=3),
        ProposeRequest(
            seq_id=2,
            last_token=0,
            position=0,
            num_drafts=1,
            want_confidence=True,
            bitmask=torch.tensor([-1, 5, 0, 2**31 - 1], dtype=torch.int32),
        ),
    ]
    back = wire_trip(requests, wire.propose_to_proto, wire.propose_from_proto, drafter_pb2.ProposeRequest)
    assert len(back) == 2 and all(same_requests(a, b) for a, b in zip(requests, back, strict=True))


@pytest.mark.parametrize("field, value", [("num_drafts", 0), ("seq_id", -1), ("last_token", -5), ("position", -1)])
def test_bad_propose_items_are_refused(field, value):
    pb = wire.propose_item_to_proto(ProposeRequest(seq_id=1, last_token=4, position=3, num_drafts=2))
    setattr(pb, field, value)
    with pytest.raises(InvalidRequest):
        wire.propose_item_from_proto(pb)


def test_proposals_round_trip():
    requests = [ProposeRequest(7, 1, 1, 2), ProposeRequest(8, 1, 1, 3)]
    probs = torch.softmax(torch.randn(3, 11), dim=-1)
    proposals = [Proposal([4, 5]), Proposal([6, 7, 8], confidence=[-0.25, -1.5, -3.0], probs=probs)]
    back = wire_trip(
        proposals,
        lambda p: wire.proposals_to_proto(requests, p),
        wire.proposals_from_proto,
        drafter_pb2.ProposeResponse,
    )
    assert back[0] == Proposal([4, 5])
    assert back[1].tokens == [6, 7, 8] and back[1].confidence == [-0.25, -1.5, -3.0]
    torch.testing.assert_close(back[1].probs, probs, rtol=0, atol=0)
    with pytest.raises(ValueError):  # one proposal per request
        wire.proposals_to_proto(requests[:1], proposals)


def test_bad_proposals_are_refused():
    with pytest.raises(InvalidRequest):
        wire.proposal_from_proto(drafter_pb2.Proposal(seq_id=1, tokens=[1, 2], confidence=[0.0]))
    with pytest.raises(InvalidRequest):
        wire.proposal_from_proto(drafter_pb2.Proposal(seq_id=1, tokens=[1, -2]))
    pb = drafter_pb2.Proposal(seq_id=1, tokens=[1, 2])
    pb.probs.CopyFrom(wire.inline_to_proto(encode_inline(torch.zeros(3, 4))))
    with pytest.raises(InvalidRequest, match="probs"):
        wire.proposal_from_proto(pb)


# --- step ---------------------------------------------------------------------------------------


def full_batch() -> StepBatch:
    descriptor = BufferDescriptor(3, BufferKind.SHM, "specsplit-1-0123456789abcdef", torch.float32, 64, 3, "host")
    return StepBatch(
        step_id=12,
        seqs=(
            SeqStep(1, stash=REF, commit=CommitOp(2, 40, (11, 12)), trim=1),
            SeqStep(
                2, catchup=RowsOp((5, 6), INLINE, 30), stash=RowRef(3, 0, 1, 9), commit=CommitOp(1, 32, (7,)), trim=0
            ),
            SeqStep(3, free=True),
        ),
        proposes=(ProposeRequest(1, 12, 42, 3), ProposeRequest(2, 7, 33, 3, want_confidence=True)),
        register=(descriptor,),
        release=(1, 2),
    )


def test_step_request_round_trip():
    batch = full_batch()
    data = wire.step_to_proto(batch).SerializeToString()
    back, errors = wire.step_from_proto(drafter_pb2.StepRequest.FromString(data))
    assert errors == []
    assert back.seqs == batch.seqs and back.register == batch.register and back.release == batch.release
    assert back.step_id == 12 and all(same_requests(a, b) for a, b in zip(batch.proposes, back.proposes, strict=True))
    assert back.seqs[2].trim is None and back.seqs[1].trim == 0  # trim 0 is not "no trim"


def column_batch() -> StepBatch:
    """Sequences 1, 4 and 5 fit the columns; 2 (a catch-up), 3 (a free), 6 (another generation) and the
    propose asking for confidence do not."""
    return dataclasses.replace(
        full_batch(),
        seqs=full_batch().seqs + (SeqStep(4, stash=RowRef(REF.buffer_id, 9, 3, REF.generation),
                                          commit=CommitOp(3, 7, (1, 2, 3)), trim=2),
                                  SeqStep(5, stash=RowRef(REF.buffer_id, 12, 1, REF.generation),
                                          commit=CommitOp(1, 0, (0,)), trim=0),
                                  SeqStep(6, stash=RowRef(REF.buffer_id, 0, 1, REF.generation + 1),
                                          commit=CommitOp(1, 5, (4,)), trim=0)),
        proposes=full_batch().proposes + (ProposeRequest(4, 3, 10, 2),),
        draft_columns=True,
    )


def test_step_request_columns_round_trip():
    batch = column_batch()
    pb = wire.step_to_proto(batch, columns=True)
    assert list(pb.verified.seq_ids) == [1, 4, 5] and [s.seq_id for s in pb.seqs] == [2, 3, 6]
    assert list(pb.propose_columns.seq_ids) == [1, 4] and [p.seq_id for p in pb.proposes] == [2]
    back, errors = wire.step_from_proto(drafter_pb2.StepRequest.FromString(pb.SerializeToString()))
    assert errors == [] and back.draft_columns
    assert back.verified.seq_ids == [1, 4, 5]  # checked as columns, no SeqStep each
    both = list(back.seqs) + back.verified.seq_steps()
    assert sorted(both, key=lambda s: s.seq_id) == sorted(batch.seqs, key=lambda s: s.seq_id)
    by_id = {p.seq_id: p for p in back.proposes}
    assert all(same_requests(p, by_id[p.seq_id]) for p in batch.proposes) and len(by_id) == len(batch.proposes)


def test_malformed_column_entries_drop_their_sequences():
    pb = wire.step_to_proto(column_batch(), columns=True)
    pb.verified.row_offsets[1] = -1  # sequence 4: a bad row reference
    pb.verified.token_ids[-1] = -7  # sequence 5: a negative token id
    pb.propose_columns.num_drafts[0] = 0  # sequence 1: a bad propose; its operations go too
    pb.seqs.add(seq_id=4)  # sequence 4 also as a SeqStep
    batch, errors = wire.step_from_proto(pb)
    assert {e.seq_id for e in errors} == {1, 4, 5} and all(e.code == "INVALID_ARGUMENT" for e in errors)
    assert {s.seq_id for s in batch.seqs} == {2, 3, 6} and [p.seq_id for p in batch.proposes] == [2]


def test_a_bad_propose_drops_its_verified_columns_entry_and_only_that():
    pb = wire.step_to_proto(column_batch(), columns=True)
    pb.propose_columns.num_drafts[0] = 0  # sequence 1's propose: its verified entry goes too
    batch, errors = wire.step_from_proto(pb)
    assert [e.seq_id for e in errors] == [1]
    assert batch.verified is None  # the entries went one by one
    assert {s.seq_id for s in batch.seqs} == {2, 3, 4, 5, 6}
    untouched, _ = wire.step_from_proto(wire.step_to_proto(column_batch(), columns=True))
    assert untouched.verified.seq_ids == [1, 4, 5] and {s.seq_id for s in untouched.seqs} == {2, 3, 6}


def test_a_propose_both_as_an_item_and_in_the_columns_is_refused_for_that_sequence_alone():
    pb = wire.step_to_proto(column_batch(), columns=True)
    pb.proposes.add(seq_id=4, last_token=1, position=2, num_drafts=1)  # 4 is in the columns too
    batch, errors = wire.step_from_proto(pb)
    assert [(e.seq_id, e.code) for e in errors] == [(4, "INVALID_ARGUMENT")]
    assert sorted(p.seq_id for p in batch.proposes) == [1, 2]
    assert 4 not in batch.verified.seq_ids if batch.verified else all(s.seq_id != 4 for s in batch.seqs)


@pytest.mark.parametrize("break_columns", [
    lambda pb: pb.verified.num_accepted.append(1),  # one column longer than the others
    lambda pb: pb.verified.token_ids.append(1),  # tokens that no commit counts
    lambda pb: pb.propose_columns.positions.pop(),
])
def test_columns_of_unequal_lengths_fail_the_step(break_columns):
    pb = wire.step_to_proto(column_batch(), columns=True)
    break_columns(pb)
    with pytest.raises(InvalidRequest):
        wire.step_from_proto(pb)


def test_step_result_columns_round_trip():
    result = StepResult(3, {1: Proposal([3, 4, 5]), 2: Proposal([9], confidence=[-0.5]), 7: Proposal([])},
                        (SeqError.from_exception(4, UnknownSequence("no sequence 4")),))
    pb = wire.step_result_to_proto(result, columns=True)
    assert list(pb.drafts.seq_ids) == [1, 7] and [p.seq_id for p in pb.proposals] == [2]
    assert wire.step_result_from_proto(drafter_pb2.StepResponse.FromString(pb.SerializeToString())) == result
    pb.drafts.tokens.append(1)
    with pytest.raises(InvalidRequest, match="draft tokens"):
        wire.step_result_from_proto(pb)
    pb = wire.step_result_to_proto(result, columns=True)
    pb.drafts.tokens[0] = -1
    with pytest.raises(InvalidRequest, match="negative"):
        wire.step_result_from_proto(pb)
    pb = wire.step_result_to_proto(result, columns=True)
    pb.proposals.add(seq_id=1, tokens=[1])
    with pytest.raises(InvalidRequest, match="twice"):
        wire.step_result_from_proto(pb)


def test_a_malformed_sequence_is_dropped_from_the_step_with_an_error():
    pb = wire.step_to_proto(full_batch())
    pb.seqs[0].commit.num_rows = -2  # sequence 1: bad commit; its propose must go too
    pb.proposes[1].num_drafts = 0  # sequence 2: bad propose; its operations must go too
    pb.seqs.add(seq_id=3)  # sequence 3 twice
    batch, errors = wire.step_from_proto(pb)
    assert {e.seq_id for e in errors} == {1, 2, 3} and all(e.code == "INVALID_ARGUMENT" for e in errors)
    assert batch.seqs == () and batch.proposes == ()
    assert len(batch.register) == 1  # connection-level fields still apply


def test_malformed_connection_fields_fail_the_step():
    pb = wire.step_to_proto(full_batch())
    pb.register_buffers[0].rows = 0
    with pytest.raises(InvalidRequest):
        wire.step_from_proto(pb)
    pb = wire.step_to_proto(full_batch())
    pb.release_buffers.append(-1)
    with pytest.raises(InvalidRequest):
        wire.step_from_proto(pb)


@pytest.mark.parametrize(
    "build",
    [
        lambda: CommitOp(0, 0, ()),
        lambda: CommitOp(2, 0, (1,)),
        lambda: CommitOp(1, -1, (1,)),
        lambda: CommitOp(1, 0, (-1,)),
        lambda: RowsOp((), INLINE, 0),
        lambda: RowsOp((1, 2, 3), INLINE, 0),  # INLINE holds 2 rows
        lambda: SeqStep(-1),
        lambda: SeqStep(1, trim=-1),
        lambda: StepBatch(-1),
        lambda: StepBatch(1, seqs=(SeqStep(1), SeqStep(1))),
        lambda: StepBatch(1, proposes=(ProposeRequest(1, 1, 1, 1), ProposeRequest(1, 1, 1, 1))),
        lambda: SeqError(1, "OK", ""),
        lambda: SeqError(1, "BOGUS", ""),
    ],
)
def test_domain_step_pieces_validate(build):
    with pytest.raises(InvalidRequest):
        build()


def test_step_result_round_trip_and_errors_map_back():
    result = StepResult(
        12,
        {1: Proposal([3, 4, 5]), 2: Proposal([9], confidence=[-0.5])},
        (
            SeqError.from_exception(4, UnknownSequence("no sequence 4")),
            SeqError.from_exception(5, StateConflict("position gap")),
            SeqError.from_exception(6, RuntimeError("boom")),
        ),
    )
    data = wire.step_result_to_proto(result).SerializeToString()
    pb = drafter_pb2.StepResponse.FromString(data)
    assert [e.code for e in pb.errors] == [
        grpc.StatusCode.NOT_FOUND.value[0],
        grpc.StatusCode.FAILED_PRECONDITION.value[0],
        grpc.StatusCode.INTERNAL.value[0],
    ]
    back = wire.step_result_from_proto(pb)
    assert back == result
    assert [type(e.exception()) for e in back.errors] == [UnknownSequence, StateConflict, DrafterUnavailable]
    assert "no sequence 4" in str(back.errors[0].exception())
    pb.proposals.add(seq_id=1, tokens=[1])
    with pytest.raises(InvalidRequest, match="twice"):
        wire.step_result_from_proto(pb)


def test_every_domain_error_code_maps_back_to_its_class():
    for error in (InvalidRequest, UnknownSequence, StateConflict, AlreadyExists, CapacityExceeded, DrafterUnavailable):
        assert isinstance(SeqError.from_exception(1, error("x")).exception(), error)


def test_unary_requests_become_one_sequence_steps():
    cases = [
        (wire.stash_to_proto(4, REF), SeqStep(4, stash=REF)),
        (wire.commit_to_proto(4, CommitOp(2, 10, (1, 2))), SeqStep(4, commit=CommitOp(2, 10, (1, 2)))),
        (wire.trim_to_proto(4, 0), SeqStep(4, trim=0)),
        (wire.catchup_to_proto(4, RowsOp((1, 2), INLINE, 8)), SeqStep(4, catchup=RowsOp((1, 2), INLINE, 8))),
        (drafter_pb2.FreeStateRequest(seq_id=4), SeqStep(4, free=True)),
    ]
    for pb, step in cases:
        assert wire.unary_to_seq_step(type(pb).FromString(pb.SerializeToString())) == step
    with pytest.raises(InvalidRequest, match="missing"):
        wire.unary_to_seq_step(drafter_pb2.StashRequest(seq_id=4))
    with pytest.raises(InvalidRequest):
        wire.unary_to_seq_step(drafter_pb2.TrimRequest(seq_id=4, num_accepted=-1))
    with pytest.raises(InvalidRequest):
        wire.unary_to_seq_step(drafter_pb2.AllocStateRequest(seq_id=4))


def test_alloc_and_prefill_round_trip():
    assert wire.alloc_from_proto(wire.alloc_to_proto(3, 500)) == (3, 500)
    for seq_id, budget in ((3, 0), (-1, 10)):
        with pytest.raises(InvalidRequest):
            wire.alloc_from_proto(wire.alloc_to_proto(seq_id, budget))
    op = RowsOp((1, 2), REF, 0)
    assert wire.prefill_from_proto(wire.prefill_to_proto(9, op)) == (9, op, None)
    assert wire.prefill_from_proto(wire.prefill_to_proto(9, op, 40)) == (9, op, 40)
    for budget in (0, -3):  # a budget asked for at all must be one
        with pytest.raises(InvalidRequest):
            wire.prefill_from_proto(wire.prefill_to_proto(9, op, budget))
    with pytest.raises(InvalidRequest):
        wire.prefill_from_proto(drafter_pb2.PrefillDrafterRequest(seq_id=9, token_ids=[1]))


# --- target service -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        GenerateCall("Hello", chat=True, request_id="r1"),
        GenerateCall((1, 2, 3), SamplingParams(max_tokens=9, temperature=1.0, seed=3), speculative=False),
    ],
)
def test_generate_request_round_trip(call):
    assert wire_trip(call, wire.generate_to_proto, wire.generate_from_proto, target_pb2.GenerateRequest) == call


def test_generate_request_defaults_and_validation():
    call = wire.generate_from_proto(target_pb2.GenerateRequest(text="hi"))
    assert call.speculative is True and call.sampling == SamplingParams()
    for pb in (
        target_pb2.GenerateRequest(),
        target_pb2.GenerateRequest(text=""),
        target_pb2.GenerateRequest(token_ids=target_pb2.TokenIds(ids=[])),
        target_pb2.GenerateRequest(token_ids=target_pb2.TokenIds(ids=[1, -1])),
        target_pb2.GenerateRequest(token_ids=target_pb2.TokenIds(ids=[1]), chat=True),
    ):
        with pytest.raises(InvalidRequest):
            wire.generate_from_proto(pb)


def test_generate_chunks_round_trip():
    stats = GenerationStats(steps=5, drafted=20, accepted=11, tau=3.2, prompt_tokens=7, generated_tokens=16)
    for chunk in (
        GenerateChunk((1, 2), "ab"),
        GenerateChunk((), "", "eos", stats),
        GenerateChunk((3,), "c", "cancelled"),
    ):
        assert wire_trip(chunk, wire.chunk_to_proto, wire.chunk_from_proto, target_pb2.GenerateResponse) == chunk
    assert not wire.chunk_to_proto(GenerateChunk((1,))).HasField("finish_reason")
    with pytest.raises(InvalidRequest):
        GenerateChunk((1,), finish_reason="tired")


def test_finish_reason_accepts_a_str_enum():
    import enum

    class Reason(str, enum.Enum):
        EOS = "eos"

    assert GenerateChunk((1,), finish_reason=Reason.EOS).finish_reason == "eos"


def test_target_description_round_trip():
    for d in (wire.TargetDescription("smollm2", 49152, 8192, DrafterKind.DFLASH), wire.TargetDescription("m", 10, 20)):
        back = wire_trip(
            d, wire.target_description_to_proto, wire.target_description_from_proto, target_pb2.TargetDescription
        )
        assert back == d and back.drafter_attached == (d.drafter_kind is not None)
    with pytest.raises(InvalidRequest):
        wire.target_description_from_proto(target_pb2.TargetDescription(drafter_attached=True))


def test_unknown_enum_numbers_are_refused():
    with pytest.raises(InvalidRequest):
        wire.inline_from_proto(common_pb2.InlineRows(data=b"\0" * 4, dtype=99, rows=1, cols=1))


def test_drafts_in_the_targets_buffer_round_trip():
    """A Step's drafts_buffer and an answer's drafts written there (no tokens in the message) cross the wire."""
    batch = StepBatch(4, proposes=[ProposeRequest(1, 5, 9, 3), ProposeRequest(2, 6, 9, 2)], draft_columns=True,
                      drafts_buffer=11)
    back, errors = wire.step_from_proto(drafter_pb2.StepRequest.FromString(
        wire.step_to_proto(batch, columns=True).SerializeToString()))
    assert not errors and back.drafts_buffer == 11 and back.proposes == batch.proposes
    result = StepResult(4, {}, (), in_buffer=((1, 3), (2, 2)))
    pb = drafter_pb2.StepResponse.FromString(wire.step_result_to_proto(result, columns=True).SerializeToString())
    assert pb.drafts.in_buffer and not pb.drafts.tokens
    assert wire.step_result_from_proto(pb) == result
    with pytest.raises(ValueError):  # drafts in the buffer and in the message at once: our own bug, not a peer's
        wire.step_result_to_proto(StepResult(4, {3: Proposal(tokens=[1])}, (), in_buffer=((1, 3),)), columns=True)
    with pytest.raises(InvalidRequest):
        StepBatch(1, drafts_buffer=-1)


@pytest.mark.parametrize("drafts, proposals", [
    (dict(seq_ids=[1], counts=[2], tokens=[5, 6], in_buffer=True), []),  # tokens as well
    (dict(seq_ids=[1], counts=[-1], in_buffer=True), []),
    (dict(seq_ids=[1, 1], counts=[2, 2], in_buffer=True), []),
    (dict(seq_ids=[1, 2], counts=[2], in_buffer=True), []),
    (dict(seq_ids=[1], counts=[2], in_buffer=True), [drafter_pb2.Proposal(seq_id=1, tokens=[4])]),
])
def test_a_malformed_answer_of_drafts_in_the_buffer_is_refused(drafts, proposals):
    pb = drafter_pb2.StepResponse(step_id=2, proposals=proposals, drafts=drafter_pb2.DraftColumns(**drafts))
    with pytest.raises(InvalidRequest):
        wire.step_result_from_proto(pb)


def test_a_drafts_buffer_descriptor_round_trips_and_int32_rows_do_not():
    d = BufferDescriptor(3, BufferKind.CUDA_IPC, "specsplit-1-0123456789abcdef", torch.int32, 8, 15, "h",
                         device_uuid="GPU-1", mem_handle=bytes(64), event_handle=bytes(64), role=BufferRole.DRAFTS)
    assert wire.descriptor_from_proto(wire.descriptor_to_proto(d)) == d
    pb = wire.descriptor_to_proto(d)
    pb.role = common_pb2.BUFFER_ROLE_ROWS
    with pytest.raises(InvalidRequest):
        wire.descriptor_from_proto(pb)
    with pytest.raises(InvalidRequest):
        wire.inline_from_proto(common_pb2.InlineRows(data=bytes(8), dtype=common_pb2.DTYPE_INT32, rows=1, cols=2))


def _chain_message(**change) -> drafter_pb2.StepRequest:
    """The steady chained step's Step as the target sends it (StepRequest.chain alone),
    with `change` applied to its ChainStep's fields after encoding (hostile values included)."""
    chain = wire.ChainStep(settle_seq_ids=(0, 2), settle_counts=(3, 1), commit_seq_ids=(0, 2), commit_rows=16,
                           rows=RowRef(3, 0, 32, 7), feed=RowRef(5, 0, 3, 9), seq_ids=(0, 2), ahead=(4, 2),
                           num_drafts=15, done_buffer=6, done_value=123, written_value=124)
    pb = wire.step_to_proto(StepBatch(step_id=1000, draft_columns=True, drafts_buffer=4, chain=chain), columns=True)
    for field, value in change.items():
        target = pb if field in ("step_id", "drafts_buffer") else pb.chain
        if isinstance(value, tuple):
            del getattr(target, field)[:]
            getattr(target, field).extend(value)
        else:
            setattr(target, field, value)
    return drafter_pb2.StepRequest.FromString(pb.SerializeToString())


VALID_CHAINS = [{}, {"settle_seq_ids": (), "settle_counts": ()}, {"step_id": 2 ** 63 - 1}, {"written_buffer": 8},
                {"seq_ids": (), "ahead": (), "num_drafts": 0, "done_buffer": 0, "done_value": 0, "written_value": 0}]
REFUSED_CHAINS = [{"settle_seq_ids": (0, 0)}, {"settle_counts": (1,)}, {"commit_seq_ids": (-1, 2)}, {"seq_ids": (2, 2)},
                  {"ahead": (4, -1)}, {"commit_rows": 0}, {"num_drafts": 0}, {"done_value": 0}, {"done_buffer": 0},
                  {"written_value": 2 ** 32 - 1, "done_buffer": 0}, {"written_buffer": 8, "written_value": 0},
                  {"written_buffer": -3}]


@pytest.mark.parametrize("change", VALID_CHAINS + REFUSED_CHAINS, ids=lambda change: ",".join(change) or "as-sent")
def test_a_chained_steps_message_parses_by_its_short_path_as_by_the_general_one(change):
    """`step_from_proto` takes a short path for a Step that only chains (every steady chained step's): it must
    give what the general parse gives, and refuse what it refuses, with the same words."""
    pb = _chain_message(**change)
    assert not (pb.seqs or pb.proposes or pb.HasField("verified") or pb.HasField("propose_columns"))
    outcomes = []
    for parse in (wire.step_from_proto, wire._step_from_proto):
        try:
            outcomes.append(parse(pb))
        except InvalidRequest as err:
            outcomes.append(("refused", str(err)))
    assert outcomes[0] == outcomes[1]
    assert isinstance(outcomes[0][0], StepBatch) == (change in VALID_CHAINS), outcomes[0]


def test_a_message_with_more_than_a_chain_takes_the_general_parse(monkeypatch):
    """Anything beside the chain (a sequence's operations, proposes, buffers, non-empty columns) goes the
    general way, where each entry is checked on its own."""
    taken = []
    monkeypatch.setattr(wire, "_step_from_proto", lambda pb: taken.append(pb) or ("general", []))
    pb = _chain_message()
    wire.step_from_proto(pb)
    pb.propose_columns.SetInParent()  # (empty columns, as a target before this one sent every step: short too)
    wire.step_from_proto(pb)
    assert taken == []
    for extend in (lambda m: m.release_buffers.append(3), lambda m: m.propose_columns.seq_ids.append(1),
                   lambda m: m.seqs.add(seq_id=1)):
        pb = _chain_message()
        extend(pb)
        assert wire.step_from_proto(pb) == ("general", [])
    assert len(taken) == 3
