"""A client that goes away mid-stream frees its sequence on both sides (services in one process)."""

from __future__ import annotations

import time

import grpc
import pytest

from shared import wire
from shared.sampling import SamplingParams
from specsplit.local import LocalSetup
from specsplit.services import DrafterSettings, TargetSettings, start_drafter, start_target
from target_service.client import TargetClient
from target_service.engine import EngineConfig


@pytest.fixture
def pair(tmp_path):
    drafter_addr, target_addr = f"unix:{tmp_path}/d.sock", f"unix:{tmp_path}/t.sock"
    drafter_obj, drafter_server = start_drafter(DrafterSettings((drafter_addr,), LocalSetup(drafter="random-dflash")))
    loop, target_server = start_target(TargetSettings((target_addr,), LocalSetup(), drafter_addr, EngineConfig()))
    yield drafter_obj, loop, TargetClient(target_addr)
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
    drafter_obj, loop, client = pair
    request = wire.generate_to_proto(
        wire.GenerateCall("Count from one to a thousand:", SamplingParams(max_tokens=400, ignore_eos=True)))
    call = client.stub.Generate(request)
    next(call)  # the first tokens arrived: the sequence lives on both sides
    assert len(loop.engine.running) == 1 and len(drafter_obj.proposer.store) == 1
    call.cancel()
    with pytest.raises(grpc.RpcError):
        list(call)
    assert wait_until(lambda: not loop.engine.running and len(drafter_obj.proposer.store) == 0)
    # The service keeps serving.
    assert client.generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True))["token_ids"]


def test_a_free_rides_on_the_next_step_and_flush_sends_it(pair):
    drafter_obj, loop, client = pair
    assert client.generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True))["token_ids"]
    assert wait_until(lambda: len(drafter_obj.proposer.store) == 0)  # the last free went out at once
    proposer, store = loop.engine.proposer, drafter_obj.proposer.store  # the engine is idle now
    steps = len(proposer.link.step_seconds)
    proposer.alloc(1000, 64)
    proposer.free(1000)
    assert len(proposer.link.step_seconds) == steps and len(store) == 1  # queued, not sent
    proposer.alloc(1000, 64)  # a unary verb sends the sequence's queued free first
    assert len(proposer.link.step_seconds) == steps + 1 and len(store) == 1
    proposer.free(1000)
    proposer.flush()
    assert len(proposer.link.step_seconds) == steps + 2 and len(store) == 0
    proposer.flush()  # nothing queued: no round trip
    assert len(proposer.link.step_seconds) == steps + 2
