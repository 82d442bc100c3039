"""A client that goes away mid-stream frees its sequence on both sides (services in one process).

The services serve a tiny random target with the default model's tokenizer (tests/conftest.py):
cancellation, drain, capacity and failover do not depend on the weights.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from tests.raw_client import RawClient
from specsplit.local import LocalSetup
from specsplit.services import DrafterSettings, TargetSettings, start_drafter, start_target
from specsplit.shared import wire
from specsplit.shared.sampling import SamplingParams
from specsplit.target_service.engine import EngineConfig
from specsplit.target_service.sequence import FinishReason


PROMPT = "Count from one to a thousand:"


@pytest.fixture
def pair(tmp_path, tiny_chat_dir):
    for drafter_obj, loop, client, target_server, _ in started_pair(tmp_path, str(tiny_chat_dir)):
        yield drafter_obj, loop, client, target_server


def started_pair(tmp_path, target: str, **target_settings):
    """A random DFlash drafter and `target` ("default" or a checkpoint folder), served in this process."""
    drafter_addr, target_addr = f"unix:{tmp_path}/d.sock", f"unix:{tmp_path}/t.sock"
    drafter_obj, drafter_server = start_drafter(
        DrafterSettings((drafter_addr,), LocalSetup(target=target, drafter="random-dflash")))
    loop, target_server = start_target(TargetSettings((target_addr,), LocalSetup(target=target), drafter_addr,
                                                      EngineConfig(), **target_settings))
    client = RawClient(target_addr)
    yield drafter_obj, loop, client, target_server, drafter_server
    client.close()
    target_server.stop(grace=1).wait()
    loop.stop()
    drafter_server.stop(grace=1).wait()
    drafter_obj.close()


def wait_until(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_cancelled_stream_frees_target_and_drafter_state(pair):
    drafter_obj, loop, client, _ = pair
    request = wire.generate_to_proto(
        wire.GenerateCall(PROMPT, SamplingParams(max_tokens=400, ignore_eos=True)))
    call = client.stub.Generate(request)
    next(call)  # the first tokens arrived: the sequence lives on both sides (an attach on the stream: soon)
    assert len(loop.engine.running) == 1 and wait_until(lambda: len(drafter_obj.proposer.store) == 1)
    call.cancel()
    with pytest.raises(grpc.RpcError):
        list(call)
    assert wait_until(lambda: not loop.engine.running and len(drafter_obj.proposer.store) == 0)
    # The service keeps serving.
    assert client.generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True)).token_ids


def test_a_free_rides_on_the_next_step_and_flush_sends_it(pair):
    drafter_obj, loop, client, _ = pair
    assert client.generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True)).token_ids
    assert wait_until(lambda: len(drafter_obj.proposer.store) == 0)  # the last free went out at once
    proposer, store = loop.engine.proposer, drafter_obj.proposer.store  # the engine is idle now
    steps = len(proposer.link.step_seconds)
    prompt = torch.randn(2, proposer.spec.feature_dim)
    proposer.alloc(1000, 64)
    proposer.free(1000)  # before its prefill (which allocates it): never at the drafter
    proposer.flush()
    assert len(proposer.link.step_seconds) == steps and len(store) == 0
    proposer.alloc(1000, 64)
    proposer.prefill(1000, [5, 6], prompt)
    proposer.free(1000)
    assert len(proposer.link.step_seconds) == steps and len(store) == 1  # queued, not sent
    proposer.alloc(1000, 64)  # a unary verb sends the sequence's queued free first
    assert len(proposer.link.step_seconds) == steps + 1 and len(store) == 0
    proposer.prefill(1000, [5, 6], prompt)
    assert len(store) == 1
    proposer.free(1000)
    proposer.flush()
    assert len(proposer.link.step_seconds) == steps + 2 and len(store) == 0
    proposer.flush()  # nothing queued: no round trip
    assert len(proposer.link.step_seconds) == steps + 2


def test_drain_finishes_streams_in_flight_and_refuses_new_ones(pair):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    drafter_obj, loop, client, served = pair
    call = client.stub.Generate(wire.generate_to_proto(
        wire.GenerateCall(PROMPT, SamplingParams(max_tokens=60, ignore_eos=True))))
    first = next(call)
    watch = health_pb2_grpc.HealthStub(client.channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    draining = threading.Thread(target=served.drain, args=(120,), daemon=True)
    draining.start()
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING  # watchers hear it first
    assert wait_until(lambda: _refused(client))  # new calls are turned away
    rest = [wire.chunk_from_proto(c) for c in call]  # the stream in flight runs to its end
    assert sum(len(c.token_ids) for c in [first, *rest]) == 60 and rest[-1].finish_reason == FinishReason.LENGTH
    draining.join(timeout=30)
    assert not draining.is_alive() and not loop.engine.running


def _refused(client: RawClient) -> bool:
    try:
        list(client.stub.Generate(wire.generate_to_proto(wire.GenerateCall("Hi", SamplingParams(max_tokens=1))),
                                  timeout=5))
    except grpc.RpcError as exc:
        return exc.code() == grpc.StatusCode.UNAVAILABLE
    return False


def test_streams_past_max_streams_are_refused_at_once(tmp_path, tiny_chat_dir):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    pair = started_pair(tmp_path, str(tiny_chat_dir), max_streams=1)
    drafter_obj, loop, client, _, _ = next(pair)
    try:
        call = client.stub.Generate(wire.generate_to_proto(
            wire.GenerateCall(PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))))
        next(call)
        with pytest.raises(grpc.RpcError) as info:
            list(client.stub.Generate(wire.generate_to_proto(wire.GenerateCall("Hi", SamplingParams(max_tokens=2))),
                                      timeout=10))
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-streams" in info.value.details()
        reply = health_pb2_grpc.HealthStub(client.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING  # spare threads answer while full
        call.cancel()
        assert wait_until(lambda: not loop.busy)
        assert client.generate("Hi", SamplingParams(max_tokens=2, ignore_eos=True)).token_ids
    finally:
        next(pair, None)


class Restartable:
    """A service pair whose drafter can be replaced by a new one at the same address."""

    def __init__(self, tmp_path, target: str) -> None:
        self.address, self.target = f"unix:{tmp_path}/d.sock", target
        self._pair = started_pair(tmp_path, target)
        self.drafter, self.loop, self.client, _, self._drafter_server = next(self._pair)
        self._replaced = False

    def restart_drafter(self):
        self._drafter_server.stop(None).wait()
        self.drafter.close()
        self.drafter, self._drafter_server = start_drafter(
            DrafterSettings((self.address,), LocalSetup(target=self.target, drafter="random-dflash")))
        self._replaced = True
        return self.drafter

    def close(self) -> None:
        if self._replaced:  # the pair's own teardown stops the first drafter
            self._drafter_server.stop(None).wait()
            self.drafter.close()
        next(self._pair, None)


@pytest.fixture
def restartable(tmp_path, tiny_chat_dir):
    services = Restartable(tmp_path, str(tiny_chat_dir))
    yield services
    services.close()


@pytest.fixture
def restartable_default(tmp_path):
    services = Restartable(tmp_path, "default")
    yield services
    services.close()


@pytest.mark.slow
def test_a_drafter_restart_mid_request_resumes_speculation_for_it(restartable_default):
    """The drafter dies while a long request runs; a new one comes up at the same address: the
    target re-attaches *that* request (re-captured rows) and the output equals target-only.

    On the default model, whose steps are slow enough that the request outlives the restart and the
    re-attach back-off on any machine; a tiny target could finish first. (test_engine's
    test_drafter_failure_is_not_request_failure re-attaches running requests in-process.)"""
    restartable = restartable_default
    client = restartable.client
    params = SamplingParams(max_tokens=160, ignore_eos=True)
    reference = client.generate(PROMPT, params, speculative=False).token_ids
    stream = client.stream(PROMPT, params)
    tokens = list(next(stream).token_ids)
    new = restartable.restart_drafter()
    saw_it = False
    for chunk in stream:
        tokens += chunk.token_ids
        saw_it = saw_it or len(new.proposer.store) == 1
    assert saw_it  # the running request was re-attached to the new drafter
    assert tokens == reference


def test_a_drafter_restart_while_idle_leaves_no_orphan_state(restartable):
    """The target notices nothing while idle; its next calls must not open a stream-less session on
    the new drafter under the old connection's id (it would hold the request's state until swept)."""
    client, loop = restartable.client, restartable.loop
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    reference = client.generate(PROMPT, params, speculative=False).token_ids
    assert client.generate(PROMPT, params).token_ids == reference
    new = restartable.restart_drafter()
    time.sleep(1.0)  # the old stream's end has reached the target
    assert client.generate(PROMPT, params).token_ids == reference
    assert wait_until(lambda: not loop.busy and len(new.proposer.store) == 0)
    assert new.num_sessions == new.num_streams  # every session on the new drafter has its stream


def test_re_attaching_to_a_hung_drafter_does_not_hold_the_engine(tmp_path, tiny_chat_dir):
    """A drafter that accepts connections but never answers: re-attach gives up in seconds, not
    after --drafter-timeout (here 600 s) per call, so the engine loop keeps serving."""
    from concurrent import futures

    from specsplit.protos.v1 import drafter_pb2_grpc
    from specsplit.target_service.drafter_client import RemoteProposer

    class Hung(drafter_pb2_grpc.DrafterServiceServicer):
        def Describe(self, request, context):
            release.wait(60)
            context.abort(grpc.StatusCode.UNAVAILABLE, "hung")

    address = f"unix:{tmp_path}/d.sock"
    drafter_obj, drafter_server = start_drafter(
        DrafterSettings((address,), LocalSetup(target=str(tiny_chat_dir), drafter="random-dflash")))
    proposer = RemoteProposer(address, timeout=600)
    drafter_server.stop(None).wait()
    drafter_obj.close()
    release = threading.Event()
    hung = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(Hung(), hung)
    hung.add_insecure_port(address)
    hung.start()
    try:
        proposer.reset()
        time.sleep(1.0)  # past the first back-off: the next available() really tries to re-attach
        answered = []
        probe = threading.Thread(target=lambda: answered.append(proposer.available()), daemon=True)
        probe.start()
        probe.join(timeout=30)
        assert answered == [False]
    finally:
        release.set()
        hung.stop(None)
        proposer.close()
