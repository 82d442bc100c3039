"""specsplit.client against a target service in this process: streaming, cancellation, deadlines, retry
on UNAVAILABLE only before the first response, auth, asyncio, and arguments refused before any call.

The real service serves a tiny random target with the default model's tokenizer (tests/conftest.py);
behaviours that need a server to misbehave on cue (fail, then serve; stall after a token) use a
scripted TargetService on the same gRPC stack.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
import subprocess
import sys
import threading
from concurrent import futures

import grpc
import pytest

from specsplit.cli import main
from specsplit.client import AsyncClient, Client, Generation, Retry, ServiceError
from specsplit.local import LocalSetup
from specsplit.protos.v1 import target_pb2, target_pb2_grpc
from specsplit.services import TargetSettings, start_target
from specsplit.shared.errors import InvalidRequest
from specsplit.shared.sampling import SamplingParams
from specsplit.shared.security import ClientTLS, ServerSecurity, ServerTLS
from specsplit.target_service.engine import EngineConfig
from tests.test_cancellation import wait_until
from tests.test_security import free_port, write_pki

LONG = SamplingParams(max_tokens=200, ignore_eos=True)
FAST_RETRY = Retry(attempts=40, initial_backoff=0.05, max_backoff=0.5)


def serve_tiny(address: str, tiny_chat_dir, **settings):
    """The target service on the tiny model, without a drafter: (engine loop, served)."""
    return start_target(TargetSettings((address,), LocalSetup(target=str(tiny_chat_dir)), None, EngineConfig(),
                                       **settings))


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_chat_dir):
    address = f"unix:{tmp_path_factory.mktemp('client')}/t.sock"
    loop, server = serve_tiny(address, tiny_chat_dir)
    yield address, loop
    server.stop(grace=1).wait()
    loop.stop()


@pytest.fixture
def aborted(served, monkeypatch):
    """(request id, freed) of each abort the engine makes: a cancelled call's sequence freed before its end."""
    engine, calls = served[1].engine, []
    real = engine.abort

    def abort(request_id: str) -> bool:
        freed = real(request_id)
        calls.append((request_id, freed))
        return freed

    monkeypatch.setattr(engine, "abort", abort)
    return calls


@pytest.fixture
def client(served):
    with Client(served[0], timeout=120) as c:
        yield c


def test_stream_yields_chunks_as_they_come_and_generate_joins_them(client):
    chunks = list(client.stream("Count to ten:", SamplingParams(max_tokens=12, ignore_eos=True)))
    assert len(chunks) > 1 and all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == "length" and chunks[-1].stats.generated_tokens == 12
    whole = client.generate("Count to ten:", SamplingParams(max_tokens=12, ignore_eos=True))
    assert whole.token_ids == [t for c in chunks for t in c.token_ids] and len(whole.token_ids) == 12
    assert whole.text == "".join(c.text for c in chunks) and whole.finish_reason == "length"
    assert client.generate(list(whole.token_ids[:4]), SamplingParams(max_tokens=2)).stats.prompt_tokens == 4
    assert client.describe().vocab_size > 0


def test_closing_a_stream_cancels_the_call_and_frees_the_sequence(client, served, aborted):
    _, loop = served
    stream = client.stream("Count from one to a thousand:", LONG, request_id="closed")
    next(stream)
    assert len(loop.engine.running) == 1
    stream.close()
    assert list(stream) == []  # a closed stream just ends
    assert wait_until(lambda: aborted == [("closed", True)]) and not loop.engine.running


def test_cancel_from_another_thread_ends_the_stream_with_cancelled(client, served, aborted):
    _, loop = served
    stream = client.stream("Count from one to a thousand:", LONG, request_id="cancelled")
    next(stream)
    threading.Thread(target=stream.cancel).start()
    with pytest.raises(ServiceError) as info:
        list(stream)
    assert info.value.code is grpc.StatusCode.CANCELLED
    assert wait_until(lambda: aborted == [("cancelled", True)]) and not loop.engine.running


def test_bad_arguments_are_refused_before_any_call(client):
    for prompt, sampling in (("", None), ([], None), (["a"], None), ([1, -2], None), ([2**40], None), (5, None),
                             (None, None), ("Hi", SamplingParams(max_tokens=2).__dict__)):
        with pytest.raises(InvalidRequest):
            client.stream(prompt, sampling)
    for kwargs in (dict(chat="yes"), dict(speculative=None), dict(request_id=7)):
        with pytest.raises(InvalidRequest):
            client.stream("Hi", **kwargs)
    with pytest.raises(InvalidRequest):
        client.stream([1, 2], chat=True)  # a chat template needs text
    for timeout in (0, -1, float("nan"), "5"):
        with pytest.raises(InvalidRequest):
            client.stream("Hi", timeout=timeout)
    for retry in (dict(attempts=0), dict(initial_backoff=0), dict(initial_backoff=2, max_backoff=1),
                  dict(multiplier=0.5), dict(max_backoff=float("inf"))):
        with pytest.raises(InvalidRequest):
            Retry(**retry)
    with pytest.raises(InvalidRequest):
        Client("no-port-here")


# What an app that installed only grpcio and protobuf lacks: importing any of it raises ImportError.
BLOCKED = ("torch", "numpy", "safetensors", "tokenizers", "grpc_health", "specsplit.target_service",
           "specsplit.drafter_service", "specsplit.kernels")
WITHOUT_TORCH = """
import asyncio, importlib.abc, json, sys

blocked = tuple(sys.argv[2].split(","))
preloaded = [m for m in sys.modules if m.startswith(blocked)]

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in blocked or name.startswith(tuple(b + "." for b in blocked)):
            raise ModuleNotFoundError(f"{name} is not installed here", name=name)

sys.meta_path.insert(0, Block())
try:
    import specsplit.shared.wire  # noqa: F401 (needs torch: proves the block bites)
    bites = False
except ModuleNotFoundError:
    bites = True
from specsplit.client import AsyncClient, Client, SamplingParams

params = SamplingParams(max_tokens=6, ignore_eos=True)
with Client(sys.argv[1], timeout=120) as client:
    streamed = [t for chunk in client.stream("Count to ten:", params) for t in chunk.token_ids]
    whole = client.generate("Count to ten:", params)
    vocab = client.describe().vocab_size

async def main():
    async with AsyncClient(sys.argv[1], timeout=120) as client:
        return (await client.generate([5, 6, 7], params)).token_ids

print(json.dumps({"bites": bites, "preloaded": preloaded, "streamed": streamed, "whole": whole.token_ids,
                  "vocab": vocab, "async": asyncio.run(main()),
                  "loaded": sorted(m for m in sys.modules if m.startswith(blocked))}))
"""


def test_the_client_needs_neither_torch_nor_numpy_nor_the_services(served, client):
    """An app that installs grpcio and protobuf (no torch, numpy, grpcio-health-checking or specsplit's
    services) imports specsplit.client and streams, generates and describes through it, blocking and asyncio."""
    run = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, served[0], ",".join(BLOCKED)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout)
    assert seen["bites"] and seen["preloaded"] == [] and seen["loaded"] == []
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = client.generate("Count to ten:", params).token_ids
    assert seen["streamed"] == seen["whole"] == expected and len(expected) == 6
    assert seen["async"] == client.generate([5, 6, 7], params).token_ids
    assert seen["vocab"] == client.describe().vocab_size


def test_a_request_the_server_refuses_raises_its_status_code(client):
    with pytest.raises(ServiceError) as info:
        client.generate([10**8])  # outside the vocabulary: the server refuses it
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT and info.value.attempts == 1


def test_a_deadline_that_passes_mid_stream_gives_deadline_exceeded(scripted):
    server = scripted(lambda call: "token then stall")
    with Client(server.address, retry=FAST_RETRY) as c:
        with pytest.raises(ServiceError) as info:
            c.generate("Hi", timeout=0.5)
    assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED and server.calls == 1


def test_unavailable_before_any_response_is_retried(scripted):
    server = scripted(lambda call: "unavailable" if call < 3 else "serve")
    with Client(server.address, retry=FAST_RETRY) as c:
        assert c.generate("Hi").token_ids == [7, 8]
    assert server.calls == 3
    server = scripted(lambda call: "unavailable")
    with Client(server.address, retry=Retry(attempts=3, initial_backoff=0.01, max_backoff=0.01)) as c:
        with pytest.raises(ServiceError) as info:
            c.generate("Hi")
    assert info.value.code is grpc.StatusCode.UNAVAILABLE and info.value.attempts == 3 == server.calls


def test_unavailable_after_a_token_is_not_retried(scripted):
    """A retry would generate again what was already streamed: the caller gets the error instead."""
    server = scripted(lambda call: "token then unavailable")
    with Client(server.address, retry=FAST_RETRY) as c:
        stream = c.stream("Hi")
        assert next(stream).token_ids == (7,)
        with pytest.raises(ServiceError) as info:
            next(stream)
    assert info.value.code is grpc.StatusCode.UNAVAILABLE and server.calls == 1


def test_other_codes_are_not_retried(scripted):
    server = scripted(lambda call: "invalid")
    with Client(server.address, retry=FAST_RETRY) as c:
        with pytest.raises(ServiceError) as info:
            c.generate("Hi")
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT and server.calls == 1


def test_a_server_that_starts_late_is_reached_by_retrying(tmp_path, tiny_chat_dir, caplog):
    """Nothing listens at first; the service starts once the client has failed and begun to retry."""
    address = f"unix:{tmp_path}/late.sock"
    retrying = threading.Event()
    handler = logging.Handler()
    handler.emit = lambda record: retrying.set()
    logging.getLogger("specsplit.client").addHandler(handler)
    started = []
    starter = threading.Thread(target=lambda: retrying.wait(60) and started.append(serve_tiny(address, tiny_chat_dir)))
    starter.start()
    try:
        with caplog.at_level(logging.INFO, logger="specsplit.client"):
            with Client(address, retry=FAST_RETRY, timeout=60) as c:
                result = c.generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(result.token_ids) == 3
        assert any("UNAVAILABLE" in r.getMessage() for r in caplog.records)
    finally:
        logging.getLogger("specsplit.client").removeHandler(handler)
        retrying.set()
        starter.join()
        for loop, server in started:
            server.stop(grace=1).wait()
            loop.stop()


def test_the_token_is_sent_and_a_wrong_one_is_not_retried(tmp_path, tiny_chat_dir):
    address = f"unix:{tmp_path}/auth.sock"
    loop, server = serve_tiny(address, tiny_chat_dir, security=ServerSecurity(token="s3cret"))
    try:
        with Client(address, token="s3cret", timeout=60) as c:
            assert len(c.generate("Hi", SamplingParams(max_tokens=2, ignore_eos=True)).token_ids) == 2
        with Client(address, token="wrong", retry=FAST_RETRY, timeout=60) as c:
            with pytest.raises(ServiceError) as info:
                c.generate("Hi")
        assert info.value.code is grpc.StatusCode.UNAUTHENTICATED and info.value.attempts == 1
    finally:
        server.stop(grace=1).wait()
        loop.stop()


def test_mutual_tls_on_tcp_from_the_client_and_the_cli(tmp_path, tiny_chat_dir, capsys):
    pytest.importorskip("cryptography", reason="the throwaway CA needs the `cryptography` package")
    pki = write_pki(tmp_path)
    address = f"127.0.0.1:{free_port()}"
    token = tmp_path / "token"
    token.write_text("s3cret")
    token.chmod(0o600)
    tls = ServerTLS(pki["server.crt"], pki["server.key"], pki["ca.crt"])
    loop, server = serve_tiny(address, tiny_chat_dir, security=ServerSecurity("s3cret", tls))
    try:
        mutual = ClientTLS(pki["ca.crt"], pki["client.crt"], pki["client.key"])
        with Client(address, token="s3cret", tls=mutual, timeout=60) as c:
            assert len(c.generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True)).token_ids) == 3

        async def over_tls() -> Generation:
            async with AsyncClient(address, token="s3cret", tls=mutual, timeout=60) as c:
                return await c.generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True))

        assert len(asyncio.run(over_tls()).token_ids) == 3
        with Client(address, token="s3cret", tls=ClientTLS(pki["ca.crt"]), retry=Retry(attempts=1), timeout=60) as c:
            with pytest.raises(ServiceError) as info:  # no client certificate: the handshake fails
                c.generate("Hi")
        assert info.value.code is grpc.StatusCode.UNAVAILABLE
        argv = ["generate", "--server", address, "--prompt", "Hi", "--max-tokens", "3", "--ignore-eos", "--json",
                "--auth-token-file", str(token), "--tls-ca", pki["ca.crt"], "--tls-cert", pki["client.crt"],
                "--tls-key", pki["client.key"], "--timeout", "60"]
        assert main(argv) == 0
        assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3
    finally:
        server.stop(grace=1).wait()
        loop.stop()


def test_asyncio_client_streams_the_same_tokens(served, client):
    sampling = SamplingParams(max_tokens=10, ignore_eos=True)

    async def main() -> tuple[list, Generation]:
        async with AsyncClient(served[0], timeout=120) as c:
            chunks = [chunk async for chunk in c.stream("Count to ten:", sampling)]
            return chunks, await c.generate("Count to ten:", sampling)

    chunks, whole = asyncio.run(main())
    expected = client.generate("Count to ten:", sampling)
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids == expected.token_ids
    assert whole.text == expected.text and chunks[-1].finish_reason == "length"


def test_cancelling_the_asyncio_task_or_closing_its_stream_frees_the_sequence(served, aborted):
    address, loop = served

    async def main() -> None:
        async with AsyncClient(address, timeout=120) as c:
            first = asyncio.Event()

            async def consume():
                async for _ in c.stream("Count from one to a thousand:", LONG, request_id="task"):
                    first.set()

            task = asyncio.create_task(consume())
            await first.wait()
            assert len(loop.engine.running) == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(wait_until, lambda: aborted == [("task", True)])

            stream = c.stream("Count from one to a thousand:", LONG, request_id="aclose")
            await anext(stream)
            await stream.aclose()
            assert await asyncio.to_thread(wait_until, lambda: aborted[1:] == [("aclose", True)])

    asyncio.run(main())
    assert not loop.engine.running


def test_asyncio_deadline_and_retry(scripted):
    stalled = scripted(lambda call: "token then stall")
    flaky = scripted(lambda call: "unavailable" if call < 2 else "serve")

    async def main() -> tuple[ServiceError, Generation]:
        async with AsyncClient(stalled.address, retry=FAST_RETRY) as c:
            with pytest.raises(ServiceError) as info:
                await c.generate("Hi", timeout=0.5)
        async with AsyncClient(flaky.address, retry=FAST_RETRY) as c:
            return info.value, await c.generate("Hi")

    err, result = asyncio.run(main())
    assert err.code is grpc.StatusCode.DEADLINE_EXCEEDED and stalled.calls == 1
    assert result.token_ids == [7, 8] and flaky.calls == 2


def test_cli_generate_server_streams_through_the_client(served, client, capsys):
    argv = ["generate", "--server", served[0], "--prompt", "Count to ten:", "--max-tokens", "12", "--ignore-eos",
            "--timeout", "120"]
    expected = client.generate("Count to ten:", SamplingParams(max_tokens=12, ignore_eos=True))
    assert main([*argv, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["token_ids"] == expected.token_ids and printed["text"] == expected.text
    assert printed["stats"]["steps"] == expected.stats.steps
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out == expected.text + "\n" and "[12 tokens," in err


def test_cli_generate_server_reports_the_status_of_a_failed_call(tmp_path, capsys):
    argv = ["generate", "--server", f"unix:{tmp_path}/nothing.sock", "--prompt", "Hi", "--timeout", "1"]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("specsplit: error: UNAVAILABLE: ")
    assert main([*argv[:-1], "-5"]) == 2
    assert "timeout must be a number of seconds > 0" in capsys.readouterr().err


class Scripted(target_pb2_grpc.TargetServiceServicer):
    """A target service that plays a script: `act(call number)` says what the n-th Generate call does."""

    def __init__(self, act) -> None:
        self.act = act
        self.calls = 0
        self.lock = threading.Lock()

    def Generate(self, request, context):
        with self.lock:
            self.calls += 1
            action = self.act(self.calls)
        if action == "unavailable":
            context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
        if action == "invalid":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no")
        yield target_pb2.GenerateResponse(token_ids=[7], text="a")
        if action == "token then unavailable":
            context.abort(grpc.StatusCode.UNAVAILABLE, "went away mid-stream")
        if action == "token then stall":
            stopped = threading.Event()
            context.add_callback(stopped.set)
            stopped.wait(60)
            return
        stats = target_pb2.GenerationStats(steps=2, tau=1.0, prompt_tokens=1, generated_tokens=2)
        yield target_pb2.GenerateResponse(token_ids=[8], text="b", finish_reason=target_pb2.FINISH_REASON_LENGTH,
                                          stats=stats)


@pytest.fixture
def scripted(tmp_path):
    servers = []

    def start(act) -> Scripted:
        servicer = Scripted(act)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        servicer.address = f"unix:{tmp_path}/scripted{len(servers)}.sock"
        server.add_insecure_port(servicer.address)
        server.start()
        servers.append(server)
        return servicer

    yield start
    for server in servers:
        server.stop(grace=0).wait()


def test_a_service_error_survives_pickling_whole():
    # (a client in a process pool hands its error back pickled; Exception's own pickling broke on the
    # required arguments, and the pool died with it)
    err = ServiceError(grpc.StatusCode.UNAVAILABLE, "failed to connect", attempts=5)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ServiceError
    assert (back.code, back.details, back.attempts, str(back)) == (err.code, err.details, 5, str(err))
