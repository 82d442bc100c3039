"""Issue 9 on the drafter service: a stranger cannot squat it (every connection is capped, idle ones are
reclaimed), cannot poison it with NaN rows or oversized messages, and its errors speak the client's ids.

The drafter is served in this process on a unix socket (a tiny seeded DFlash, tests/test_drafter_server.py)."""

from __future__ import annotations

import logging
import queue
import time

import grpc
import pytest
import torch

from specsplit.drafter_service import server as drafter_server
from specsplit.drafter_service.server import CLIENT_HEADER, DrafterServer, serve
from specsplit.protos.v1 import drafter_pb2
from specsplit.shared import wire
from specsplit.shared.errors import InvalidRequest
from specsplit.shared.proposer import ProposeRequest
from specsplit.shared.transport import BufferExporter, encode_inline
from tests.drafter_peer import DrafterPeer
from tests.test_drafter_server import BUDGET, FEATURE_DIM, make_drafter
from tests.test_env import SERVE, parse


class Peer(DrafterPeer):
    """A caller under its own client id (nothing proves it is a target), with the verbs the caps bound."""

    def alloc(self, seq_id: int, budget: int = BUDGET) -> tuple[str, str]:
        return self.status("AllocState", wire.alloc_to_proto(seq_id, budget))

    def prefill(self, seq_id: int, rows: torch.Tensor, start: int = 0) -> tuple[str, str]:
        op = wire.RowsOp(tuple(1 + i % 90 for i in range(rows.shape[0])), encode_inline(rows), start)
        return self.status("PrefillDrafter", wire.prefill_to_proto(seq_id, op))

    def open_stream(self):
        outbox: queue.Queue = queue.Queue()
        responses = self.stub.Step(iter(outbox.get, None), metadata=self.metadata)
        outbox.put(wire.step_to_proto(wire.StepBatch(1)))
        return outbox, responses

    def open_stream_status(self) -> tuple[str, str]:
        """(status code name, details) of opening a Step stream; ("OK", "") when the drafter took it."""
        outbox, responses = self.open_stream()
        try:
            next(responses)
        except grpc.RpcError as err:
            return err.code().name, err.details() or ""
        finally:
            outbox.put(None)
        return "OK", ""


@pytest.fixture
def served(tmp_path):
    """start(**limits) → (DrafterServer, channel); everything is stopped at the end."""
    made = []

    def start(**limits):
        drafter = make_drafter()
        server_obj = DrafterServer(drafter, head=drafter.head, device="cpu", **limits)
        address = f"unix:{tmp_path}/d{len(made)}.sock"
        server = serve(server_obj, [address])
        channel = grpc.insecure_channel(address)
        made.append((server, server_obj, channel))
        return server_obj, channel

    yield start
    for server, server_obj, channel in made:
        channel.close()
        server.stop(None)
        server_obj.close()


def rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, FEATURE_DIM, generator=torch.Generator().manual_seed(seed))


# --- finding 4: squatting -------------------------------------------------------------------------


def test_sessions_without_a_step_stream_are_capped(served):
    server_obj, channel = served(max_sessions=3)
    peers = [Peer(channel) for _ in range(3)]
    for i, peer in enumerate(peers):
        assert peer.alloc(0) == ("OK", "")
        assert peer.prefill(0, rows(2 + i)) == ("OK", "")
    assert peers[0].prefill(0, rows(1), start=2) == ("OK", "")  # used last: peers[1] is now the oldest
    newcomer = Peer(channel)
    assert newcomer.alloc(0) == ("OK", "")
    assert server_obj.num_sessions == 3 and len(server_obj.proposer.store) == 3
    code, details = peers[1].prefill(0, rows(1), start=3)  # its state was freed for the newcomer
    assert code == "NOT_FOUND"
    # Targets with a Step stream are not counted, and never freed for a stream-less caller.
    target = Peer(channel, "target")
    outbox, responses = target.open_stream()
    assert next(responses).step_id == 1
    for _ in range(4):
        assert Peer(channel).alloc(0) == ("OK", "")
    assert server_obj.num_streams == 1 and server_obj.num_sessions == 4
    outbox.put(None)


def test_quiet_step_streams_under_made_up_names_cannot_lock_a_target_out(served):
    """Streams that opened and then did no work hold --max-targets only until a newcomer needs a slot
    and they have been quiet for `reclaim_stream_seconds`; a stream at work keeps its slot."""
    _, patient = served(max_targets=2, reclaim_stream_seconds=3600)
    held = [Peer(patient).open_stream() for _ in range(2)]
    assert [next(responses).step_id for _, responses in held] == [1, 1]
    code, details = Peer(patient).open_stream_status()  # streams quiet for less than that keep their slots
    assert code == "RESOURCE_EXHAUSTED" and "--max-targets" in details
    for outbox, _ in held:
        outbox.put(None)

    server_obj, channel = served(max_targets=2, reclaim_stream_seconds=0.2)
    squatter = Peer(channel, "squatter")
    s_outbox, s_responses = squatter.open_stream()
    assert next(s_responses).step_id == 1
    worker = Peer(channel, "worker")
    w_outbox, w_responses = worker.open_stream()
    assert next(w_responses).step_id == 1
    time.sleep(0.3)  # both are past the threshold now; the worker then works, the squatter never does
    w_outbox.put(wire.step_to_proto(wire.StepBatch(2, proposes=(ProposeRequest(0, 5, 0, 3),))))  # work
    assert next(w_responses).step_id == 2
    target = Peer(channel, "target")
    t_outbox, t_responses = target.open_stream()
    assert next(t_responses).step_id == 1  # the squatter's slot was given to it
    with pytest.raises(grpc.RpcError) as ended:
        next(s_responses)
    assert ended.value.code() is grpc.StatusCode.CANCELLED
    assert server_obj.num_streams == 2 and "squatter" not in server_obj._sessions
    w_outbox.put(wire.step_to_proto(wire.StepBatch(3)))
    assert next(w_responses).step_id == 3  # the worker was never touched
    for outbox in (w_outbox, t_outbox, s_outbox):
        outbox.put(None)


def test_sequences_rows_and_buffer_bytes_per_connection_are_capped(served):
    _, channel = served(max_sequences=2, max_rows=3 * BUDGET // 2, max_buffer_mib=1)
    many = Peer(channel)
    assert many.alloc(0, 8) == ("OK", "") and many.alloc(1, 8) == ("OK", "")
    code, details = many.alloc(2, 8)
    assert code == "RESOURCE_EXHAUSTED" and "--max-sequences" in details
    assert many.status("FreeState", drafter_pb2.FreeStateRequest(seq_id=1)) == ("OK", "")
    assert many.prefill(0, rows(4)) == ("OK", "")
    # A carried KV still holds its rows: it counts as a sequence until installed or freed.
    assert many.status("TakeDrafterKV", drafter_pb2.TakeDrafterKVRequest(seq_id=0)) == ("OK", "")
    code, details = many.alloc(1, 8)
    assert code == "RESOURCE_EXHAUSTED" and "--max-sequences" in details

    peer = Peer(channel)  # rows: each sequence reserves what its budget lets it hold
    assert peer.alloc(0) == ("OK", "")
    code, details = peer.alloc(1)
    assert code == "RESOURCE_EXHAUSTED" and "--max-rows" in details
    assert peer.alloc(1, BUDGET // 2) == ("OK", "")
    assert peer.status("FreeState", drafter_pb2.FreeStateRequest(seq_id=0)) == ("OK", "")
    assert peer.alloc(0, BUDGET) == ("OK", "")  # freeing gives room back

    with BufferExporter() as exporter:
        small, large = exporter.create(16, FEATURE_DIM), exporter.create((1 << 20) // (4 * FEATURE_DIM) + 1, FEATURE_DIM)
        register = lambda *b: peer.status("RegisterBuffers", drafter_pb2.RegisterBuffersRequest(  # noqa: E731
            buffers=[wire.descriptor_to_proto(x.describe()) for x in b]))
        code, details = register(large)
        assert code == "RESOURCE_EXHAUSTED" and "--max-buffer-mib" in details
        assert register(small) == ("OK", "")


def test_the_caps_are_validated():
    with pytest.raises(InvalidRequest):
        drafter_server.DrafterLimits(max_sessions=0)
    with pytest.raises(InvalidRequest):
        drafter_server.DrafterLimits(idle_seconds=0)
    with pytest.raises(InvalidRequest):
        drafter_server.DrafterLimits(max_rows=-1)
    with pytest.raises(InvalidRequest, match="--reclaim-stream-seconds"):
        drafter_server.DrafterLimits(reclaim_stream_seconds=0)


def test_reclaim_stream_seconds_comes_from_the_flag_or_the_environment(monkeypatch):
    assert parse(monkeypatch, SERVE["drafter"] + ["--listen", "unix:/x"]).reclaim_stream_seconds == 10.0
    assert parse(monkeypatch, SERVE["drafter"] + ["--listen", "unix:/x"],
                 SPECSPLIT_RECLAIM_STREAM_SECONDS="2.5").reclaim_stream_seconds == 2.5
    assert parse(monkeypatch, SERVE["drafter"] + ["--listen", "unix:/x", "--reclaim-stream-seconds", "1"],
                 SPECSPLIT_RECLAIM_STREAM_SECONDS="2.5").reclaim_stream_seconds == 1.0


def test_an_idle_stream_less_session_is_reclaimed_without_another_call(served):
    server_obj, channel = served(idle_seconds=0.3)
    peer = Peer(channel)
    assert peer.alloc(0) == ("OK", "") and peer.prefill(0, rows(8)) == ("OK", "")
    assert len(server_obj.proposer.store) == 1
    deadline = time.monotonic() + 5
    while server_obj.num_sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server_obj.num_sessions == 0 and len(server_obj.proposer.store) == 0


def test_the_default_idle_time_is_short():
    assert drafter_server.DrafterLimits().idle_seconds <= 60


# --- finding 6: message size ------------------------------------------------------------------------


def test_messages_past_the_cap_are_refused_before_they_are_read(served):
    _, channel = served(max_message_mib=1)
    peer = Peer(channel)
    assert peer.alloc(0, 4096) == ("OK", "")
    big = rows((1 << 20) // (4 * FEATURE_DIM) + 1)
    code, _ = peer.prefill(0, big)
    assert code == "RESOURCE_EXHAUSTED"
    assert peer.prefill(0, big[:100]) == ("OK", "")


def test_the_default_message_cap_fits_a_step_of_the_widest_batch_but_not_256_mib():
    drafter = make_drafter()
    limits = drafter_server.DrafterLimits()
    step_rows = drafter.spec.max_batch * (drafter.spec.max_drafts + 1)
    assert step_rows * FEATURE_DIM * 4 < limits.message_bytes(drafter.spec) < 256 << 20


# --- finding 10: NaN rows, internal ids, malformed messages ---------------------------------------------


def test_rows_that_are_not_finite_are_refused(served):
    _, channel = served()
    peer = Peer(channel)
    assert peer.alloc(0) == ("OK", "")
    for bad in (float("nan"), float("inf")):
        poisoned = rows(4)
        poisoned[2, 5] = bad
        code, details = peer.prefill(0, poisoned)
        assert code == "INVALID_ARGUMENT" and "finite" in details
    with BufferExporter() as exporter:  # rows by reference into shared memory: checked the same way
        buffer = exporter.create(8, FEATURE_DIM)
        assert peer.status("RegisterBuffers", drafter_pb2.RegisterBuffersRequest(
            buffers=[wire.descriptor_to_proto(buffer.describe())]))[0] == "OK"
        buffer.bump()
        buffer.tensor[:4] = rows(4)
        buffer.tensor[1, 0] = float("nan")
        code, details = peer.status("Stash", wire.stash_to_proto(0, buffer.ref(0, 4)))
        assert code == "INVALID_ARGUMENT" and "finite" in details
    assert peer.prefill(0, rows(4)) == ("OK", "")
    proposal = wire.proposals_from_proto(peer.call("Propose", wire.propose_to_proto(
        [ProposeRequest(0, 5, 4, 3, want_confidence=True)])))[0]
    assert all(c == c for c in proposal.confidence)  # no NaN got in


def test_a_prefill_that_allocates_leaves_nothing_of_a_sequence_it_refuses(served):
    """PrefillDrafter with alloc_budget_tokens (one round trip attaches a sequence): whatever refuses it, the
    sequence's id, its budget, its rows or the caps, the drafter holds nothing of the sequence after, and a
    refusal for an id in use leaves that sequence as it was."""
    _, channel = served(max_sequences=2)
    peer = Peer(channel)

    def attach(seq_id: int, prompt: torch.Tensor, budget: int = BUDGET) -> tuple[str, str]:
        op = wire.RowsOp(tuple(1 + i % 90 for i in range(prompt.shape[0])), encode_inline(prompt), 0)
        return peer.status("PrefillDrafter", wire.prefill_to_proto(seq_id, op, budget))

    assert attach(0, rows(4)) == ("OK", "")
    code, details = attach(0, rows(2, 1))
    assert code == "ALREADY_EXISTS" and "sequence 0" in details
    for budget in (0, -5):
        assert attach(1, rows(3), budget)[0] == "INVALID_ARGUMENT"
    poisoned = rows(3)
    poisoned[1, 2] = float("nan")
    code, details = attach(1, poisoned)  # allocated, then refused by the prefill: freed again
    assert code == "INVALID_ARGUMENT" and "finite" in details
    assert peer.alloc(1) == ("OK", "")  # nothing of sequence 1 was left
    assert peer.status("FreeState", drafter_pb2.FreeStateRequest(seq_id=1)) == ("OK", "")
    assert attach(1, rows(3)) == ("OK", "")
    code, details = attach(2, rows(3))
    assert code == "RESOURCE_EXHAUSTED" and "--max-sequences" in details
    # sequence 0 is its first prefill's: drafts from position 4 on
    proposal = wire.proposals_from_proto(peer.call("Propose", wire.propose_to_proto([ProposeRequest(0, 5, 4, 3)])))[0]
    assert len(proposal.tokens) == 3


def test_errors_name_the_clients_sequence_ids(served):
    _, channel = served()
    first, second = Peer(channel), Peer(channel)
    for seq_id in range(5):  # the second client's ids map to other drafter-wide ids
        assert first.alloc(seq_id) == ("OK", "")
    assert second.alloc(0) == ("OK", "") and second.prefill(0, rows(3)) == ("OK", "")
    code, details = second.status("Commit", wire.commit_to_proto(0, wire.CommitOp(1, 3, (4,))))
    assert code == "FAILED_PRECONDITION" and details == "sequence 0: commit without a stash"
    code, details = second.status("Propose", wire.propose_to_proto([ProposeRequest(0, 5, 7, 3)]))
    assert code == "FAILED_PRECONDITION" and details.startswith("sequence 0: propose at position 7")


def test_malformed_messages_log_one_line_each_rate_limited(served, caplog, monkeypatch):
    _, channel = served()
    from specsplit.shared.status import Throttle

    from specsplit.shared import status

    monkeypatch.setattr(status, "_malformed", Throttle(per_minute=6))  # a budget of its own, whatever ran before
    raw = channel.unary_unary("/specsplit.v1.DrafterService/AllocState")
    metadata = ((CLIENT_HEADER, "junk"),)
    with caplog.at_level(logging.INFO):
        for _ in range(50):
            with pytest.raises(grpc.RpcError):
                raw(b"\xff\xff\xff", metadata=metadata, timeout=10)
    records = [r for r in caplog.records if "malformed" in r.getMessage() or "deserializ" in r.getMessage()]
    assert 1 <= len(records) <= 10
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in records)
    assert Peer(channel).alloc(0) == ("OK", "")  # still serving


def test_the_context_pool_is_sized_by_its_flag_and_a_full_pool_refuses_with_resource_exhausted(
        monkeypatch, tmp_path, tiny_chat_dir):
    """`--context-pool-rows` sizes the one pool all connections share (rounded up to whole blocks); an
    alloc that finds no room is RESOURCE_EXHAUSTED (the target then decodes that sequence without
    speculation), and a free gives the room back."""
    from specsplit.drafter_service.context_pool import BLOCK_SIZE
    from specsplit.local import LocalSetup, build_drafter
    from specsplit.shared.checkpoint import load_config
    from specsplit.drafter_service.heads import TargetInfo

    assert parse(monkeypatch, SERVE["drafter"] + ["--listen", "unix:/x"]).context_pool_rows is None
    assert parse(monkeypatch, SERVE["drafter"] + ["--listen", "unix:/x", "--context-pool-rows", "100"]
                 ).context_pool_rows == 100
    info = TargetInfo.from_config(load_config(tiny_chat_dir))
    setup = LocalSetup(target=str(tiny_chat_dir), drafter="random-dflash")
    assert build_drafter("random-dflash", info, None, setup, pool_rows=100).pool.num_blocks == -(-100 // BLOCK_SIZE)
    with pytest.raises(InvalidRequest, match="context-pool-rows"):
        build_drafter("random-dflash", info, None, setup, pool_rows=0)

    drafter = random_drafter_with_pool(2 * ring_blocks(BUDGET))
    server_obj = DrafterServer(drafter, head=drafter.head, device="cpu")
    server = serve(server_obj, [f"unix:{tmp_path}/p.sock"])
    channel = grpc.insecure_channel(f"unix:{tmp_path}/p.sock")
    try:
        peer = Peer(channel, "target-a")
        assert peer.alloc(0) == ("OK", "") and peer.alloc(1) == ("OK", "")
        code, details = peer.alloc(2)
        assert code == "RESOURCE_EXHAUSTED" and "context pool" in details
        assert peer.status("FreeState", drafter_pb2.FreeStateRequest(seq_id=0)) == ("OK", "")
        assert peer.alloc(2) == ("OK", "")
    finally:
        channel.close()
        server.stop(None)
        server_obj.close()


def ring_blocks(budget: int) -> int:
    from specsplit.drafter_service.context_pool import ring_size
    from tests.test_drafter_server import GAMMA

    return ring_size(budget, GAMMA)


def random_drafter_with_pool(blocks: int):
    from specsplit.drafter_service.checkpoint import random_drafter
    from tests.test_drafter_server import GAMMA, INFO, MAX_BATCH

    return random_drafter("dflash", INFO, None, seed=0, num_layers=2, block_size=GAMMA, max_batch=MAX_BATCH,
                          pool_blocks=blocks)
