"""Structured logs: JSON lines with time, level, logger and message, and the request's id on every line the
request causes; the id is the caller's (x-request-id, checked) or a new one, and comes back in the headers."""

from __future__ import annotations

import contextvars
import io
import json
import logging
import re

import grpc
import pytest

from specsplit.local import LocalSetup
from specsplit.services import TargetSettings, start_target
from specsplit.shared import logs, wire
from specsplit.shared.errors import InvalidRequest
from specsplit.shared.sampling import SamplingParams
from tests.raw_client import RawClient
from specsplit.target_service.engine import EngineConfig

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def record(message: str = "hello %s", args: tuple = ("world",), **extra) -> logging.LogRecord:
    made = logging.LogRecord("specsplit.test", logging.WARNING, __file__, 1, message, args, None)
    made.__dict__.update(extra)
    return made


def in_a_call(function, **values):
    """Run `function` as a gRPC call's handler runs: in a context of its own, having set these fields."""
    def call():
        logs.set_fields(**values)
        return function()

    return contextvars.copy_context().run(call)


def test_a_json_line_has_time_level_logger_message_and_the_ids_known():
    line = json.loads(in_a_call(lambda: logs.JsonFormatter().format(record(seq_id=7)), request_id="r-1"))
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line.pop("time"))
    assert line == {"level": "WARNING", "logger": "specsplit.test", "message": "hello world",
                    "request_id": "r-1", "seq_id": 7}
    assert "request_id" not in json.loads(logs.JsonFormatter().format(record()))  # only in that context


def test_a_json_line_carries_the_exception_and_stays_one_line():
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        import sys

        made = record("failed", ())
        made.exc_info = sys.exc_info()
    text = logs.JsonFormatter().format(made)
    assert "\n" not in text and "ValueError: bad\nthing" in json.loads(text)["exception"]


def test_text_lines_append_the_ids_known():
    assert in_a_call(lambda: logs.TextFormatter().format(record()), client_id="c9").endswith(
        "hello world [client_id=c9]")
    assert logs.TextFormatter().format(record()).endswith("WARNING hello world")


@pytest.mark.parametrize("metadata, field, expected", [
    ((("x-request-id", "abc-123"),), "", "abc-123"),
    ((), "from-the-field", "from-the-field"),
    ((("x-request-id", "same"),), "same", "same"),
    ((("x-request-id", "6f1c2c1e-8f5e-4c59-9a3b-1d2e3f4a5b6c"),), "", "6f1c2c1e-8f5e-4c59-9a3b-1d2e3f4a5b6c"),
])
def test_the_callers_request_id_is_kept(metadata, field, expected):
    assert logs.request_id(metadata, field) == expected


def test_without_an_id_a_new_one_is_made():
    made = {logs.request_id((), "") for _ in range(3)}
    assert len(made) == 3 and all(re.fullmatch(r"[0-9a-f]{32}", m) for m in made)


@pytest.mark.parametrize("metadata, field, error", [
    ((("x-request-id", "a b"),), "", "1 to 128"), ((("x-request-id", "x" * 129),), "", "1 to 128"),
    ((), "line\nbreak", "1 to 128"), ((("x-request-id", "é"),), "", "1 to 128"),
    ((("x-request-id", "one"),), "other", "differ"),
])
def test_a_malformed_or_conflicting_request_id_is_refused(metadata, field, error):
    with pytest.raises(InvalidRequest, match=error):
        logs.request_id(metadata, field)


@pytest.fixture(scope="module")
def target(tmp_path_factory, tiny_chat_dir):
    address = f"unix:{tmp_path_factory.mktemp('logs')}/t.sock"
    loop, server = start_target(TargetSettings((address,), LocalSetup(target=str(tiny_chat_dir)), None,
                                               EngineConfig()))
    client = RawClient(address, timeout=120)
    yield client
    client.close()
    server.stop(None).wait()
    loop.stop()


@pytest.fixture
def json_lines():
    """The JSON lines the service logs while the test runs (through the real formatter)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    root.removeHandler(handler)
    root.setLevel(level)


def generate(client: RawClient, metadata=(), request_id: str = ""):
    """(initial metadata, chunks) of one Generate call."""
    call = client.stub.Generate(wire.generate_to_proto(wire.GenerateCall("Hello", GREEDY, request_id=request_id)),
                                timeout=120, metadata=metadata)
    chunks = list(call)
    return dict(call.initial_metadata()), chunks


def test_the_callers_request_id_is_in_the_targets_log_lines_and_the_response_headers(target, json_lines):
    headers, chunks = generate(target, (("x-request-id", "req-obs-42"),))
    assert headers["x-request-id"] == "req-obs-42" and chunks[-1].finish_reason
    mine = [line for line in json_lines() if line.get("request_id") == "req-obs-42"]
    messages = " | ".join(line["message"] for line in mine)
    assert "generating" in messages and "finished (length)" in messages, json_lines()
    assert {line["logger"] for line in mine} == {"specsplit.target_service.server"}


def test_a_request_without_an_id_gets_one_back_and_in_the_log(target, json_lines):
    headers, _ = generate(target)
    made = headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    assert any(line.get("request_id") == made and "finished" in line["message"] for line in json_lines())


def test_a_malformed_request_id_is_invalid_argument(target):
    with pytest.raises(grpc.RpcError) as info:
        generate(target, (("x-request-id", "has space"),))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "request id" in info.value.details()


def test_configure_rejects_unknown_formats_and_levels():
    with pytest.raises(InvalidRequest, match="log format"):
        logs.configure("xml")
    with pytest.raises(InvalidRequest, match="log level"):
        logs.configure("json", "LOUD")


def test_each_call_logs_in_a_context_of_its_own(json_lines, tmp_path):
    """What a handler adds to its call's log fields is on that call's lines only, even when the next call
    runs on the same server thread (gRPC gives each call a contextvars.Context); and the call is counted
    by its status code."""
    from concurrent import futures

    from specsplit.shared.metrics import ServiceMetrics

    said = logging.getLogger("specsplit.test.echo")

    def say(request: bytes, context) -> bytes:
        if request:
            logs.set_fields(request_id=request.decode())
        said.info("saying %r", request)
        return request

    metrics = ServiceMetrics("specsplit_test")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1), interceptors=[metrics.observer])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "test.Echo", {"Say": grpc.unary_unary_rpc_method_handler(say)})])
    server.add_insecure_port(f"unix:{tmp_path}/echo.sock")
    server.start()
    try:
        with grpc.insecure_channel(f"unix:{tmp_path}/echo.sock") as channel:
            echo = channel.unary_unary("/test.Echo/Say")
            assert echo(b"first-call", timeout=30) == b"first-call"
            assert echo(b"", timeout=30) == b""
    finally:
        server.stop(None).wait()
    lines = [line for line in json_lines() if line["logger"] == "specsplit.test.echo"]
    assert [line.get("request_id") for line in lines] == ["first-call", None]
    assert metrics.registry.get_sample_value("specsplit_test_rpcs_total",
                                             {"method": "/test.Echo/Say", "code": "OK"}) == 2
