"""Drafter gRPC service: the Step stream and unary RPCs equal direct drafter calls; errors map to status
codes and stay with their sequence; sessions keep clients apart and free everything when they go."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torch import nn

from specsplit.drafter_service.checkpoint import random_drafter
from specsplit.drafter_service.heads import TargetHead, TargetInfo
from specsplit.drafter_service.server import CLIENT_HEADER, SERVICE_NAME, DrafterServer, serve
from specsplit.shared.serving import INSTANCE_HEADER
from specsplit.local import LocalSetup
from specsplit.drafter_service.limits import DrafterLimits
from specsplit.drafter_service.session import PreparedLaunch, Session
from specsplit.protos.v1 import drafter_pb2, drafter_pb2_grpc
from specsplit.shared import wire
from specsplit.shared.errors import CapacityExceeded, DrafterUnavailable, InvalidRequest, WritesPending
from specsplit.shared.proposer import ProposeRequest, bool_to_bitmask
from specsplit.shared.transport import BufferExporter, BufferRole, RowRef, encode_inline, host_id, identity_digest
from specsplit.target_service import drafter_client
from specsplit.target_service.drafter_client import RemoteProposer
from tests.rounding import conf_atol

INFO = TargetInfo(hidden_size=32, vocab_size=97, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, intermediate_size=64)
GAMMA = 4  # 3 drafts per propose
MAX_BATCH = 2  # small, so a step's proposes span several chunks
BUDGET = 64
CODE = {code.name: code.value[0] for code in grpc.StatusCode}


def make_drafter(head: TargetHead | None = None):
    """A seeded DFlash drafter with weights large enough that every row moves the drafts; it keeps the
    largest |logit| it has computed in `largest_logit` (the scale its confidences are rounded at)."""
    drafter = random_drafter("dflash", INFO, head, seed=0, num_layers=2, block_size=GAMMA, max_batch=MAX_BATCH)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in drafter.model.modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) / m.weight.shape[1] ** 0.5)
    logits, drafter.largest_logit = drafter.model.logits, 0.0

    def recorded(hidden, head):
        out = logits(hidden, head)
        drafter.largest_logit = max(drafter.largest_logit, out.abs().max().item())
        return out

    drafter.model.logits = recorded
    return drafter


FEATURE_DIM = make_drafter().spec.feature_dim


class Client:
    """One connected target: its metadata, a shared-memory row buffer, and a Step stream."""

    def __init__(self, channel: grpc.Channel, name: str, exporter: BufferExporter) -> None:
        self.stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        self.metadata = ((CLIENT_HEADER, name),)
        self.buffer = exporter.create(64, FEATURE_DIM)
        self.cursor = 0
        self.call("RegisterBuffers", drafter_pb2.RegisterBuffersRequest(
            buffers=[wire.descriptor_to_proto(self.buffer.describe())]))
        self.outbox: queue.Queue | None = None

    def call(self, method: str, request):
        return getattr(self.stub, method)(request, metadata=self.metadata, timeout=20)

    def new_generation(self) -> None:
        self.buffer.bump()
        self.cursor = 0

    def shm(self, rows: torch.Tensor) -> RowRef:
        """Write rows into the buffer's current generation and reference them."""
        offset, self.cursor = self.cursor, self.cursor + rows.shape[0]
        self.buffer.tensor[offset:self.cursor].copy_(rows)
        return self.buffer.ref(offset, rows.shape[0])

    def code(self, method: str, request) -> str:
        with pytest.raises(grpc.RpcError) as info:
            self.call(method, request)
        return info.value.code().name

    # -- the Step stream --

    def open(self) -> None:
        self.outbox = queue.Queue()
        self.responses = self.stub.Step(iter(self.outbox.get, None), metadata=self.metadata)

    def step(self, batch: wire.StepBatch, *, columns: bool = False) -> wire.StepResult:
        self.outbox.put(wire.step_to_proto(batch, columns=columns))
        return wire.step_result_from_proto(next(self.responses))

    def close_stream(self) -> None:
        self.outbox.put(None)
        assert list(self.responses) == []


@pytest.fixture
def env(tmp_path):
    """A drafter served on a unix socket, its untouched twin to call directly, and a client factory."""
    exporter = BufferExporter()
    made: list = []

    def start(server_head="drafter", drafter_head: TargetHead | None = None, **server_kw):
        drafter = make_drafter(drafter_head)
        head = drafter.head if server_head == "drafter" else server_head
        server_obj = DrafterServer(drafter, head=head, device="cpu", **server_kw)
        address = f"unix:{tmp_path}/drafter-{len(made)}.sock"
        server = serve(server_obj, [address])
        channel = grpc.insecure_channel(address)
        made.append((server, server_obj, channel))
        return drafter, server_obj, channel

    class Env:
        pass

    e = Env()
    e.start, e.exporter = start, exporter
    e.drafter, e.server, e.channel = start()
    e.twin = make_drafter()
    e.client = lambda name: Client(e.channel, name, exporter)
    yield e
    for server, server_obj, channel in made:
        channel.close()
        server.stop(None)
        server_obj.close()
    exporter.close()


@pytest.fixture
def serve_remote(tmp_path):
    """(drafter, limits={DrafterLimits fields}, **RemoteProposer options) -> (its DrafterServer, a RemoteProposer
    attached to it over a unix socket); everything made is closed when the test ends."""
    made = []

    def start(drafter, limits: dict | None = None, **kw):
        server_obj = DrafterServer(drafter, head=drafter.head, device="cpu", **(limits or {}))
        address = f"unix:{tmp_path}/d-{len(made)}.sock"
        server = serve(server_obj, [address])
        proposer = RemoteProposer(address, **kw)
        made.append((proposer, server, server_obj))
        return server_obj, proposer

    yield start
    for proposer, server, server_obj in made:
        proposer.close()
        server.stop(None)
        server_obj.close()


def rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, FEATURE_DIM, generator=torch.Generator().manual_seed(seed))


def inline(t: torch.Tensor):
    return encode_inline(t)


def alloc_prefill(client: Client, twin, seq_id: int, prompt: list[int], seed: int, *, twin_id: int | None = None):
    """Allocate and prefill a sequence on the server (inline rows) and on the twin."""
    client.call("AllocState", wire.alloc_to_proto(seq_id, BUDGET))
    r = rows(len(prompt), seed)
    reply = client.call("PrefillDrafter", wire.prefill_to_proto(seq_id, wire.RowsOp(tuple(prompt), inline(r), 0)))
    assert reply.rows_appended == len(prompt)
    twin_id = seq_id if twin_id is None else twin_id
    twin.alloc(twin_id, BUDGET)
    twin.prefill(twin_id, prompt, r, 0)


def propose_unary(client: Client, requests: list[ProposeRequest]):
    return wire.proposals_from_proto(client.call("Propose", wire.propose_to_proto(requests)))


def same(got, want, twin) -> None:
    """`want` from `twin`, the drafter called directly. The service enters a step's committed rows in
    one batched forward where the twin takes them one call at a time, so the sums differ in order and
    confidences agree to rounding (tests/rounding.py): at the scale of the twin's logits, the longest
    sum is the 97-token softmax, chained after the fc, 2 layers and the head."""
    assert [p.tokens for p in got] == [p.tokens for p in want]
    atol = conf_atol(twin.largest_logit, INFO.vocab_size, depth=5)
    for g, w in zip(got, want):
        if w.confidence is None:
            assert not g.confidence
        else:
            assert g.confidence == pytest.approx(w.confidence, abs=atol, rel=0)


# ---- equivalence with direct calls ---------------------------------------------------------------


def test_step_stream_matches_direct_calls(env):
    client, twin = env.client("target-a"), env.twin
    prompts = {0: [3, 14, 15, 92, 65], 1: [2, 71, 82], 2: [1, 41, 42, 13]}
    for seq_id, prompt in prompts.items():
        alloc_prefill(client, twin, seq_id, prompt, seed=10 + seq_id)
    pos = {s: len(p) for s, p in prompts.items()}
    client.open()

    # Step 1: proposes only (3 sequences over two chunks of MAX_BATCH).
    mask = torch.zeros(INFO.vocab_size, dtype=torch.bool)
    mask[10:40] = True
    reqs = [ProposeRequest(0, 5, pos[0], 3, want_confidence=True), ProposeRequest(1, 6, pos[1], 2),
            ProposeRequest(2, 7, pos[2], 3, bitmask=bool_to_bitmask(mask))]
    result = client.step(wire.StepBatch(1, proposes=reqs))
    assert result.step_id == 1 and not result.errors and list(result.proposals) == [0, 1, 2]
    same(list(result.proposals.values()), twin.propose(reqs), twin)
    assert all(10 <= t < 40 for t in result.proposals[2].tokens)

    # Step 2: every sequence verifies k+1 = 4 rows (shm refs, one inline) and accepts a drafts.
    client.new_generation()
    accepted = {0: 0, 1: 1, 2: 3}
    seqs, reqs = [], []
    for seq_id, a in accepted.items():
        verify = rows(GAMMA, 20 + seq_id)
        source = inline(verify) if seq_id == 1 else client.shm(verify)
        tokens = tuple(range(30 + seq_id, 31 + seq_id + a))
        seqs.append(wire.SeqStep(seq_id, stash=source, commit=wire.CommitOp(a + 1, pos[seq_id], tokens), trim=a))
        twin.stash(seq_id, verify)
        twin.commit(seq_id, a + 1, pos[seq_id], tokens)
        twin.trim(seq_id, a)
        pos[seq_id] += a + 1
        reqs.append(ProposeRequest(seq_id, 50 + seq_id, pos[seq_id], 3, want_confidence=seq_id == 2))
    result = client.step(wire.StepBatch(2, seqs=seqs, proposes=reqs))
    assert not result.errors
    same(list(result.proposals.values()), twin.propose(reqs), twin)

    # Step 3: a catch-up for 0, sequence 2 freed, proposes for the other two.
    client.new_generation()
    extra = rows(2, 30)
    result = client.step(wire.StepBatch(3, seqs=[
        wire.SeqStep(0, catchup=wire.RowsOp((60, 61), client.shm(extra), pos[0])),
        wire.SeqStep(2, free=True),
    ], proposes=[ProposeRequest(0, 62, pos[0] + 2, 3), ProposeRequest(1, 63, pos[1], 1)]))
    twin.catchup(0, [60, 61], extra, pos[0])
    twin.free(2)
    assert not result.errors
    same(list(result.proposals.values()),
         twin.propose([ProposeRequest(0, 62, pos[0] + 2, 3), ProposeRequest(1, 63, pos[1], 1)]), twin)
    assert len(env.drafter.store) == 2
    client.close_stream()


def test_unary_verbs_match_direct_calls(env):
    client, twin = env.client("target-a"), env.twin
    alloc_prefill(client, twin, 4, [9, 8, 7], seed=1)
    verify = rows(3, 2)
    client.call("Stash", wire.stash_to_proto(4, inline(verify)))
    client.call("Commit", wire.commit_to_proto(4, wire.CommitOp(2, 3, (11, 12))))
    client.call("Trim", wire.trim_to_proto(4, 1))
    client.new_generation()
    extra = rows(3, 3)
    reply = client.call("Catchup", wire.catchup_to_proto(4, wire.RowsOp((1, 2, 3), client.shm(extra), 5)))
    assert reply.rows_appended == 3
    twin.stash(4, verify)
    twin.commit(4, 2, 3, [11, 12])
    twin.trim(4, 1)
    twin.catchup(4, [1, 2, 3], extra, 5)
    req = [ProposeRequest(4, 13, 8, 3, want_confidence=True)]
    same(propose_unary(client, req), twin.propose(req), twin)
    client.call("FreeState", drafter_pb2.FreeStateRequest(seq_id=4))
    assert len(env.drafter.store) == 0


def test_describe(env):
    client = env.client("target-a")
    desc = wire.description_from_proto(client.call("Describe", drafter_pb2.DescribeDrafterRequest()))
    assert desc.spec == env.drafter.spec
    # The host identity is answered salted with the caller's id: comparable, never revealed.
    assert desc.host_id == identity_digest("target-a", host_id()) and host_id() not in desc.host_id
    assert desc.device_uuid == "" and not desc.needs_target_head
    assert desc.step_columns and desc.drafts_buffer  # what a target may send it (columns, a drafts buffer)


def test_health_check_answers_serving(env):
    stub = health_pb2_grpc.HealthStub(env.channel)
    for service in ("", SERVICE_NAME):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


# ---- errors --------------------------------------------------------------------------------------


def test_unary_errors_map_to_status_and_leave_other_sequences_untouched(env):
    client, twin = env.client("target-a"), env.twin
    alloc_prefill(client, twin, 0, [5, 6, 7, 8], seed=1)
    alloc_prefill(client, twin, 1, [9, 10, 11], seed=2)
    probe = [ProposeRequest(1, 12, 3, 3, want_confidence=True)]
    before = propose_unary(client, probe)
    same(before, twin.propose(probe), twin)

    client.new_generation()
    stale = client.shm(rows(2, 3))
    client.new_generation()
    bad_cols = encode_inline(torch.zeros(2, FEATURE_DIM + 1))
    cases = [
        ("AllocState", wire.alloc_to_proto(0, BUDGET), "ALREADY_EXISTS"),
        ("AllocState", drafter_pb2.AllocStateRequest(seq_id=2, budget_tokens=0), "INVALID_ARGUMENT"),
        ("Propose", wire.propose_to_proto([ProposeRequest(9, 1, 0, 1)]), "NOT_FOUND"),
        ("Stash", wire.stash_to_proto(9, inline(rows(2, 4))), "NOT_FOUND"),
        ("FreeState", drafter_pb2.FreeStateRequest(seq_id=9), "NOT_FOUND"),
        ("TakeDrafterKV", drafter_pb2.TakeDrafterKVRequest(seq_id=9), "NOT_FOUND"),
        ("FreeDrafterKV", drafter_pb2.FreeDrafterKVRequest(handle=1), "NOT_FOUND"),
        ("Stash", drafter_pb2.StashRequest(seq_id=0), "INVALID_ARGUMENT"),  # no rows
        ("Stash", wire.stash_to_proto(0, bad_cols), "INVALID_ARGUMENT"),
        ("Stash", wire.stash_to_proto(0, RowRef(77, 0, 2, 1)), "INVALID_ARGUMENT"),  # unknown buffer
        ("Stash", wire.stash_to_proto(0, RowRef(client.buffer.buffer_id, 62, 4, client.buffer.generation)),
         "INVALID_ARGUMENT"),  # out of bounds
        ("Stash", wire.stash_to_proto(0, stale), "FAILED_PRECONDITION"),
        ("Commit", wire.commit_to_proto(0, wire.CommitOp(1, 4, (3,))), "FAILED_PRECONDITION"),  # no stash
        ("Catchup", wire.catchup_to_proto(0, wire.RowsOp((3,), inline(rows(1, 5)), 6)), "FAILED_PRECONDITION"),
        ("Propose", wire.propose_to_proto([ProposeRequest(0, 1, 4, GAMMA)]), "INVALID_ARGUMENT"),
        ("Propose", wire.propose_to_proto([ProposeRequest(0, 1, 5, 1)]), "FAILED_PRECONDITION"),
        ("Trim", wire.trim_to_proto(0, GAMMA), "INVALID_ARGUMENT"),
        ("ReleaseBuffers", drafter_pb2.ReleaseBuffersRequest(buffer_ids=[77]), "INVALID_ARGUMENT"),
    ]
    for method, request, code in cases:
        assert client.code(method, request) == code, (method, request)

    # A commit gap after a good stash.
    client.call("Stash", wire.stash_to_proto(0, inline(rows(2, 6))))
    assert client.code("Commit", wire.commit_to_proto(0, wire.CommitOp(1, 7, (3,)))) == "FAILED_PRECONDITION"

    # Without the client metadata every call is refused, the stream too.
    with pytest.raises(grpc.RpcError) as info:
        client.stub.AllocState(wire.alloc_to_proto(5, BUDGET), timeout=10)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and CLIENT_HEADER in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        next(client.stub.Step(iter([drafter_pb2.StepRequest(step_id=1)]), timeout=10))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    same(propose_unary(client, probe), before, twin)
    assert len(env.drafter.store) == 2


def test_register_buffers_is_all_or_nothing(env):
    client = env.client("target-a")
    good = env.exporter.create(8, FEATURE_DIM)
    bad = wire.descriptor_to_proto(env.exporter.create(8, FEATURE_DIM).describe())
    bad.name = "specsplit-1-0000000000000000"  # no such segment
    request = drafter_pb2.RegisterBuffersRequest(buffers=[wire.descriptor_to_proto(good.describe()), bad])
    assert client.code("RegisterBuffers", request) == "INVALID_ARGUMENT"
    ref = good.ref(0, 1)
    client.call("AllocState", wire.alloc_to_proto(0, BUDGET))
    assert client.code("Stash", wire.stash_to_proto(0, ref)) == "INVALID_ARGUMENT"  # good was not kept
    client.call("RegisterBuffers", drafter_pb2.RegisterBuffersRequest(buffers=[wire.descriptor_to_proto(good.describe())]))
    client.call("Stash", wire.stash_to_proto(0, ref))
    client.call("ReleaseBuffers", drafter_pb2.ReleaseBuffersRequest(buffer_ids=[good.buffer_id]))
    assert client.code("Stash", wire.stash_to_proto(0, ref)) == "INVALID_ARGUMENT"


def test_step_errors_stay_with_their_sequence(env):
    client, twin = env.client("target-a"), env.twin
    for seq_id in range(5):
        alloc_prefill(client, twin, seq_id, [20 + seq_id, 21, 22], seed=seq_id)
    client.open()
    client.new_generation()
    stale = client.shm(rows(2, 7))
    client.new_generation()
    verify = rows(2, 8)
    step = wire.step_to_proto(wire.StepBatch(1, seqs=[
        wire.SeqStep(0, stash=stale, commit=wire.CommitOp(1, 3, (4,))),  # stale rows: skipped entirely
        wire.SeqStep(1, stash=client.shm(verify), commit=wire.CommitOp(2, 3, (4, 5)), trim=1),
        wire.SeqStep(9, trim=0),  # unknown sequence
        wire.SeqStep(4, stash=stale, free=True),  # failed, but freed all the same: the target is done with it
    ], proposes=[ProposeRequest(0, 4, 4, 3), ProposeRequest(1, 6, 5, 3), ProposeRequest(2, 7, 3, GAMMA),
                 ProposeRequest(3, 8, 3, 2)]))
    malformed = step.seqs.add(seq_id=3)
    malformed.commit.CopyFrom(drafter_pb2.CommitOp(num_rows=2, base_pos=3, token_ids=[1]))  # 2 rows, 1 token
    client.outbox.put(step)
    result = wire.step_result_from_proto(next(client.responses))
    codes = {e.seq_id: e.code for e in result.errors}
    assert codes == {0: "FAILED_PRECONDITION", 9: "NOT_FOUND", 2: "INVALID_ARGUMENT", 3: "INVALID_ARGUMENT",
                     4: "FAILED_PRECONDITION"}
    assert len(env.drafter.store) == 4
    twin.stash(1, verify)
    twin.commit(1, 2, 3, [4, 5])
    twin.trim(1, 1)
    assert list(result.proposals) == [1]  # 2 failed inside a batched propose: isolated from 1's chunk
    same([result.proposals[1]], twin.propose([ProposeRequest(1, 6, 5, 3)]), twin)

    # The failed sequences are untouched and go on next step; the stream survived.
    again = [ProposeRequest(0, 4, 3, 3), ProposeRequest(2, 7, 3, 3), ProposeRequest(3, 8, 3, 2)]
    result = client.step(wire.StepBatch(2, proposes=again))
    assert not result.errors
    same(list(result.proposals.values()), twin.propose(again), twin)
    client.close_stream()


@pytest.mark.parametrize("columns", [False, True], ids=["seqsteps", "columns"])
def test_a_steps_verified_sequences_commit_together_and_a_bad_one_fails_alone(env, monkeypatch, columns):
    """The verified sequences of a packed step (rows in one buffer) go to the drafter in one call, sent
    as SeqSteps or as the message's columns (taken as they are, without an object per sequence); when
    one entry is bad that call changes nothing, and the sequences are applied one by one, so only the
    bad one fails (with its own code) and the others end as the direct calls leave them."""
    client, twin = env.client("target-a"), env.twin
    for seq_id in range(4):
        alloc_prefill(client, twin, seq_id, [20 + seq_id, 21, 22], seed=seq_id)
    calls = []
    many = env.drafter.commit_verified_many
    monkeypatch.setattr(env.drafter, "commit_verified_many", lambda *a: (calls.append(len(a[0])), many(*a))[1])
    client.open()
    pos = {seq_id: 3 for seq_id in range(4)}
    for step_id, bad in ((1, 3), (2, None)):
        client.new_generation()
        seqs, reqs = [], []
        for seq_id in range(4):
            verify = rows(GAMMA, 40 + 10 * step_id + seq_id)
            a = (seq_id + step_id) % GAMMA
            tokens = tuple(range(30, 31 + a))
            at = pos[seq_id] + (1 if seq_id == bad else 0)  # a gap: StateConflict
            seqs.append(wire.SeqStep(seq_id, stash=client.shm(verify), commit=wire.CommitOp(a + 1, at, tokens), trim=a))
            if seq_id != bad:
                twin.commit_verified(seq_id, verify, a, pos[seq_id], tokens)
                pos[seq_id] += a + 1
            reqs.append(ProposeRequest(seq_id, 50 + seq_id, pos[seq_id], 3))
        result = client.step(wire.StepBatch(step_id, seqs=seqs, proposes=reqs, draft_columns=columns),
                             columns=columns)
        assert {e.seq_id: e.code for e in result.errors} == ({} if bad is None else {bad: "FAILED_PRECONDITION"})
        good = [r for r in reqs if r.seq_id != bad]
        same([result.proposals[r.seq_id] for r in good], twin.propose(good), twin)
    assert calls == [4, 4]  # tried together both times; the first fell back to one by one
    client.close_stream()


def test_a_second_step_stream_of_one_client_is_refused(env):
    client = env.client("target-a")
    client.open()
    assert client.step(wire.StepBatch(1)).step_id == 1
    with pytest.raises(grpc.RpcError) as info:
        next(client.stub.Step(iter([drafter_pb2.StepRequest(step_id=1)]), metadata=client.metadata, timeout=10))
    assert info.value.code() is grpc.StatusCode.ALREADY_EXISTS
    assert client.step(wire.StepBatch(2)).step_id == 2
    client.close_stream()


def test_targets_past_max_targets_are_refused_until_one_leaves(env):
    _, server_obj, channel = env.start(max_targets=1)
    first, second = (Client(channel, name, env.exporter) for name in ("target-a", "target-b"))
    first.open()
    assert first.step(wire.StepBatch(1)).step_id == 1
    with pytest.raises(grpc.RpcError) as info:
        next(second.stub.Step(iter([drafter_pb2.StepRequest(step_id=1)]), metadata=second.metadata, timeout=10))
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-targets" in info.value.details()
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING  # spare threads answer while full
    first.close_stream()
    wait_until(lambda: server_obj.num_streams == 0)
    assert server_obj.num_sessions == 0  # the refused target's buffers were freed with its session
    second = Client(channel, "target-b", env.exporter)  # it reconnects afresh, as RemoteProposer does
    second.open()
    assert second.step(wire.StepBatch(1)).step_id == 1
    second.close_stream()
    with pytest.raises(InvalidRequest):
        DrafterServer(env.twin, head=None, device="cpu", max_targets=0)


def test_a_connection_without_a_stream_is_freed_once_idle(env):
    drafter, server_obj, channel = env.start(idle_seconds=0.3)
    gone, streaming = (Client(channel, name, env.exporter) for name in ("target-gone", "target-streaming"))
    gone.call("AllocState", wire.alloc_to_proto(0, BUDGET))  # then it dies before opening its stream
    streaming.call("AllocState", wire.alloc_to_proto(0, BUDGET))
    streaming.open()
    assert streaming.step(wire.StepBatch(1)).step_id == 1  # its stream is open on the drafter now
    assert server_obj.num_sessions == 2 and len(drafter.store) == 2
    time.sleep(0.5)
    fresh = Client(channel, "target-new", env.exporter)  # any call sweeps: the idle, stream-less one goes
    assert server_obj.num_sessions == 2 and len(drafter.store) == 1
    assert streaming.step(wire.StepBatch(2)).step_id == 2  # an idle stream is a live connection
    assert fresh.code("FreeState", drafter_pb2.FreeStateRequest(seq_id=0)) == "NOT_FOUND"
    streaming.close_stream()


# ---- sessions ------------------------------------------------------------------------------------


def test_two_clients_with_the_same_seq_id_do_not_collide(env):
    a, b, twin = env.client("target-a"), env.client("target-b"), env.twin
    alloc_prefill(a, twin, 0, [1, 2, 3, 4], seed=1, twin_id=100)
    alloc_prefill(b, twin, 0, [5, 6, 7], seed=2, twin_id=200)
    same(propose_unary(a, [ProposeRequest(0, 9, 4, 3)]), twin.propose([ProposeRequest(100, 9, 4, 3)]), twin)
    same(propose_unary(b, [ProposeRequest(0, 9, 3, 3)]), twin.propose([ProposeRequest(200, 9, 3, 3)]), twin)

    # One client's carried KV and sequences are invisible to the other.
    handle = a.call("TakeDrafterKV", drafter_pb2.TakeDrafterKVRequest(seq_id=0)).handle
    assert b.code("InstallDrafterKV", drafter_pb2.InstallDrafterKVRequest(seq_id=0, handle=handle)) == "NOT_FOUND"
    assert b.code("FreeDrafterKV", drafter_pb2.FreeDrafterKVRequest(handle=handle)) == "NOT_FOUND"
    carried = a.call("InstallDrafterKV", drafter_pb2.InstallDrafterKVRequest(seq_id=0, handle=handle))
    assert (carried.rows, carried.last_position) == (4, 3)
    a.call("FreeState", drafter_pb2.FreeStateRequest(seq_id=0))
    assert b.code("AllocState", wire.alloc_to_proto(0, BUDGET)) == "ALREADY_EXISTS"
    same(propose_unary(b, [ProposeRequest(0, 9, 3, 3)]), twin.propose([ProposeRequest(200, 9, 3, 3)]), twin)


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("how", ["close", "cancel"])
def test_ending_the_stream_frees_the_session(env, how):
    client, other, twin = env.client("target-a"), env.client("target-b"), env.twin
    alloc_prefill(other, twin, 0, [1, 2], seed=9, twin_id=100)
    for seq_id in range(3):
        alloc_prefill(client, twin, seq_id, [3, 4, 5], seed=seq_id)
    client.call("TakeDrafterKV", drafter_pb2.TakeDrafterKVRequest(seq_id=1))
    client.open()
    assert list(client.step(wire.StepBatch(1, proposes=[ProposeRequest(0, 6, 3, 2)])).proposals) == [0]
    assert len(env.drafter.store) == 4 and env.drafter.store.num_carried == 1
    if how == "close":
        client.close_stream()
    else:
        client.responses.cancel()
    wait_until(lambda: len(env.drafter.store) == 1 and env.server.num_sessions == 1)
    assert env.drafter.store.num_carried == 0
    # The client's buffers are unmapped with it: a new session under the same id starts empty.
    assert client.code("Propose", wire.propose_to_proto([ProposeRequest(0, 6, 3, 2)])) == "NOT_FOUND"
    client.call("AllocState", wire.alloc_to_proto(0, BUDGET))
    assert client.code("Stash", wire.stash_to_proto(0, client.shm(rows(1, 1)))) == "INVALID_ARGUMENT"


def test_close_frees_every_session(env):
    a, b, twin = env.client("target-a"), env.client("target-b"), env.twin
    alloc_prefill(a, twin, 0, [1, 2], seed=1)
    alloc_prefill(b, twin, 0, [1, 2], seed=2, twin_id=100)
    alloc_prefill(b, twin, 1, [1, 2], seed=3, twin_id=101)
    b.call("TakeDrafterKV", drafter_pb2.TakeDrafterKVRequest(seq_id=1))
    env.server.close()
    assert len(env.drafter.store) == 0 and env.drafter.store.num_carried == 0 and env.server.num_sessions == 0


# ---- the target head -----------------------------------------------------------------------------


def test_target_head_is_bound_from_registered_buffers(env):
    true_head = TargetHead.random(INFO, seed=11)
    drafter, _, channel = env.start(server_head=None, drafter_head=TargetHead.random(INFO, seed=12))
    twin = make_drafter(true_head)
    client = Client(channel, "target-a", env.exporter)
    desc = wire.description_from_proto(client.call("Describe", drafter_pb2.DescribeDrafterRequest()))
    assert desc.needs_target_head
    alloc_prefill(client, twin, 0, [1, 2, 3], seed=4)
    req = [ProposeRequest(0, 5, 3, 3, want_confidence=True)]
    assert client.code("Propose", wire.propose_to_proto(req)) == "FAILED_PRECONDITION"

    wrong = env.exporter.create(INFO.vocab_size, INFO.hidden_size + 1, role=BufferRole.TARGET_EMBEDDING)
    assert client.code("RegisterBuffers", drafter_pb2.RegisterBuffersRequest(
        buffers=[wire.descriptor_to_proto(wrong.describe())])) == "INVALID_ARGUMENT"
    embed = env.exporter.export_existing(true_head.embed, BufferRole.TARGET_EMBEDDING)
    lm_head = env.exporter.export_existing(true_head.lm_head, BufferRole.TARGET_LM_HEAD)
    client.call("RegisterBuffers", drafter_pb2.RegisterBuffersRequest(
        buffers=[wire.descriptor_to_proto(b.describe()) for b in (embed, lm_head)]))
    same(propose_unary(client, req), twin.propose(req), twin)
    # Over shared memory the drafter copies the head once at registration: it never maps a client's file
    # (one that shrinks would kill it with SIGBUS); over CUDA IPC it views the target's buffer in place.
    embed.tensor[0].fill_(3.0)
    assert torch.equal(drafter.head.embed[1], true_head.embed[1])
    assert not torch.equal(drafter.head.embed[0], embed.tensor[0])

    client.call("ReleaseBuffers", drafter_pb2.ReleaseBuffersRequest(buffer_ids=[embed.buffer_id, lm_head.buffer_id]))
    assert client.code("Propose", wire.propose_to_proto(req)) == "FAILED_PRECONDITION"


def test_step_stream_wire_codes_are_numeric(env):
    """SeqError codes travel as google.rpc numbers (the proto's contract)."""
    client = env.client("target-a")
    client.open()
    client.outbox.put(wire.step_to_proto(wire.StepBatch(1, seqs=[wire.SeqStep(3, trim=0)])))
    reply = next(client.responses)
    assert [(e.seq_id, e.code) for e in reply.errors] == [(3, CODE["NOT_FOUND"])]
    client.close_stream()


def test_an_overdue_step_answer_detaches_within_its_deadline(monkeypatch, serve_remote):
    """The target's engine thread reads Step answers itself: a drafter that stops answering must still
    release it at the deadline (the client's watchdog cancels the stream), and a late answer must not be
    taken for a later step's."""
    frozen = threading.Event()
    step = Session.step

    def slow_step(self, *args, **kwargs):
        if frozen.is_set():
            time.sleep(1.5)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Session, "step", slow_step)
    drafter = make_drafter()
    server_obj, proposer = serve_remote(drafter, timeout=0.4)
    proposer.alloc(1, BUDGET)
    proposer.prefill(1, [3, 4], rows(2, 0))
    assert len(proposer.propose([ProposeRequest(1, 4, 2, 2)])[0].tokens) == 2
    frozen.set()
    started = time.monotonic()
    with pytest.raises(DrafterUnavailable, match="no step answer within 0.4 s"):
        proposer.propose([ProposeRequest(1, 4, 2, 2)])
    assert time.monotonic() - started < 1.2
    assert proposer.link.answer_seconds[-1] == 0.4  # counted, so a drafter slower for good raises its deadline
    assert not proposer.available()  # detached; re-attaches after the backoff


def test_a_remote_drafter_takes_a_steps_commits_in_one_call(serve_remote):
    """`RemoteProposer.commit_verified_many` (what the engine calls after a verify) stages the verify's
    rows once and queues each sequence's stash + commit + trim: the drafter ends as the direct calls
    leave a twin, sequences left out of the call (and rows around theirs) untouched."""
    drafter, twin = make_drafter(), make_drafter()
    server_obj, proposer = serve_remote(drafter, max_batch=4)
    pos = {}
    for seq_id in range(3):
        prompt, r = [3 + seq_id, 4, 5], rows(3, seq_id)
        for d in (proposer, twin):
            d.alloc(seq_id, BUDGET)
            d.prefill(seq_id, prompt, r)
        pos[seq_id] = 3
    for step, chosen in enumerate(([0, 1, 2], [2, 0], [1])):
        verify = rows(3 * GAMMA + 1, 100 + step)  # one row before the first sequence's: left alone
        starts = {seq_id: 1 + GAMMA * seq_id for seq_id in range(3)}
        accepted = {seq_id: (seq_id + step) % GAMMA for seq_id in range(3)}
        tokens = {seq_id: list(range(20, 21 + accepted[seq_id])) for seq_id in range(3)}
        proposer.commit_verified_many(chosen, verify, [starts[s] for s in chosen], [GAMMA] * len(chosen),
                                      [accepted[s] for s in chosen], [pos[s] for s in chosen],
                                      [tokens[s] for s in chosen])
        for s in chosen:
            twin.commit_verified(s, verify[starts[s]:starts[s] + GAMMA], accepted[s], pos[s], tokens[s])
            pos[s] += accepted[s] + 1
        reqs = [ProposeRequest(s, 7, pos[s], GAMMA - 1) for s in range(3)]
        same(proposer.propose(reqs), twin.propose(reqs), twin)


def test_commits_sent_ahead_are_answered_before_the_rows_are_staged_again(monkeypatch, serve_remote):
    """`send_pending` (a step that proposes nothing) sends the queued commits without waiting; the answer
    is read before the connection is used again, so the next step's rows (staged into the same buffer)
    never overwrite rows the drafter has not read. Several such steps in a row, then a propose: the
    drafter equals a twin called directly. A drafter slow to apply them is waited for, not overtaken."""
    step = Session.step

    def slow_step(self, *args, **kwargs):
        time.sleep(0.05)  # the target stages the next rows meanwhile, unless it waits for this answer
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Session, "step", slow_step)
    drafter, twin = make_drafter(), make_drafter()
    server_obj, proposer = serve_remote(drafter, max_batch=4)
    for d in (proposer, twin):
        for seq_id in range(2):
            d.alloc(seq_id, BUDGET)
            d.prefill(seq_id, [3 + seq_id, 4, 5], rows(3, seq_id))
    pos = 3
    for step_no in range(4):  # steps without drafts: one row each, a catch-up as a one-row commit
        verify = rows(2, 200 + step_no)
        proposer.commit_verified_many([0, 1], verify, [0, 1], [1, 1], [0, 0], [pos, pos], [[9], [10]])
        proposer.send_pending()
        assert proposer._unanswered and not proposer._pending
        for s in range(2):
            twin.commit_verified(s, verify[s:s + 1], 0, pos, [9 + s])
        pos += 1
    reqs = [ProposeRequest(s, 7, pos, GAMMA - 1) for s in range(2)]
    same(proposer.propose(reqs), twin.propose(reqs), twin)
    assert not proposer._unanswered
    proposer.send_pending()  # nothing queued: nothing sent
    assert not proposer._unanswered


@pytest.mark.parametrize("step_socket", [False, True], ids=["grpc", "socket"])
def test_prefetched_drafts_equal_a_twins_and_only_changed_requests_cost_a_round_trip(step_socket, serve_remote):
    """`prefetch` sends the step's commits with the next step's proposes; `propose` takes the drafts of
    the requests asked again unchanged from that answer and sends only the rest. Every draft equals
    a twin's called directly, whatever was taken, dropped or asked again."""
    drafter, twin = make_drafter(), make_drafter()
    server_obj, proposer = serve_remote(drafter, max_batch=4, step_socket=step_socket)
    sends = []
    send = proposer._send
    proposer._send = lambda conn, proposes, **kw: (sends.append([r.seq_id for r in proposes])
                                                   or send(conn, proposes, **kw))
    pos = {}
    for d in (proposer, twin):
        for seq_id in range(3):
            d.alloc(seq_id, BUDGET)
            d.prefill(seq_id, [3 + seq_id, 4, 5], rows(3, seq_id))
    pos = {seq_id: 3 for seq_id in range(3)}
    live = [0, 1, 2]
    for step in range(4):
        verify = rows(len(live) * GAMMA, 300 + step)
        accepted = {s: (s + step) % GAMMA for s in live}
        tokens = {s: list(range(20, 21 + accepted[s])) for s in live}
        proposer.commit_verified_many(live, verify, [GAMMA * i for i in range(len(live))], [GAMMA] * len(live),
                                      [accepted[s] for s in live], [pos[s] for s in live], [tokens[s] for s in live])
        for i, s in enumerate(live):
            twin.commit_verified(s, verify[GAMMA * i:GAMMA * (i + 1)], accepted[s], pos[s], tokens[s])
            pos[s] += accepted[s] + 1
        ahead = [ProposeRequest(s, 7 + s, pos[s], GAMMA - 1) for s in live]
        sends.clear()
        proposer.prefetch(ahead)
        assert sends == [live] and proposer._unanswered and not proposer._pending
        if step == 1:  # a sequence finishes between the steps: its free rides on the next message
            live = [0, 1]
            proposer.free(2)
            assert proposer._unanswered  # (a free is queued: it waits for no answer)
            twin.free(2)
        asked = [ProposeRequest(s, 7 + s, pos[s], GAMMA - 1 if step != 2 or s else 1) for s in live]
        taken_before = proposer.link.drafts_ahead
        same(proposer.propose(asked), twin.propose(asked), twin)
        changed = [r.seq_id for r in asked if r.num_drafts != GAMMA - 1]
        assert sends[1:] == ([changed] if changed else []), sends
        assert proposer.link.drafts_ahead - taken_before == len(asked) - len(changed)
    proposer.flush()  # the free left with the last propose, or leaves now
    assert 2 not in drafter.store


def test_an_allocation_left_for_its_prefill_goes_alone_before_any_other_call_and_a_free_drops_it(serve_remote):
    """`alloc` to a drafter whose PrefillDrafter allocates sends nothing: the sequence's prefill allocates it.
    Any other call first sends it as an AllocState; a sequence freed before its prefill was never there."""
    drafter = make_drafter()
    server_obj, proposer = serve_remote(drafter, max_batch=4)
    proposer.alloc(0, BUDGET)
    assert not drafter.store
    proposer.alloc(1, BUDGET)  # another call: sequence 0's allocation goes first, on its own
    assert len(drafter.store) == 1
    proposer.prefill(1, [3, 4, 5], rows(3, 1))
    proposer.prefill(0, [3, 4, 5], rows(3, 0))
    assert len(drafter.store) == 2 and proposer.link.unary_calls == {"AllocState": 1, "PrefillDrafter": 2}
    proposer.alloc(2, BUDGET)
    proposer.free(2)
    proposer.flush()
    proposer.alloc(3, BUDGET)
    proposer.prefill(3, [3, 4], rows(2, 3))
    assert len(drafter.store) == 3 and proposer.link.unary_calls == {"AllocState": 1, "PrefillDrafter": 3}
    assert [len(p.tokens) for p in proposer.propose([ProposeRequest(s, 7, n, GAMMA - 1)
                                                     for s, n in ((0, 3), (1, 3), (3, 2))])] == [GAMMA - 1] * 3


def test_an_allocation_refused_on_another_calls_behalf_is_its_own_sequences_refusal(serve_remote):
    """An allocation left for a prefill and sent alone before another sequence's call: refused, that call goes
    on, and the refusal is raised by the refused sequence's own prefill (the engine then decodes that one
    without speculation, and only that one)."""
    drafter = make_drafter()
    _, proposer = serve_remote(drafter, limits={"max_rows": 3 * BUDGET // 2}, max_batch=4)
    proposer.alloc(0, BUDGET)
    proposer.prefill(0, [3, 4, 5], rows(3, 0))
    proposer.alloc(1, BUDGET)  # no room for its rows: refused when it goes...
    proposer.alloc(2, BUDGET // 4)  # ... alone, before this one
    proposer.prefill(2, [3, 4], rows(2, 2))
    with pytest.raises(CapacityExceeded, match="--max-rows"):
        proposer.prefill(1, [3, 4], rows(2, 1))
    assert len(drafter.store) == 2 and proposer.available()
    asked = [ProposeRequest(0, 7, 3, GAMMA - 1), ProposeRequest(2, 7, 2, GAMMA - 1)]
    assert [len(p.tokens) for p in proposer.propose(asked)] == [GAMMA - 1] * 2


def test_a_sequence_refused_room_that_queued_frees_would_give_is_allocated_once_they_are_sent(serve_remote):
    """Frees ride on the next Step, which a new sequence's prefill (a unary call) overtakes: refused for room
    while frees are queued, it is sent again after them, not refused for good."""
    drafter = make_drafter()
    _, proposer = serve_remote(drafter, limits={"max_sequences": 1}, max_batch=4)
    proposer.alloc(0, BUDGET)
    proposer.prefill(0, [3, 4, 5], rows(3, 0))
    proposer.free(0)  # queued
    steps = len(proposer.link.step_seconds)
    proposer.alloc(1, BUDGET)
    assert proposer.prefill(1, [3, 4], rows(2, 1)) == 2
    assert len(drafter.store) == 1 and len(proposer.link.step_seconds) == steps + 1  # the frees' Step
    assert proposer.link.unary_calls["PrefillDrafter"] == 3  # the refused try included


def test_answers_to_steps_sent_ahead_set_the_step_deadline(serve_remote):
    """With proposes sent ahead nearly every answer is read after other work, not waited for; they
    must still teach the deadline, or a frozen drafter holds the engine for the whole --drafter-timeout
    (a slow test with a SIGSTOPped drafter found it)."""
    drafter = make_drafter()
    server_obj, proposer = serve_remote(drafter, max_batch=4, timeout=30.0)
    proposer.alloc(0, BUDGET)
    proposer.prefill(0, [3, 4, 5], rows(3, 0))
    pos = 3
    for step in range(drafter_client.STEP_DEADLINE_MIN_SAMPLES + 5):
        proposer.commit_verified_many([0], rows(GAMMA, step), [0], [GAMMA], [1], [pos], [[7, 8]])
        pos += 2
        request = [ProposeRequest(0, 9, pos, GAMMA - 1)]
        proposer.prefetch(request)
        assert len(proposer.propose(request)[0].tokens) == GAMMA - 1
    assert proposer.link.drafts_ahead == drafter_client.STEP_DEADLINE_MIN_SAMPLES + 5
    assert len(proposer.link.answer_seconds) >= drafter_client.STEP_DEADLINE_MIN_SAMPLES
    # not the 30 s timeout: the floor, or 20 times the slowest answer where one was slow (a loaded CI host
    # once took 0.14 s for one of them)
    slowest = max(proposer.link.answer_seconds)
    assert proposer.step_deadline() == max(drafter_client.STEP_DEADLINE_FLOOR,
                                           drafter_client.STEP_DEADLINE_FACTOR * slowest) < 30.0


def test_a_refusal_of_commits_sent_ahead_drops_the_connection_not_the_next_call(serve_remote):
    """The answer to commits sent ahead is read by whatever call comes next; if the drafter refused them,
    that call fails as the drafter being unavailable (the engine detaches and re-attaches), not with the
    earlier step's error as if it were its own (an alloc would read as the drafter refusing a new sequence)."""
    drafter = make_drafter()
    server_obj, proposer = serve_remote(drafter, max_batch=4)
    proposer.alloc(0, BUDGET)
    proposer.prefill(0, [3, 4, 5], rows(3, 0))
    proposer.commit_verified_many([0], rows(1, 1), [0], [1], [0], [7], [[9]])  # position 7: not next (3)
    proposer.send_pending()
    with pytest.raises(DrafterUnavailable, match="refused a Step sent ahead"):
        proposer.alloc(1, BUDGET)
    assert not proposer._unanswered and not proposer.available()  # dropped; re-attaches after the backoff


@pytest.mark.parametrize("step_socket", [False, True], ids=["grpc", "socket"])
def test_verified_entries_go_straight_into_columns_as_the_seqstep_path_would_pack_them(monkeypatch, step_socket,
                                                                                        serve_remote):
    """The client writes a step's verified sequences into the message's columns without SeqStep objects;
    the message equals the one the SeqStep path builds, a sequence with more to do (a free) beside them."""
    drafter = make_drafter()
    server_obj, proposer = serve_remote(drafter, max_batch=4, step_socket=step_socket)
    assert proposer.step_transport == ("socket" if step_socket else "grpc")
    for seq_id in range(3):
        proposer.alloc(seq_id, BUDGET)
        proposer.prefill(seq_id, [3 + seq_id, 4, 5], rows(3, seq_id))
    proposer.commit_verified_many([0, 1, 2], rows(3 * GAMMA, 9), [0, GAMMA, 2 * GAMMA], [GAMMA] * 3,
                                  [2, 0, 1], [3, 3, 3], [[20, 21, 22], [23], [24, 25]])
    proposer.free(1)  # sequence 1 now also frees: it cannot ride in the columns
    conn = proposer._live()
    assert conn.columns
    pending = dict(proposer._pending)
    sent = []
    if step_socket:
        send_frame = drafter_client.frames.send_frame
        def client_send(sock, payload):  # the drafter's thread in this process answers through it too
            if threading.current_thread() is threading.main_thread():
                sent.append(drafter_pb2.StepRequest.FromString(payload))
            send_frame(sock, payload)
        monkeypatch.setattr(drafter_client.frames, "send_frame", client_send)
    else:
        put = conn.outbox.put
        conn.outbox.put = lambda pb: sent.append(pb) or put(pb)
    proposer.flush()
    monkeypatch.undo()
    steps = tuple(RemoteProposer._seq_step(conn, seq_id, p) for seq_id, p in pending.items())
    expected = wire.step_to_proto(wire.StepBatch(sent[0].step_id, steps, draft_columns=True), columns=True)
    got = sent[0]
    assert list(got.verified.seq_ids) == [0, 2] and [s.seq_id for s in got.seqs] == [1]
    assert got == expected


@pytest.mark.parametrize("which", ["rows", "unknown"])
def test_a_step_naming_a_buffer_that_holds_no_drafts_is_refused(env, which):
    """StepRequest.drafts_buffer must name a DRAFTS buffer this client registered: a rows buffer (its
    feature rows would be overwritten with ids) or an unknown id ends the stream with INVALID_ARGUMENT."""
    client = env.client(f"target-{which}")
    client.open()
    buffer_id = client.buffer.buffer_id if which == "rows" else 999
    client.outbox.put(wire.step_to_proto(wire.StepBatch(1, drafts_buffer=buffer_id)))
    with pytest.raises(grpc.RpcError) as info:
        next(client.responses)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert ("not a drafts buffer" if which == "rows" else "not registered") in info.value.details()


def test_drafts_answered_in_a_buffer_the_step_did_not_offer_detach_the_drafter(monkeypatch, serve_remote):
    """A drafter that says its drafts are in a buffer the Step did not offer (here: a CPU target, which
    offers none) is out of contract: the client drops it instead of reading anything."""
    step = Session.step

    def lying(self, batch, errors=()):
        result = step(self, batch, errors)
        return wire.StepResult(result.step_id, {}, result.errors,
                               tuple((s, len(p.tokens)) for s, p in result.proposals.items()))

    monkeypatch.setattr(Session, "step", lying)
    drafter = make_drafter()
    server_obj, proposer = serve_remote(drafter, max_batch=4)
    proposer.alloc(0, BUDGET)
    proposer.prefill(0, [3, 4, 5], rows(3, 0))
    with pytest.raises(DrafterUnavailable, match="did not offer"):
        proposer.propose([ProposeRequest(0, 7, 3, GAMMA - 1)])
    assert proposer._conn is None


def test_a_steps_phases_split_the_commit_into_rows_and_context(env, monkeypatch):
    """Session.last_phases: the time resolving row references (`rows`) and the batched context forward at
    the block's end (`context`) are told apart from the rest of the commit."""
    session = env.server._get_or_create("target-phases", streaming=True)
    buffer = env.exporter.create(16, FEATURE_DIM)
    session.register([buffer.describe()])
    session.alloc(0, BUDGET)
    buffer.tensor[:3] = rows(3, 0)
    session.prefill(0, wire.RowsOp((3, 4, 5), buffer.ref(0, 3), 0))
    resolve, appends = Session._resolve, type(env.drafter).append_rows_batch

    def slow_resolve(self, source):
        time.sleep(0.2)
        return resolve(self, source)

    def slow_appends(self, batch):
        time.sleep(0.4)
        return appends(self, batch)

    monkeypatch.setattr(Session, "_resolve", slow_resolve)
    monkeypatch.setattr(type(env.drafter), "append_rows_batch", slow_appends)
    buffer.bump()
    buffer.tensor[:GAMMA] = rows(GAMMA, 1)
    buffer.record()
    step = wire.SeqStep(0, stash=buffer.ref(0, GAMMA), commit=wire.CommitOp(2, 3, (7, 8)), trim=1)
    result = session.step(wire.StepBatch(1, (step,), (ProposeRequest(0, 8, 5, GAMMA - 1),)))
    assert not result.errors and result.proposals
    phases = session.last_phases
    # each sleep shows in its own phase and not in the commit's (whose own work takes ~1 ms here)
    assert phases.rows >= 0.2 and phases.context >= 0.4 and phases.commit < 0.2, phases


def test_a_call_naming_another_drafter_process_is_refused_and_opens_nothing(env):
    """Describe names this drafter process; a call that names another (a connection made to a drafter
    that has since restarted at this address) is refused with UNAVAILABLE, and opens no session."""
    client = env.client("target-restart")
    desc = wire.description_from_proto(client.call("Describe", drafter_pb2.DescribeDrafterRequest()))
    assert desc.instance == env.server.instance and len(desc.instance) == 32
    assert wire.description_from_proto(client.call("Describe", drafter_pb2.DescribeDrafterRequest())).instance \
        == desc.instance
    sessions = env.server.num_sessions
    stale = Client.__new__(Client)
    stale.stub = client.stub
    stale.metadata = ((CLIENT_HEADER, "target-stale"), (INSTANCE_HEADER, "0" * 32))
    assert stale.code("AllocState", wire.alloc_to_proto(0, BUDGET)) == "UNAVAILABLE"
    with pytest.raises(grpc.RpcError) as info:
        next(stale.stub.Step(iter([drafter_pb2.StepRequest(step_id=1)]), metadata=stale.metadata, timeout=10))
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    assert env.server.num_sessions == sessions
    good = ((CLIENT_HEADER, "target-stale"), (INSTANCE_HEADER, desc.instance))
    client.stub.AllocState(wire.alloc_to_proto(0, BUDGET), metadata=good, timeout=10)
    assert env.server.num_sessions == sessions + 1


def test_a_remote_proposer_does_not_carry_its_connection_over_to_a_restarted_drafter(tmp_path):
    """A drafter restarted at the same address: the target's next call on its old connection is refused
    (the engine then re-attaches from scratch), and the new drafter holds nothing of it."""
    address = f"unix:{tmp_path}/d.sock"
    first = make_drafter()
    server_obj = DrafterServer(first, head=first.head, device="cpu")
    server = serve(server_obj, [address])
    proposer = RemoteProposer(address, max_batch=4, step_socket=False)
    try:
        proposer.alloc(0, BUDGET)
        proposer.prefill(0, [3, 4, 5], rows(3, 0))
        server.stop(None)
        server_obj.close()
        second = make_drafter()
        server_obj = DrafterServer(second, head=second.head, device="cpu")
        server = serve(server_obj, [address])
        # the window this guards: the old stream's end not yet seen when a unary call goes out (a drafter
        # killed and forked again within milliseconds, as the chaos tests do)
        time.sleep(0.2)
        proposer._conn.dead, proposer._conn.error = False, None
        with pytest.raises(DrafterUnavailable):
            proposer.alloc(1, BUDGET)  # (it goes with the prefill after it)
            proposer.prefill(1, [3, 4, 5], rows(3, 0))
        assert server_obj.num_sessions == 0 and not second.store
    finally:
        proposer.close()
        server.stop(None)
        server_obj.close()


class _Gate:
    """Stands in for a target's CUDA IPC write event: done once opened."""

    def __init__(self) -> None:
        self.open, self.queries = False, 0

    def done(self) -> bool:
        self.queries += 1
        return self.open


def _two_targets_one_gated(env, server, channel) -> tuple[Client, Client, _Gate]:
    """Targets A and B, each with a sequence prefilled and its Step stream open; A's row buffer is read as a
    CUDA view behind its event, a gate that stays shut until opened."""
    a, b = Client(channel, "target-a", env.exporter), Client(channel, "target-b", env.exporter)
    for seed, client in enumerate((a, b)):
        alloc_prefill(client, make_drafter(), 0, [3, 14, 15], seed=seed)
        client.open()
    imported = server._sessions["target-a"].importer._buffers[a.buffer.buffer_id]
    gate = _Gate()
    imported.tensor, imported.event = a.buffer.tensor, gate
    return a, b, gate


@pytest.mark.parametrize("finish", [True, False], ids=["writes-done-late", "writes-never-done"])
def test_a_target_whose_gpu_writes_are_pending_waits_alone(env, finish):
    """A Step whose rows lie in a CUDA buffer the target has not finished writing (its IPC event; here a
    gate stands for it) waits for them outside the drafter lock: another target's Steps are answered
    meanwhile. Done late, the waiting Step is answered as usual; never done, its stream alone ends with
    DEADLINE_EXCEEDED after --writes-wait-seconds, its session is freed, and the other target goes on."""
    _, server, channel = env.start(writes_wait_seconds=10.0 if finish else 0.5)
    a, b, gate = _two_targets_one_gated(env, server, channel)

    def verify_step(client: Client, step_id: int) -> wire.StepBatch:
        client.new_generation()
        stash = client.shm(rows(GAMMA, 40 + step_id))
        pos = 3 + 2 * (step_id - 1)
        return wire.StepBatch(step_id, (wire.SeqStep(0, stash=stash, commit=wire.CommitOp(2, pos, (7, 8)), trim=1),),
                              (ProposeRequest(0, 8, pos + 2, GAMMA - 1),))

    done = threading.Event()
    answer: dict = {}

    def step_a() -> None:
        try:
            answer["result"] = a.step(verify_step(a, 1))
        except grpc.RpcError as err:
            answer["error"] = err
        done.set()

    threading.Thread(target=step_a, daemon=True).start()
    wait_until(lambda: gate.queries > 3)  # A's Step is polling its event
    for step_id in (1, 2):  # B is served while A waits
        result = b.step(verify_step(b, step_id))
        assert not result.errors and result.proposals
    assert not done.is_set()
    if finish:
        gate.open = True
        assert done.wait(10) and "result" in answer
        assert not answer["result"].errors and answer["result"].proposals
    else:
        assert done.wait(10) and "error" in answer
        assert answer["error"].code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "not done within 0.5 s" in answer["error"].details()
        wait_until(lambda: "target-a" not in server._sessions)
        result = b.step(verify_step(b, 3))
        assert not result.errors and result.proposals


def test_a_head_whose_writes_are_pending_is_never_read_and_waited_for_outside_the_lock(env):
    """A target head in 'CUDA' buffers (a gate stands for their event): a propose checks it under the lock
    and refuses (DEADLINE_EXCEEDED) while the writes are pending; the unary Propose's wait before the lock
    ends with them done, and then the head is used."""
    true_head = TargetHead.random(INFO, seed=11)
    _, server, channel = env.start(server_head=None, drafter_head=TargetHead.random(INFO, seed=12),
                                   writes_wait_seconds=0.3)
    twin = make_drafter(true_head)
    client = Client(channel, "target-h", env.exporter)
    alloc_prefill(client, twin, 0, [1, 2, 3], seed=4)
    embed = env.exporter.export_existing(true_head.embed, BufferRole.TARGET_EMBEDDING)
    lm_head = env.exporter.export_existing(true_head.lm_head, BufferRole.TARGET_LM_HEAD)
    client.call("RegisterBuffers", drafter_pb2.RegisterBuffersRequest(
        buffers=[wire.descriptor_to_proto(b.describe()) for b in (embed, lm_head)]))
    session = server._sessions["target-h"]
    gate = _Gate()
    for buffer in (embed, lm_head):
        session.importer._buffers[buffer.buffer_id].event = gate
    req = [ProposeRequest(0, 5, 3, 3, want_confidence=True)]
    assert client.code("Propose", wire.propose_to_proto(req)) == "DEADLINE_EXCEEDED"  # waited 0.3 s, not done
    with pytest.raises(WritesPending):
        with server._lock:
            session.propose(req)  # under the lock: a check, never a wait
    threading.Timer(0.1, lambda: setattr(gate, "open", True)).start()
    same(propose_unary(client, req), twin.propose(req), twin)  # the wait outside the lock saw them done


def test_one_call_of_a_connection_waits_for_its_writes_at_a_time(env):
    """While one call of a connection waits for its GPU writes, a second one is refused at once: a target
    cannot park every server thread on writes that never finish."""
    _, server, channel = env.start(writes_wait_seconds=5.0)
    client = Client(channel, "target-w", env.exporter)
    alloc_prefill(client, make_drafter(), 0, [3, 14, 15], seed=0)
    session = server._sessions["target-w"]
    gate = _Gate()
    imported = session.importer._buffers[client.buffer.buffer_id]
    imported.tensor, imported.event = client.buffer.tensor, gate
    first = threading.Thread(target=lambda: session.await_writes([client.buffer.buffer_id]), daemon=True)
    first.start()
    wait_until(lambda: gate.queries > 3)
    with pytest.raises(WritesPending, match="already waiting"):  # at once, not after 5 s of its own wait
        session.await_writes([client.buffer.buffer_id])
    gate.open = True
    first.join(5)
    assert not first.is_alive()
    session.await_writes([client.buffer.buffer_id])  # done now: no wait, no slot needed


class _Drafts:
    """Stands in for a retired drafts RowBuffer: its importer's last work done or not (or unqueryable)."""

    def __init__(self, done) -> None:
        self.done = done

    def await_importer(self, wait: float) -> bool:
        if isinstance(self.done, Exception):
            raise self.done
        return self.done


def test_a_closed_connections_drafts_buffer_lives_until_the_drafters_work_on_it_is_done():
    """The last RETIRED_DRAFTS_BUFFERS are kept whatever; older ones only while the drafter's last
    recorded work on them is not seen done (a drafter given up for never finishing it would otherwise
    write into freed, perhaps reused, memory); an unqueryable event counts as never done."""
    from types import SimpleNamespace

    keep = drafter_client.RETIRED_DRAFTS_BUFFERS
    pending, broken = _Drafts(False), _Drafts(DrafterUnavailable("bad handle"))
    done = [_Drafts(True) for _ in range(keep + 2)]
    flag = object()  # a DONE buffer lives as long as its connection's drafts buffer (the value is written first)
    proposer = SimpleNamespace(_retired=[])
    for buffer in [pending, done[0], broken, *done[1:]]:
        RemoteProposer._retire(proposer, buffer, flag if buffer is pending else None)
    assert proposer._retired == [(pending, (flag,)), (broken, (None,)), *[(d, (None,)) for d in done[-keep:]]]
    pending.done = True
    RemoteProposer._retire(proposer, _Drafts(True))
    kept = [drafts for drafts, _ in proposer._retired]
    assert kept[0] is broken and pending not in kept and all(flag not in f for _, f in proposer._retired)
    assert len(proposer._retired) == keep + 1


def test_a_unary_call_whose_rows_are_pending_fails_alone_and_frees_nothing(env):
    """A unary Stash whose rows lie behind a pending event waits for them outside the lock (it polls, and
    another target's call is served meanwhile): done late, the Stash goes through; never done, it ends
    DEADLINE_EXCEEDED after --writes-wait-seconds and the connection keeps its sequence."""
    _, server, channel = env.start(writes_wait_seconds=3.0)
    a, b = Client(channel, "target-u", env.exporter), Client(channel, "target-v", env.exporter)
    for seed, client in enumerate((a, b)):
        alloc_prefill(client, make_drafter(), 0, [3, 14, 15], seed=seed)
    imported = server._sessions["target-u"].importer._buffers[a.buffer.buffer_id]
    for late in (True, False):
        gate = _Gate()
        imported.tensor, imported.event = a.buffer.tensor, gate
        a.new_generation()
        stash = wire.stash_to_proto(0, a.shm(rows(GAMMA, 7)))
        result: dict = {}

        def call() -> None:
            try:
                a.call("Stash", stash)
                result["code"] = "OK"
            except grpc.RpcError as err:
                result["code"] = err.code().name

        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        wait_until(lambda: gate.queries > 3)  # polling, not refused at the first query
        assert propose_unary(b, [ProposeRequest(0, 8, 3, GAMMA - 1)])  # served while A's Stash waits
        gate.open = late
        thread.join(10)
        assert result["code"] == ("OK" if late else "DEADLINE_EXCEEDED")
        assert server._sessions["target-u"].num_sequences == 1


@pytest.mark.parametrize("between", [False, True], ids=["nothing-between", "a-call-between"])
def test_a_chained_step_is_prepared_before_its_writes_and_launched_after_them(env, monkeypatch, between):
    """A chained Step message (a propose sent ahead, `Session.prepare_chain`) is prepared under the lock as it
    arrives, while the target's writes into its rows are pending (a gate stands for their CUDA event), and
    launched once they are done. A unary call of the same connection while the Step waits counts as a call
    between (`Session.turns`): the launch refuses it (FAILED_PRECONDITION), that stream alone ends, and
    another target is served throughout. (What the launch checks: tests/test_remote_chain.py.)"""
    from specsplit.shared.errors import StateConflict

    _, server, channel = env.start(writes_wait_seconds=10.0)
    a, b, gate = _two_targets_one_gated(env, server, channel)
    seen = []

    def prepare(session, batch):  # a stand-in for the real preparation (CUDA only): what the server does around it
        seen.append(("prepared", gate.open))
        turn = session.turns

        def launch():
            seen.append(("launched", gate.open))
            if session.turns != turn:
                raise StateConflict("another call of this connection ran between")
            return wire.StepResult(batch.step_id, {}, (), ())

        return PreparedLaunch(launch, device_waited=False)

    monkeypatch.setattr(Session, "prepare_chain", prepare)
    a.new_generation()
    chain = wire.ChainStep(commit_seq_ids=(0,), commit_rows=1, rows=a.shm(rows(1, 9)), feed=a.buffer.ref(1, 3))
    done = threading.Event()
    answer: dict = {}

    def step_a() -> None:
        try:
            answer["result"] = a.step(wire.StepBatch(1, chain=chain))
        except grpc.RpcError as err:
            answer["error"] = err
        done.set()

    threading.Thread(target=step_a, daemon=True).start()
    wait_until(lambda: gate.queries > 3)  # A's Step waits for its writes, prepared already
    assert seen == [("prepared", False)]
    if between:
        a.call("AllocState", wire.alloc_to_proto(1, BUDGET))
    assert not b.step(wire.StepBatch(1, proposes=(ProposeRequest(0, 8, 3, GAMMA - 1),))).errors
    gate.open = True
    assert done.wait(10) and seen == [("prepared", False), ("launched", True)]
    if between:
        assert answer["error"].code() is grpc.StatusCode.FAILED_PRECONDITION
        wait_until(lambda: "target-a" not in server._sessions)
    else:
        assert answer["result"].step_id == 1 and not answer["result"].errors
    assert not b.step(wire.StepBatch(2, proposes=(ProposeRequest(0, 8, 3, GAMMA - 1),))).errors


def test_a_device_waited_chained_step_is_launched_as_it_arrives(env, monkeypatch):
    """Drafter --device-waits: a prepared launch whose stream waits for the target's writes on the device
    (`PreparedLaunch.device_waited`) is called at once, the target's writes still pending (the gate
    stays shut), and answered; the host waits for none of them, unless more than one launch waits on the
    device already (a target that never writes may not queue launches without end): then the host waits
    for the writes first. (The launch itself: tests/test_remote_chain.py.)"""
    _, server, channel = env.start(writes_wait_seconds=10.0)
    a, b, gate = _two_targets_one_gated(env, server, channel)
    waits = server._sessions["target-a"].waits = _PendingWaits()
    waits.pending_now = 1  # (one launch queued behind a wait already: this one goes at once too)
    seen = []

    def prepare(session, batch):
        seen.append(("prepared", gate.open))
        return PreparedLaunch(lambda: seen.append(("launched", gate.open)) or wire.StepResult(batch.step_id, {}, (), ()),
                              device_waited=True)

    monkeypatch.setattr(Session, "prepare_chain", prepare)
    a.new_generation()
    chain = wire.ChainStep(commit_seq_ids=(0,), commit_rows=1, rows=a.shm(rows(1, 9)), feed=a.buffer.ref(1, 3))
    result = a.step(wire.StepBatch(1, chain=chain))
    assert result.step_id == 1 and not result.errors
    assert seen == [("prepared", False), ("launched", False)] and not gate.open

    waits.pending_now = 2  # two launches queued behind waits already: this one waits for the writes on the host
    seen.clear()
    answered = threading.Event()
    threading.Thread(target=lambda: a.step(wire.StepBatch(2, chain=chain)) and answered.set(), daemon=True).start()
    wait_until(lambda: gate.queries > 3)
    assert seen == [("prepared", False)] and not answered.is_set()
    gate.open = True
    assert answered.wait(10) and seen == [("prepared", False), ("launched", True)]


class _PendingWaits:
    """Stands for a session's DeviceWaits with one wait pending until `done` is set (or never, for `drain`'s timeout)."""

    def __init__(self) -> None:
        self.done, self.drains, self.failure = threading.Event(), [], None
        self.pending_now: int | None = None  # (a count to report instead)

    @property
    def pending(self) -> int:
        if self.pending_now is not None:
            return self.pending_now
        return 0 if self.done.is_set() else 1

    def drain(self, timeout: float) -> bool:
        self.drains.append(timeout)
        return self.done.wait(min(timeout, 2.0))

    def close(self) -> None:
        self.done.set()

    def join(self) -> None:
        pass


@pytest.mark.slow  # (4-5 s on the CPU: the default run stays under five minutes)
def test_work_waits_until_no_stream_waits_on_the_device(env):
    """--device-waits: any call but a prepared launch (here another target's unary call and Step) is held,
    under the lock, until the waiting session's stream waits for nothing (`DrafterServer._quiesce`): a
    kernel module loaded while a stream waits would hang the process. Waits not done even past their
    deadline fail the call (DEADLINE_EXCEEDED), not the server; a session closing releases its own first."""
    _, server, channel = env.start(writes_wait_seconds=0.5)
    a, b, _ = _two_targets_one_gated(env, server, channel)
    for call in (lambda: b.call("AllocState", wire.alloc_to_proto(1, BUDGET)),  # a unary call ...
                 lambda: b.step(wire.StepBatch(1, proposes=(ProposeRequest(0, 8, 3, GAMMA - 1),)))):  # ... and a Step
        waits = server._sessions["target-a"].waits = _PendingWaits()
        answered = threading.Event()

        def run(call=call, answered=answered) -> None:
            call()
            answered.set()

        threading.Thread(target=run, daemon=True).start()
        wait_until(lambda: waits.drains)
        assert not answered.wait(0.3)  # held while A's stream waits
        waits.done.set()
        assert answered.wait(10)
    waits = server._sessions["target-a"].waits = _PendingWaits()  # pending past its deadline: the call fails
    with pytest.raises(grpc.RpcError) as raised:
        b.call("AllocState", wire.alloc_to_proto(2, BUDGET))
    assert raised.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED and "device waits" in raised.value.details()
    assert waits.drains == [5.5]
    server._end(server._sessions["target-b"])  # another session is freed even while A's waits never end
    assert "target-b" not in server._sessions and waits.drains == [5.5, 5.5]
    server._end(server._sessions["target-a"])  # (closing releases its own waits: nothing drained for it)
    assert waits.done.is_set() and waits.drains == [5.5, 5.5]


def test_a_wait_its_watchdog_released_fails_that_targets_calls_and_ends_its_stream_at_its_next_step(env):
    """--device-waits: once a session's watchdog has released a wait (the target never wrote its value: what
    the step behind it read may have been half written), its calls of any kind fail with DEADLINE_EXCEEDED,
    and its next Step ends its Step stream; another target goes on."""
    _, server, channel = env.start()
    a, b, _ = _two_targets_one_gated(env, server, channel)
    waits = server._sessions["target-a"].waits = _PendingWaits()
    waits.done.set()
    waits.failure = "the target did not write a chained step's written value within its deadline"
    with pytest.raises(grpc.RpcError) as raised:
        a.call("AllocState", wire.alloc_to_proto(1, BUDGET))
    assert raised.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED and "written value" in raised.value.details()
    with pytest.raises(grpc.RpcError) as raised:
        a.step(wire.StepBatch(1, proposes=(ProposeRequest(0, 8, 3, GAMMA - 1),)))
    assert raised.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: "target-a" not in server._sessions)
    assert not b.step(wire.StepBatch(1, proposes=(ProposeRequest(0, 8, 3, GAMMA - 1),))).errors


def test_device_waits_are_offered_only_to_one_target_with_prepared_graphs_on_a_gpu(monkeypatch):
    """DrafterDescription.written_flags: --device-waits, --max-targets 1, prepared chained graphs, and a
    GPU whose stream can wait on a value; and --device-waits is refused at the command line without them."""
    from specsplit.drafter_service import server as server_module
    from specsplit.services import DrafterSettings

    class Proposer:
        spec = None

    monkeypatch.setattr(server_module, "chains", lambda proposer: True)
    monkeypatch.setattr(server_module, "done_flags", lambda device: True)
    server = DrafterServer(Proposer(), head=None, device="cpu", max_targets=1)
    try:
        assert not server.written_flags  # (off by default)
        server.device_waits = True
        assert server.written_flags
        for name, value in (("prepare_chains", False), ("chain_graphs", False), ("max_targets", 2)):
            kept = getattr(server, name)
            setattr(server, name, value)
            assert not server.written_flags, name
            setattr(server, name, kept)
        monkeypatch.setattr(server_module, "done_flags", lambda device: False)
        assert not server.written_flags
    finally:
        server.close()
    setup = LocalSetup(drafter="dflash", device="cpu")
    with pytest.raises(InvalidRequest, match="--max-targets 1"):
        DrafterSettings(("unix:/tmp/x.sock",), setup, device_waits=True)
    for changed in ({"prepare_chains": False}, {"chain_graphs": False}):
        with pytest.raises(InvalidRequest):
            DrafterSettings(("unix:/tmp/x.sock",), setup, limits=DrafterLimits(max_targets=1), device_waits=True, **changed)
    assert DrafterSettings(("unix:/tmp/x.sock",), setup, limits=DrafterLimits(max_targets=1), device_waits=True).device_waits
