"""The engine loop: cancels and admissions never wait behind a busy engine; stop fails every stream."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from specsplit.shared.errors import InvalidRequest, SpecsplitError
from specsplit.shared.sampling import SamplingParams
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.loop import EngineLoop
from specsplit.target_service.model import load_target
from specsplit.target_service.sequence import Request

LONG = 150


class GatedEngine(Engine):
    """An engine whose steps the test lets through one at a time (`gate.set()` opens it for good)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.gate = threading.Semaphore(0)
        self.steps = 0
        self.added: list[str] = []

    def add(self, request):
        super().add(request)
        self.added.append(request.request_id)

    def step(self):
        self.gate.acquire()
        self.steps += 1
        return super().step()


@pytest.fixture
def gated(tiny_llama_dir):
    engine = GatedEngine(load_target(tiny_llama_dir, dtype=torch.float32), None, EngineConfig())
    loop = EngineLoop(engine)
    yield engine, loop
    for _ in range(1000):
        engine.gate.release()
    loop.stop()


def request(rid: str, max_tokens: int = LONG) -> Request:
    return Request(rid, [5, 6, 7, 8], SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def drain(events) -> list:
    out = []
    while True:
        event = events.get(timeout=30)
        out.append(event)
        if event is None or isinstance(event, Exception) or event.finish_reason is not None:
            return out


def test_cancel_takes_effect_at_the_next_step_of_a_busy_engine(gated):
    engine, loop = gated
    events = loop.submit(request("a"))
    engine.gate.release()  # prefill
    assert events.get(timeout=30).token_ids
    # The engine thread is now parked in step(); a cancel must not wait for it.
    done = threading.Event()
    threading.Thread(target=lambda: (loop.cancel("a"), done.set()), daemon=True).start()
    assert done.wait(timeout=30)
    assert events.get(timeout=30) is None
    engine.gate.release()  # the step that was waiting runs, then the abort
    for _ in range(3):
        engine.gate.release()
    finished = threading.Event()
    threading.Thread(target=lambda: (_wait_idle(engine), finished.set()), daemon=True).start()
    assert finished.wait(timeout=30)
    assert engine.steps < LONG // 2 and not engine.running


def _wait_idle(engine):
    while engine.running or engine.waiting:
        threading.Event().wait(0.01)


def test_a_request_cancelled_before_admission_never_reaches_the_engine(gated):
    engine, loop = gated
    first = loop.submit(request("a", max_tokens=4))
    second = loop.submit(request("b", max_tokens=4))
    loop.cancel("b")
    assert second.get(timeout=30) is None
    engine.gate.release()
    for _ in range(1000):
        engine.gate.release()
    assert drain(first)[-1].finish_reason is not None
    assert "b" not in engine.added


def test_duplicate_and_invalid_requests_raise_in_the_callers_thread(gated):
    engine, loop = gated
    loop.submit(request("a"))
    with pytest.raises(InvalidRequest, match="already in flight"):
        loop.submit(request("a"))
    with pytest.raises(InvalidRequest, match="token ids"):
        loop.submit(Request("c", [10**6], SamplingParams(max_tokens=4)))
    with pytest.raises(InvalidRequest, match="context length"):
        loop.submit(Request("d", [5], SamplingParams(max_tokens=10**6)))


def test_an_id_is_reusable_once_its_cancelled_request_is_aborted(gated):
    engine, loop = gated
    first = loop.submit(request("a"))
    engine.gate.release()  # prefill
    assert first.get(timeout=30).token_ids
    loop.cancel("a")  # the engine thread is inside a step: "a" still runs until it is aborted
    with pytest.raises(InvalidRequest, match="already in flight"):
        loop.submit(request("a", max_tokens=3))  # its events could otherwise reach the new stream
    for _ in range(1000):
        engine.gate.release()
    again = _submit_when_free(loop, request("a", max_tokens=3))
    events = drain(again)
    assert sum(len(e.token_ids) for e in events) == 3 and events[-1].finish_reason is not None


def _submit_when_free(loop, req, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return loop.submit(req)
        except InvalidRequest:
            assert time.monotonic() < deadline, "the cancelled id never became free"
            time.sleep(0.01)


def test_stop_fails_every_open_stream(gated):
    engine, loop = gated
    running = loop.submit(request("a"))
    engine.gate.release()
    assert running.get(timeout=30).token_ids
    queued = loop.submit(request("b"))
    for _ in range(1000):
        engine.gate.release()
    loop.stop()
    for stream in (running, queued):
        last = drain(stream)[-1]
        assert isinstance(last, SpecsplitError) or last.finish_reason is not None
    assert not engine.running and not engine.waiting
    with pytest.raises(SpecsplitError, match="shutting down"):
        loop.submit(request("c"))
