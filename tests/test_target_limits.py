"""Issue 9 on the target service: oversized requests are refused before they cost anything, a cancelled
prompt stops its prefill, the target serves whether or not its drafter answers (and says why not), and
a drafter that stops answering is given up on within seconds, not --drafter-timeout.

Everything runs in this process: tiny random targets, drafters served on unix sockets."""

from __future__ import annotations

import logging
import threading
import re
import time

import grpc
import pytest
import torch

from specsplit.client import ServiceError
from specsplit.drafter_service.server import CLIENT_HEADER
from specsplit.local import LocalSetup
from specsplit.protos.v1 import drafter_pb2, drafter_pb2_grpc
from specsplit.services import DrafterSettings, TargetSettings, start_drafter, start_target
from specsplit.shared import wire
from specsplit.shared.errors import DrafterUnavailable, InvalidRequest
from specsplit.shared.sampling import SamplingParams
from specsplit.target_service import drafter_client
from specsplit.target_service.drafter_client import RemoteProposer
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.loop import EngineLoop
from specsplit.target_service.model import load_target
from specsplit.target_service.sequence import Request
from tests.test_cancellation import RawClient, wait_until

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory, tiny_chat_dir):
    """A target service on the tiny chat model (tests/conftest.py), without a drafter."""
    address = f"unix:{tmp_path_factory.mktemp('target')}/t.sock"
    loop, server = start_target(TargetSettings((address,), LocalSetup(target=str(tiny_chat_dir)), None,
                                               EngineConfig()))
    client = RawClient(address)
    yield loop, client
    client.close()
    server.stop(None).wait()
    loop.stop()


def drafter_at(address: str, target_dir, **limits):
    """A random DFlash drafter for `target_dir` served at `address`: (DrafterServer, Served)."""
    from specsplit.drafter_service.limits import DrafterLimits

    return start_drafter(DrafterSettings((address,), LocalSetup(target=str(target_dir), drafter="random-dflash"),
                                         limits=DrafterLimits(**limits)))


def stop(pair) -> None:
    server_obj, served = pair
    served.stop(None).wait()
    server_obj.close()


# --- finding 6: oversized requests ------------------------------------------------------------------


def test_a_request_past_the_message_cap_is_refused_before_it_is_read(target):
    _, client = target
    with pytest.raises(grpc.RpcError) as info:
        client.stub.Generate(wire.generate_to_proto(wire.GenerateCall("a" * (5 << 20), GREEDY)), timeout=60).next()
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED  # gRPC's receive cap: never read


def test_a_prompt_longer_than_the_context_can_spell_is_refused_before_it_is_encoded(target, monkeypatch):
    loop, client = target
    servicer_tokenizer_calls = []
    from specsplit.shared.tokenizer import Tokenizer

    encode = Tokenizer.encode
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text, *a: (servicer_tokenizer_calls.append(len(text)),
                                                                      encode(self, text, *a))[1])
    context = loop.engine.model.config.max_position_embeddings
    with pytest.raises(ServiceError, match="INVALID_ARGUMENT: .*context length"):
        client.generate("x" * (context * 200), GREEDY)  # ~0.8 MB: under the message cap
    with pytest.raises(ServiceError, match="INVALID_ARGUMENT: .*context length"):
        client.generate([5] * (context + 1), GREEDY)
    assert not [n for n in servicer_tokenizer_calls if n > context * 100]  # never encoded
    assert client.generate("Hello", GREEDY).token_ids


@pytest.mark.parametrize("text", [" " * 5000, "\n" + " " * 4000, "#" * 3000, "=" * 2000 + "-" * 2000,
                                  "ÿ€𝐀" * 500, "a" * 10000, "\u0301" * 3000])
def test_no_text_is_shorter_in_tokens_than_the_byte_bound_says(smollm2_tokenizer, text):
    tokens = smollm2_tokenizer.encode(text)
    assert len(text.encode()) <= len(tokens) * smollm2_tokenizer.max_token_bytes


def test_stop_token_ids_outside_the_vocabulary_are_refused(target):
    _, client = target
    with pytest.raises(ServiceError, match="INVALID_ARGUMENT: .*stop_token_ids"):
        client.generate("Hello", SamplingParams(max_tokens=4, stop_token_ids=(49152,)))
    assert client.generate("Hello", SamplingParams(max_tokens=4, stop_token_ids=(49151,))).token_ids


def test_a_cancelled_prompt_stops_its_prefill_between_chunks(tiny_llama_dir):
    engine = Engine(load_target(tiny_llama_dir, dtype=torch.float32), None, EngineConfig(prefill_chunk=16))
    loop = EngineLoop(engine)
    chunks: list[str] = []
    forward = engine._forward

    def counted(seq_ids, inputs, starts, **kw):
        if len(inputs[0]) == 16:  # a prefill chunk of the long prompt
            chunks.append("long")
            if len(chunks) == 1:
                loop.cancel("long")  # its client goes away during the first chunk
        return forward(seq_ids, inputs, starts, **kw)

    engine._forward = counted
    try:
        long = loop.submit(Request("long", [7] * 200, SamplingParams(max_tokens=4)))
        assert long.get(timeout=30) is None
        short = loop.submit(Request("short", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)))
        events = [short.get(timeout=30) for _ in range(3)]
        assert events[-1].finish_reason is not None
        assert len(chunks) == 1  # not the 13 chunks of the whole prompt
        assert wait_until(lambda: not engine.running and not engine.waiting, 10)
        assert engine.cache.num_free_blocks == engine.cache.num_blocks  # its KV blocks were freed
    finally:
        loop.stop()


# --- finding 4: the target says why a drafter refused it --------------------------------------------


def test_a_full_drafter_is_named_as_the_reason_and_attached_once_it_has_room(tmp_path, tiny_llama_dir, caplog):
    address = f"unix:{tmp_path}/d.sock"
    pair = drafter_at(address, tiny_llama_dir, max_targets=1)
    channel = grpc.insecure_channel(address)
    squatter = drafter_pb2_grpc.DrafterServiceStub(channel).Step(_idle_stream(), metadata=((CLIENT_HEADER, "made-up"),))
    assert next(squatter).step_id == 1
    try:
        with caplog.at_level(logging.INFO):
            proposer = RemoteProposer(address, timeout=30)  # the target starts: it must not give up
        assert proposer.spec is None
        assert "RESOURCE_EXHAUSTED" in proposer.last_error and "--max-targets" in proposer.last_error
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any("--max-targets" in m for m in warned), warned
        squatter.cancel()
        assert wait_until(proposer.available, 20)
        assert proposer.spec is not None and proposer.last_error == ""
        proposer.close()
    finally:
        squatter.cancel()
        channel.close()
        stop(pair)


def _idle_stream():
    yield drafter_pb2.StepRequest(step_id=1)
    threading.Event().wait(600)  # then says nothing, holding its slot


def test_an_engine_wider_than_its_drafter_clients_staging_is_refused_at_construction(tmp_path, tiny_llama_dir):
    """A RemoteProposer stages the rows of up to its max_batch sequences a step: an engine stepping more would
    overflow it at its first wide step and drop the drafter for good measure. Refused at construction, with
    what to change; equal sizes are fine."""
    model = load_target(tiny_llama_dir, dtype=torch.float32)
    proposer = RemoteProposer(f"unix:{tmp_path}/none.sock", max_batch=3, timeout=5)  # (nobody listens: unattached)
    try:
        with pytest.raises(InvalidRequest, match="takes up to 3 sequences a step and the engine steps up to 4"):
            Engine(model, proposer, EngineConfig(max_batch=4))
        Engine(model, proposer, EngineConfig(max_batch=3))
    finally:
        proposer.close()


# --- finding 9: a drafter that is down when the target starts ---------------------------------------


def test_an_engine_whose_drafter_is_down_serves_and_speculates_once_it_appears(tmp_path, tiny_llama_dir):
    address = f"unix:{tmp_path}/d.sock"
    model = load_target(tiny_llama_dir, dtype=torch.float32)
    want = Engine(model, None).generate([Request("0", [5, 6, 7], GREEDY)])["0"]
    proposer = RemoteProposer(address, timeout=30)  # nobody listens there: returns unattached
    assert proposer.spec is None and proposer.last_error
    engine = Engine(model, proposer)
    try:
        events = engine.generate([Request("a", [5, 6, 7], GREEDY)])["a"]
        assert [t for e in events for t in e.token_ids] == [t for e in want for t in e.token_ids]
        assert events[-1].stats.drafted == 0
        pair = drafter_at(address, tiny_llama_dir)
        try:
            for i in range(100):
                events = engine.generate([Request(f"b{i}", [5, 6, 7], GREEDY)])[f"b{i}"]
                assert [t for e in events for t in e.token_ids] == [t for e in want for t in e.token_ids]
                if events[-1].stats.drafted > 0:
                    break
                time.sleep(0.1)
            assert events[-1].stats.drafted > 0
        finally:
            stop(pair)
    finally:
        proposer.close()


# --- finding 7: a drafter that stops answering ------------------------------------------------------


def test_the_step_deadline_follows_the_measured_round_trips():
    proposer = RemoteProposer.__new__(RemoteProposer)
    proposer.timeout, proposer.link = 60.0, drafter_client.LinkStats()
    assert proposer.step_deadline() == 60.0  # nothing measured yet
    proposer.link.answer_seconds.extend([0.01] * 300)
    assert proposer.step_deadline() == drafter_client.STEP_DEADLINE_FLOOR
    proposer.link.answer_seconds.extend([0.2] * 300)
    assert proposer.step_deadline() == pytest.approx(20 * 0.2)
    proposer.link.answer_seconds.extend([10.0] * 300)
    assert proposer.step_deadline() == 60.0  # capped by --drafter-timeout


def test_a_drafter_that_stops_answering_steps_is_given_up_on_within_seconds(tmp_path, tiny_llama_dir):
    address = f"unix:{tmp_path}/d.sock"
    pair = drafter_at(address, tiny_llama_dir)
    hang, released = threading.Event(), threading.Event()
    step = pair[0].proposer.propose

    def hung_propose(requests):
        if hang.is_set():
            released.wait(60)
        return step(requests)

    proposer = RemoteProposer(address, timeout=60)
    try:
        for _ in range(30):
            proposer.ping()
        proposer.alloc(0, 64)
        proposer.prefill(0, [5, 6, 7], torch.randn(3, proposer.spec.feature_dim), 0)
        pair[0].proposer.propose = hung_propose
        hang.set()
        from specsplit.shared.proposer import ProposeRequest

        with pytest.raises(DrafterUnavailable, match="no step answer") as info:
            proposer.propose([ProposeRequest(0, 8, 3, 3)])
        waited = float(re.search(r"within ([0-9.]+) s", str(info.value)).group(1))
        assert waited < 60  # the deadline measured from the pings, not the 60 s --drafter-timeout
    finally:
        released.set()
        proposer.close()
        stop(pair)


def test_inline_prefill_rows_go_in_pieces_under_the_drafter_message_cap(tmp_path, tiny_llama_dir, monkeypatch):
    address = f"unix:{tmp_path}/d.sock"
    pair = drafter_at(address, tiny_llama_dir, max_message_mib=0.03)
    monkeypatch.setattr(drafter_client, "choose_mode", lambda *a: "inline")
    monkeypatch.setattr(drafter_client, "INLINE_PREFILL_BYTES", 16 << 10)
    proposer = RemoteProposer(address, timeout=60)
    try:
        assert proposer.mode == "inline"
        rows = torch.randn(250, proposer.spec.feature_dim)
        assert rows.numel() * 4 > 0.03 * (1 << 20)  # more than one message may carry
        proposer.alloc(0, 256)
        assert proposer.prefill(0, [5] * 250, rows, 0) == 250
    finally:
        proposer.close()
        stop(pair)
