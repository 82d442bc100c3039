"""The engine in a process of its own (`target serve --engine-process`): the same tokens, refusals and status
codes as the engine in the front end's process, and a front end that outlives its engine's death cleanly."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch
from prometheus_client import generate_latest

from raw_client import RawClient
from specsplit.local import LocalSetup
from specsplit.protos.v1 import target_pb2
from specsplit.services import DrafterSettings, TargetSettings, build_engine, start_drafter, start_target
from specsplit.shared import wire
from specsplit.shared.errors import CheckpointError, InvalidRequest, SpecsplitError
from specsplit.shared.sampling import SamplingParams
from specsplit.shared.serving import wait_healthy
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.engine_process import EngineDied, EngineProcess, _portable
from specsplit.target_service.metrics import TargetMetrics
from specsplit.target_service.model import load_target
from specsplit.target_service.sequence import Request
from test_metrics import parse, value

PROMPT = [1, 5, 9, 200, 17, 33]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_chat_dir):
    """A random DFlash drafter in this process, and a target whose engine runs in a process of its own."""
    folder = tmp_path_factory.mktemp("engine_process")
    drafter_addr, target_addr = f"unix:{folder}/d.sock", f"unix:{folder}/t.sock"
    drafter_obj, drafter_server = start_drafter(
        DrafterSettings((drafter_addr,), LocalSetup(target=str(tiny_chat_dir), drafter="random-dflash")))
    loop, target_server = start_target(TargetSettings((target_addr,), LocalSetup(target=str(tiny_chat_dir)),
                                                      drafter_addr, EngineConfig(kv_blocks=64),
                                                      engine_process=True))
    client = RawClient(target_addr)
    yield loop, client
    client.close()
    target_server.stop(grace=1).wait()
    loop.stop()
    drafter_server.stop(grace=1).wait()
    drafter_obj.close()


def reference(tiny_chat_dir, params: SamplingParams) -> list[int]:
    engine = Engine(load_target(tiny_chat_dir, dtype=torch.float32), None, EngineConfig())
    return [t for e in engine.generate([Request("ref", PROMPT, params)])["ref"] for t in e.token_ids]


def test_speculative_tokens_equal_the_target_alone_and_the_engine_counts_them(served, tiny_chat_dir):
    loop, client = served
    assert isinstance(loop, EngineProcess) and loop.pid != os.getpid()
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    result = client.generate(PROMPT, params)
    assert list(result.token_ids) == reference(tiny_chat_dir, params)
    assert result.stats.drafted > 0  # the drafter was attached, over the engine's process's own connection
    samples = parse(generate_latest(TargetMetrics(loop.state, open_streams=lambda: 0).registry).decode())
    assert value(samples, "specsplit_target_tokens_total") >= 24
    assert value(samples, "specsplit_target_drafter_attached") == 1
    description = wire.target_description_from_proto(client.stub.Describe(target_pb2.DescribeTargetRequest(),
                                                                          timeout=30))
    assert description.drafter_kind is not None and description.vocab_size == loop.vocab_size


@pytest.mark.parametrize("prompt, max_tokens, code", [
    ([1, 10**7], 4, grpc.StatusCode.INVALID_ARGUMENT),  # a token outside the vocabulary
    ([1, 2], 10**6, grpc.StatusCode.INVALID_ARGUMENT),  # past the context length
], ids=["token", "context"])
def test_refusals_keep_their_status_codes(served, prompt, max_tokens, code):
    _, client = served
    request = wire.generate_to_proto(wire.GenerateCall(prompt=tuple(prompt), sampling=SamplingParams(
        max_tokens=max_tokens, ignore_eos=True)))
    with pytest.raises(grpc.RpcError) as info:
        list(client.stub.Generate(request, timeout=60))
    assert info.value.code() is code


def test_a_request_past_the_kv_cache_is_resource_exhausted(served):
    loop, client = served
    big = min(loop.context_length - 8, 64 * 16)  # the whole cache (64 blocks of 16), within the context
    request = wire.generate_to_proto(wire.GenerateCall(prompt=(1, 2, 3, 4), sampling=SamplingParams(
        max_tokens=big, ignore_eos=True)))
    with pytest.raises(grpc.RpcError) as info:
        list(client.stub.Generate(request, timeout=60))
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_cancelled_request_frees_its_id_and_the_engine_goes_on(served, tiny_chat_dir):
    loop, client = served
    request = wire.generate_to_proto(wire.GenerateCall(prompt=tuple(PROMPT), sampling=SamplingParams(
        max_tokens=400, ignore_eos=True), request_id="again"))
    call = client.stub.Generate(request, timeout=60)
    next(call)  # streaming
    call.cancel()
    deadline = time.monotonic() + 30
    while loop.busy or loop.state().running:
        assert time.monotonic() < deadline, "the cancelled request was never aborted in the engine's process"
        time.sleep(0.05)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    again = wire.generate_to_proto(wire.GenerateCall(prompt=tuple(PROMPT), sampling=params, request_id="again"))
    tokens = [t for chunk in client.stub.Generate(again, timeout=60) for t in chunk.token_ids]
    assert tokens == reference(tiny_chat_dir, params)


def test_a_build_that_fails_raises_its_error_in_the_front_end(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    settings = TargetSettings(("unix:unused",), LocalSetup(target=str(tmp_path)), None)
    with pytest.raises(CheckpointError):
        EngineProcess(functools.partial(build_engine, settings))


def test_streams_end_unavailable_when_the_engine_process_dies(tmp_path, tiny_chat_dir):
    address = f"unix:{tmp_path}/t.sock"
    loop, server = start_target(TargetSettings((address,), LocalSetup(target=str(tiny_chat_dir)), None,
                                               engine_process=True))
    client = RawClient(address)
    try:
        request = wire.generate_to_proto(wire.GenerateCall(prompt=tuple(PROMPT), sampling=SamplingParams(
            max_tokens=2000, ignore_eos=True)))
        call = client.stub.Generate(request, timeout=60)
        next(call)
        os.kill(loop.pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        assert loop.died.wait(10)
        with pytest.raises(grpc.RpcError) as info:  # and a later request is refused at once
            list(client.stub.Generate(request, timeout=60))
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        with pytest.raises(EngineDied):
            loop.state()
    finally:
        client.close()
        server.stop(grace=1).wait()
        loop.stop()


class _Unpicklable(Exception):
    def __init__(self, a, b):  # (Exception pickles args only: this one cannot be rebuilt from them)
        super().__init__(f"{a}/{b}")


def test_an_error_that_does_not_cross_the_pipe_goes_as_its_text():
    assert isinstance(_portable(InvalidRequest("bad")), InvalidRequest)
    replaced = _portable(_Unpicklable(1, 2))
    assert type(replaced) is SpecsplitError and "_Unpicklable: 1/2" in str(replaced)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _serve_target(tmp_path, tiny_chat_dir) -> tuple[subprocess.Popen, str, int]:
    """`specsplit target serve --engine-process` in a process of its own: (it, its address, its engine's pid)."""
    address = f"unix:{tmp_path}/t.sock"
    service = subprocess.Popen([sys.executable, "-m", "specsplit", "target", "serve", "--listen", address,
                                "--target", str(tiny_chat_dir), "--engine-process", "--drain-seconds", "1"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(address, timeout=120)
    except Exception:
        service.kill()
        raise AssertionError(service.communicate()[0])
    engines = _children(service.pid)
    assert len(engines) >= 1, "no engine process under the service"
    return service, address, engines[-1]


@pytest.mark.slow  # (two services started: about 20 s)
@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"),
                    reason="needs /proc/PID/task/PID/children")
def test_the_service_exits_when_its_engine_dies_and_stops_it_on_sigterm(tmp_path, tiny_chat_dir):
    service, address, engine = _serve_target(tmp_path, tiny_chat_dir)
    with RawClient(address) as client:
        assert len(client.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True)).token_ids) == 4
    os.kill(engine, signal.SIGKILL)
    output = service.communicate(timeout=60)[0]
    assert service.returncode != 0 and "engine process died" in output, output
    service, address, engine = _serve_target(tmp_path, tiny_chat_dir)
    service.send_signal(signal.SIGTERM)
    output = service.communicate(timeout=60)[0]
    assert service.returncode == 0, output
    assert not os.path.exists(f"/proc/{engine}") or open(f"/proc/{engine}/stat").read().split()[2] == "Z"
