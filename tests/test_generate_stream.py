"""How Generate turns the engine's step events into chunks: steps that pile up while a chunk is being sent go
out as one chunk (a busy front end falls no further behind), and nothing is lost or reordered at the end."""

from __future__ import annotations

import contextvars
import queue

import pytest

from specsplit.protos.v1 import target_pb2
from specsplit.shared.errors import DrafterUnavailable
from specsplit.target_service.sequence import FinishReason, RequestStats, StepEvent
from specsplit.target_service.server import TargetServicer


class _Loop:
    """Stands in for the engine loop: the request's events are all queued before the stream reads one."""

    def __init__(self, events: list) -> None:
        self.context_length = 64
        self.events = events
        self.cancelled: list[str] = []

    def submit(self, request) -> queue.Queue:
        q: queue.Queue = queue.Queue()
        for event in self.events:
            q.put(event)
        return q

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def state(self):
        return None  # (read by a scrape; these tests take none)


class _Context:
    def invocation_metadata(self):
        return ()

    def send_initial_metadata(self, metadata) -> None:
        pass

    def add_callback(self, callback) -> None:
        pass


def _event(tokens: list[int], text: str, final: bool = False) -> StepEvent:
    stats = RequestStats(steps=3, drafted=4, accepted=2, generated=5, prompt_tokens=3)
    return StepEvent("r", tokens, text, FinishReason.LENGTH if final else None, stats)


def _chunks(events: list, smollm2_tokenizer) -> list:
    servicer = TargetServicer(_Loop(events), smollm2_tokenizer, "stand-in")
    ended = ["cancelled"]
    request = target_pb2.GenerateRequest(token_ids=target_pb2.TokenIds(ids=[1, 2, 3]))
    # (in a context of its own, as a server thread's: the stream sets its request id on our log lines)
    return contextvars.copy_context().run(list, servicer._generate(request, _Context(), ended)), ended


def test_steps_queued_behind_the_stream_go_out_as_one_chunk(smollm2_tokenizer):
    events = [_event([5], "a"), _event([6, 7], "bc"), _event([8], "d"), _event([9, 10], "ef", final=True)]
    chunks, ended = _chunks(events, smollm2_tokenizer)
    assert [list(c.token_ids) for c in chunks] == [[5, 6, 7, 8, 9, 10]]
    assert chunks[0].text == "abcdef" and chunks[0].finish_reason == target_pb2.FINISH_REASON_LENGTH
    assert chunks[0].stats.generated_tokens == 5 and ended == ["length"]


def test_an_error_after_queued_steps_comes_after_their_tokens(smollm2_tokenizer):
    events = [_event([5], "a"), _event([6], "b"), DrafterUnavailable("the step failed")]
    servicer = TargetServicer(_Loop(events), smollm2_tokenizer, "stand-in")
    stream = servicer._generate(target_pb2.GenerateRequest(token_ids=target_pb2.TokenIds(ids=[1])), _Context(),
                                ["cancelled"])
    context = contextvars.copy_context()
    first = context.run(next, stream)
    assert list(first.token_ids) == [5, 6] and first.text == "ab" and not first.HasField("stats")
    with pytest.raises(DrafterUnavailable, match="the step failed"):
        context.run(next, stream)


def test_a_cancel_after_queued_steps_ends_the_stream_without_a_final_chunk(smollm2_tokenizer):
    chunks, ended = _chunks([_event([5], "a"), None, _event([6], "b", final=True)], smollm2_tokenizer)
    assert [list(c.token_ids) for c in chunks] == [[5]] and ended == ["cancelled"]
