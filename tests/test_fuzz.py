"""Issue 9: descriptor-driven fuzzing of every RPC of both services, and raw garbage bytes.

Every request message is generated from its protobuf descriptor (protos/specsplit/v1/*.proto), field by
field with edge values of its type; ints lean towards small ids so that messages reach past the
id lookups into the verbs. Every reply must be OK or a status that names the caller's mistake, never
UNKNOWN, INTERNAL (a bug) or a timeout (a hang); afterwards the services still serve, a bystander's
drafts are unchanged and the target's speculative output equals target-only. Both services run in
this process (the tiny seeded DFlash of tests/test_drafter_server.py; the tiny chat target).
A few hundred messages in the default run, over ten thousand under `slow`.
"""

from __future__ import annotations

import collections
import math
import queue
import random

import grpc
import pytest
import torch
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message_factory

from specsplit.drafter_service.server import CLIENT_HEADER, DrafterServer, serve
from specsplit.protos.v1 import drafter_pb2, target_pb2
from specsplit.shared import wire
from specsplit.shared.proposer import ProposeRequest
from specsplit.shared.sampling import SamplingParams
from specsplit.shared.transport import BufferExporter, RowRef, encode_inline
from tests.test_buffer_security import Bystander, Peer
from tests.test_cancellation import started_pair
from tests.test_drafter_server import FEATURE_DIM, make_drafter

# What a fuzzed request may be answered with: the caller's mistake, told apart; OK when it was valid.
ALLOWED = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED",
           "ALREADY_EXISTS", "OUT_OF_RANGE"}
CALL_TIMEOUT = 30  # a reply later than this is a hang
T = pb_descriptor.FieldDescriptor
INT32 = (T.TYPE_INT32, T.TYPE_SINT32, T.TYPE_SFIXED32)
INT64 = (T.TYPE_INT64, T.TYPE_SINT64, T.TYPE_SFIXED64)
UINT = (T.TYPE_UINT32, T.TYPE_FIXED32, T.TYPE_UINT64, T.TYPE_FIXED64)


class Mutator:
    """Random messages of any descriptor: each field unset, small, an edge value or garbage of its type."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def message(self, desc: pb_descriptor.Descriptor, depth: int = 0):
        msg = message_factory.GetMessageClass(desc)()
        if desc.name == "InlineRows" and self.rng.random() < 0.5:
            return self.inline_rows(msg)
        for field in desc.fields:
            if self.rng.random() < 0.35 or (depth > 3 and field.type == T.TYPE_MESSAGE):
                continue
            if field.is_repeated:
                self.repeated(msg, field, depth)
            elif field.type == T.TYPE_MESSAGE:
                getattr(msg, field.name).CopyFrom(self.message(field.message_type, depth + 1))
            else:
                self.set(msg, field, self.scalar(field))
        return msg

    def repeated(self, msg, field, depth: int) -> None:
        roll = self.rng.random()
        n = 0 if roll < 0.2 else self.rng.randint(1, 4) if roll < 0.9 else self.rng.choice([64, 513, 5000])
        values = getattr(msg, field.name)
        if field.type == T.TYPE_MESSAGE:
            for _ in range(min(n, 70)):
                values.add().CopyFrom(self.message(field.message_type, depth + 1))
            return
        for _ in range(n):
            try:
                values.append(self.scalar(field))
            except (ValueError, TypeError):  # out of the field's range: the client library refuses it
                pass

    def set(self, msg, field, value) -> None:
        try:
            setattr(msg, field.name, value)
        except (ValueError, TypeError):
            pass

    def scalar(self, field):
        rng, t = self.rng, field.type
        if t in INT32:
            return rng.choice([0, 1, 2, 3, -1, 2**31 - 1, -2**31, rng.randint(0, 200), rng.randint(-2**31, 2**31 - 1)])
        if t in INT64:
            return rng.choice([0, 1, 2, 3, -1, 2**63 - 1, -2**63, 2**32, rng.randint(0, 5000),
                               rng.randint(-2**63, 2**63 - 1)])
        if t in UINT:
            top = 2**32 - 1 if t in (T.TYPE_UINT32, T.TYPE_FIXED32) else 2**64 - 1
            return rng.choice([0, 1, top, rng.randint(0, top)])
        if t in (T.TYPE_DOUBLE, T.TYPE_FLOAT):
            return rng.choice([0.0, -0.0, 1.0, -1.0, 0.5, math.nan, math.inf, -math.inf, 1e308, 5e-324,
                               3.4e38, rng.uniform(-10, 10)])
        if t == T.TYPE_BOOL:
            return rng.random() < 0.5
        if t == T.TYPE_ENUM:
            known = [v.number for v in field.enum_type.values]
            return rng.choice(known + [max(known) + 1, 99, -1, 2**31 - 1])
        if t == T.TYPE_STRING:
            return rng.choice(["", "a", "Hi", "é☃\U0001F600", "\0", "x" * rng.choice([100, 70000]),
                               "../../etc/passwd", "specsplit-1-0123456789abcdef", "<|im_end|>",
                               "".join(chr(rng.randint(32, 0xD7FF)) for _ in range(rng.randint(1, 40)))])
        if t == T.TYPE_BYTES:
            n = rng.choice([0, 1, 3, 15, 16, 63, 64, 65, 256, rng.randint(0, 4096)])
            return rng.randbytes(n)
        raise AssertionError(f"no generator for field type {t} ({field.full_name})")

    def mutate(self, msg, times: int):
        """`msg` (a valid request) with `times` fields, at any depth of its set submessages, fuzzed."""
        for _ in range(times):
            target, fields = msg, []
            while True:
                fields = list(target.DESCRIPTOR.fields)
                nested = [f for f in fields if f.type == T.TYPE_MESSAGE and not f.is_repeated
                          and target.HasField(f.name)]
                if not nested or self.rng.random() < 0.5:
                    break
                target = getattr(target, self.rng.choice(nested).name)
            field = self.rng.choice(fields)
            if field.is_repeated:
                if self.rng.random() < 0.3:
                    target.ClearField(field.name)
                self.repeated(target, field, 0)
            elif field.type == T.TYPE_MESSAGE:
                getattr(target, field.name).CopyFrom(self.message(field.message_type, 1))
            else:
                self.set(target, field, self.scalar(field))
        return msg

    def inline_rows(self, msg):
        """Rows whose header and data agree (or disagree by a little), so decoding gets past its checks."""
        rows, cols = self.rng.randint(0, 5), self.rng.choice([FEATURE_DIM, FEATURE_DIM, 1, 0, 64])
        msg.rows, msg.cols, msg.dtype = rows, cols, self.rng.choice([0, 1, 1, 2, 3])
        data = torch.randn(rows, cols, generator=torch.Generator().manual_seed(self.rng.randint(0, 1 << 30)))
        msg.data = data.numpy().tobytes()[: rows * cols * 4 + self.rng.choice([0, 0, 0, -1, 1])]
        return msg


def _code(err: grpc.RpcError) -> str:
    return err.code().name


class Tally:
    """Status codes seen per method; anything outside ALLOWED is kept with its details to report."""

    def __init__(self) -> None:
        self.codes: collections.Counter = collections.Counter()
        self.bad: list[tuple[str, str, str]] = []

    def add(self, method: str, code: str, details: str = "", allowed=ALLOWED) -> None:
        self.codes[(method, code)] += 1
        if code not in allowed:
            self.bad.append((method, code, details[:300]))

    @property
    def total(self) -> int:
        return sum(self.codes.values())

    def table(self) -> str:
        return "\n".join(f"{method:>22} {code:<20} {n}" for (method, code), n in sorted(self.codes.items()))


# --- the drafter ----------------------------------------------------------------------------------


@pytest.fixture
def drafter_served(tmp_path):
    drafter = make_drafter()
    server_obj = DrafterServer(drafter, head=drafter.head, device="cpu")
    address = f"unix:{tmp_path}/d.sock"
    served = serve(server_obj, [address])
    channel = grpc.insecure_channel(address)

    class Handle:  # what tests.test_buffer_security.Peer needs of a drafter
        pass

    handle = Handle()
    handle.address, handle.channel, handle.server = address, channel, server_obj
    yield handle
    channel.close()
    served.stop(None)
    server_obj.close()


def _metadata(rng: random.Random) -> tuple:
    roll = rng.random()
    if roll < 0.8:
        return ((CLIENT_HEADER, "fuzz"),)  # one caller, so state builds up and ids resolve
    if roll < 0.95:
        return ((CLIENT_HEADER, f"fuzz-{rng.randint(0, 30)}"),)
    return ()  # no client id at all


def _rows(rng: random.Random, n: int):
    return encode_inline(torch.randn(n, FEATURE_DIM, generator=torch.Generator().manual_seed(rng.randint(0, 999))))


def drafter_templates(rng: random.Random) -> dict:
    """A valid request per method, on sequence ids 0..3 of the fuzzing caller, for `Mutator.mutate`."""
    seq, n = rng.randint(0, 3), rng.randint(1, 4)
    tokens = tuple(rng.randint(1, 90) for _ in range(n))
    propose = ProposeRequest(seq, tokens[-1], rng.randint(0, 8), 3)
    return {
        "AllocState": lambda: wire.alloc_to_proto(seq, 64),
        "PrefillDrafter": lambda: wire.prefill_to_proto(seq, wire.RowsOp(tokens, _rows(rng, n), 0),
                                                        rng.choice((None, 64))),  # (64: it allocates the sequence)
        "Propose": lambda: wire.propose_to_proto([propose]),
        "Stash": lambda: wire.stash_to_proto(seq, _rows(rng, n)),
        "Commit": lambda: wire.commit_to_proto(seq, wire.CommitOp(n, rng.randint(0, 8), tokens)),
        "Trim": lambda: wire.trim_to_proto(seq, rng.randint(0, 3)),
        "Catchup": lambda: wire.catchup_to_proto(seq, wire.RowsOp(tokens, _rows(rng, n), rng.randint(0, 8))),
        "FreeState": lambda: drafter_pb2.FreeStateRequest(seq_id=seq),
        "TakeDrafterKV": lambda: drafter_pb2.TakeDrafterKVRequest(seq_id=seq),
        "InstallDrafterKV": lambda: drafter_pb2.InstallDrafterKVRequest(seq_id=seq, handle=rng.randint(1, 5)),
        "FreeDrafterKV": lambda: drafter_pb2.FreeDrafterKVRequest(handle=rng.randint(1, 5)),
        "ReleaseBuffers": lambda: drafter_pb2.ReleaseBuffersRequest(buffer_ids=[rng.randint(1, 3)]),
        "Step": lambda: _step(rng, seq, n, tokens, propose),
    }


def _step(rng: random.Random, seq: int, n: int, tokens: tuple, propose: ProposeRequest):
    """A Step message, half the time in columns (its rows then by reference, maybe into the caller's buffer)."""
    columns = rng.random() < 0.5
    rows = RowRef(rng.randint(1, 3), rng.randint(0, 12), n, rng.randint(0, 2)) if columns else _rows(rng, n)
    batch = wire.StepBatch(rng.randint(1, 9), seqs=(wire.SeqStep(
        seq, stash=rows, commit=wire.CommitOp(n, rng.randint(0, 8), tokens), trim=rng.randint(0, n)),),
        proposes=(propose,), draft_columns=columns)
    return wire.step_to_proto(batch, columns=columns)


def request_for(method, mutator: Mutator, rng: random.Random, templates: dict):
    """Half the time a valid request with one or two fields fuzzed (it reaches the verbs), else all random."""
    make = templates.get(method.name)
    if make is not None and rng.random() < 0.5:
        return mutator.mutate(make(), rng.choice([0, 1, 1, 2]))
    return mutator.message(method.input_type)


def fuzz_drafter(handle, count: int, seed: int, tally: Tally) -> None:
    service = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"]
    mutator, rng = Mutator(seed), random.Random(seed + 1)
    methods = list(service.methods)
    for _ in range(count):
        method = rng.choice(methods)
        metadata = _metadata(rng)
        if method.client_streaming:
            _fuzz_step(handle.channel, method, mutator, rng, metadata, tally)
            continue
        request = request_for(method, mutator, rng, drafter_templates(rng))
        call = handle.channel.unary_unary(f"/{service.full_name}/{method.name}",
                                          request_serializer=lambda m: m.SerializeToString(),
                                          response_deserializer=lambda b: b)
        try:
            call(request, metadata=metadata, timeout=CALL_TIMEOUT)
            tally.add(method.name, "OK")
        except grpc.RpcError as err:
            tally.add(method.name, _code(err), err.details() or "")


def _fuzz_step(channel, method, mutator: Mutator, rng: random.Random, metadata, tally: Tally) -> None:
    """A Step stream of a few fuzzed messages; the stream ends at its first error, as a target's would."""
    call = channel.stream_stream(f"/specsplit.v1.DrafterService/{method.name}",
                                 request_serializer=lambda m: m.SerializeToString(),
                                 response_deserializer=lambda b: b)
    outbox: queue.Queue = queue.Queue()
    responses = call(iter(outbox.get, None), metadata=metadata, timeout=CALL_TIMEOUT)
    try:
        for _ in range(rng.randint(1, 4)):
            outbox.put(request_for(method, mutator, rng, drafter_templates(rng)))
            next(responses)
            tally.add("Step (one message)", "OK")  # its sequences' own errors travel inside the reply
        outbox.put(None)
        for _ in responses:
            pass
        tally.add("Step", "OK")
    except grpc.RpcError as err:
        tally.add("Step", _code(err), err.details() or "")
    finally:
        outbox.put(None)
        responses.cancel()


def fuzz_raw(channel, services: dict[str, list[str]], count: int, seed: int, tally: Tally) -> None:
    """Bytes that are not a message of the method's type (random, truncated, or a valid other message)."""
    rng = random.Random(seed)
    paths = [f"/{service}/{m}" for service, methods in services.items() for m in methods]
    for _ in range(count):
        path = rng.choice(paths)
        payload = rng.choice([rng.randbytes(rng.randint(1, 300)), b"\xff" * rng.randint(1, 20),
                              b"\x0a\xff\xff\xff\xff\x0f", b"\x08" + b"\xff" * 10 + b"\x01"])
        try:
            if path.endswith("/Step") or path.endswith("/Generate"):
                stream = (channel.stream_stream if path.endswith("/Step") else channel.unary_stream)(path)
                list(stream(iter([payload]) if path.endswith("/Step") else payload,
                            metadata=((CLIENT_HEADER, "raw"),), timeout=CALL_TIMEOUT))
            else:
                channel.unary_unary(path)(payload, metadata=((CLIENT_HEADER, "raw"),), timeout=CALL_TIMEOUT)
            tally.add(path.rsplit("/", 1)[1] + " (raw)", "OK")
        except grpc.RpcError as err:
            tally.add(path.rsplit("/", 1)[1] + " (raw)", _code(err), err.details() or "")


def _drafter_methods() -> list[str]:
    return [m.name for m in drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].methods]


def _attached(peer: Peer) -> tuple[queue.Queue, object]:
    """Open `peer`'s Step stream, as a target does (a connection without one may be freed for others);
    the stream lasts as long as the returned call is referenced."""
    outbox: queue.Queue = queue.Queue()
    responses = peer.stub.Step(iter(outbox.get, None), metadata=peer.metadata)
    outbox.put(wire.step_to_proto(wire.StepBatch(1)))
    assert next(responses).step_id == 1
    return outbox, responses


def run_drafter_fuzz(handle, messages: int, raw: int, seed: int) -> Tally:
    peer = Peer(handle, "bystander")
    outbox, stream = _attached(peer)
    bystander = Bystander(peer)
    with BufferExporter() as exporter:  # the fuzzing caller has a real buffer its references may hit
        buffer = exporter.create(16, FEATURE_DIM)
        Peer(handle, "fuzz").register(buffer.describe())
        tally = Tally()
        fuzz_drafter(handle, messages, seed, tally)
        fuzz_raw(handle.channel, {"specsplit.v1.DrafterService": _drafter_methods()}, raw, seed, tally)
    print(f"\n{tally.total} messages fuzzed at the drafter:\n{tally.table()}")
    assert not tally.bad, tally.bad[:20]
    bystander.unharmed()  # the drafter still serves, and nobody else's state moved
    outbox.put(None)
    assert list(stream) == []
    return tally


def test_fuzzed_messages_get_a_proper_status_from_the_drafter(drafter_served):
    tally = run_drafter_fuzz(drafter_served, messages=240, raw=40, seed=0)
    assert tally.codes[("AllocState", "OK")] > 0  # the generator reaches valid requests too


@pytest.mark.slow
def test_ten_thousand_fuzzed_messages_at_the_drafter(drafter_served):
    run_drafter_fuzz(drafter_served, messages=9000, raw=1500, seed=1)


# --- the target -----------------------------------------------------------------------------------


@pytest.fixture
def target_pair(tmp_path, tiny_chat_dir):
    pair = started_pair(tmp_path, str(tiny_chat_dir))
    drafter_obj, loop, client, _, _ = next(pair)
    yield drafter_obj, loop, client
    next(pair, None)


def fuzz_target(client, count: int, seed: int, tally: Tally) -> None:
    """Generate streams are read for at most three chunks, then cancelled (a fuzzed max_tokens may be huge)."""
    service = target_pb2.DESCRIPTOR.services_by_name["TargetService"]
    mutator, rng = Mutator(seed), random.Random(seed + 1)
    for _ in range(count):
        method = rng.choice(list(service.methods))
        prompt = rng.choice(["Hi", "Count:", (5, 6, 7)])
        valid = wire.generate_to_proto(wire.GenerateCall(
            prompt, SamplingParams(max_tokens=rng.randint(1, 6)), chat=isinstance(prompt, str) and rng.random() < 0.3))
        request = request_for(method, mutator, rng, {"Generate": lambda: valid})
        if method.name == "Generate" and rng.random() < 0.7:
            request.sampling.max_tokens = rng.randint(1, 8)  # most run to their end
        path = f"/{service.full_name}/{method.name}"
        try:
            if method.server_streaming:
                stream = client.channel.unary_stream(path, request_serializer=lambda m: m.SerializeToString())
                call = stream(request, timeout=CALL_TIMEOUT)
                for i, _ in enumerate(call):
                    if i == 2:
                        call.cancel()
            else:
                client.channel.unary_unary(path, request_serializer=lambda m: m.SerializeToString())(
                    request, timeout=CALL_TIMEOUT)
            tally.add(method.name, "OK")
        except grpc.RpcError as err:
            ours = err.code() is grpc.StatusCode.CANCELLED and "Locally cancelled" in (err.details() or "")
            tally.add(method.name, "OK (cancelled)" if ours else _code(err), err.details() or "",
                      allowed=ALLOWED | {"OK (cancelled)"})


def run_target_fuzz(drafter_obj, loop, client, messages: int, raw: int, seed: int) -> Tally:
    tally = Tally()
    fuzz_target(client, messages, seed, tally)
    fuzz_raw(client.channel, {"specsplit.v1.TargetService": ["Generate", "Describe"]}, raw, seed, tally)
    print(f"\n{tally.total} messages fuzzed at the target:\n{tally.table()}")
    assert not tally.bad, tally.bad[:20]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = client.generate("Count from one to ten:", params, speculative=False).token_ids
    got = client.generate("Count from one to ten:", params)
    assert got.token_ids == want and got.stats.drafted > 0  # still speculating, still lossless
    return tally


def test_fuzzed_messages_get_a_proper_status_from_the_target(target_pair):
    run_target_fuzz(*target_pair, messages=60, raw=20, seed=0)


@pytest.mark.slow
def test_a_thousand_fuzzed_messages_at_the_target(target_pair):
    run_target_fuzz(*target_pair, messages=1200, raw=300, seed=1)
