"""The target gRPC service: Generate streams tokens as they are accepted; Describe tells what is served."""

from __future__ import annotations

import logging
import queue
import threading

from specsplit.protos.v1 import target_pb2_grpc
from specsplit.shared import logs, wire
from specsplit.shared.errors import CapacityExceeded, InvalidRequest, SpecsplitError
from specsplit.shared.metrics import MetricsAddress
from specsplit.shared.security import ServerSecurity
from specsplit.shared.serving import DEFAULT_MESSAGE_BYTES, SPARE_THREADS, Served, start_server
from specsplit.shared.status import rpc_errors
from specsplit.shared.tokenizer import Tokenizer
from specsplit.target_service.loop import EngineLoop
from specsplit.target_service.metrics import TargetMetrics
from specsplit.target_service.sequence import Request, StepEvent

log = logging.getLogger(__name__)
SERVICE_NAME = "specsplit.v1.TargetService"
_NOTHING = object()


def _stats(event: StepEvent) -> wire.GenerationStats:
    s = event.stats
    return wire.GenerationStats(s.steps, s.drafted, s.accepted, s.tau, s.prompt_tokens, s.generated)


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, loop: EngineLoop, tokenizer: Tokenizer, model_name: str, *, max_streams: int = 64) -> None:
        if max_streams < 1:
            raise InvalidRequest(f"max_streams must be at least 1, got {max_streams}")
        self.loop = loop
        self.tokenizer = tokenizer
        self.model_name = model_name
        # Each open stream holds a server thread; past this many, Generate answers RESOURCE_EXHAUSTED
        # at once instead of waiting unseen for a thread (and health checks always find one).
        self.max_streams = max_streams
        self._streams = threading.BoundedSemaphore(max_streams)
        self._open = 0  # Generate handlers running (a stream is over when its handler returns)
        self._open_lock = threading.Lock()
        # A prompt that cannot fit the context is refused before it is encoded (a 20 MB prompt once cost
        # 34 s of CPU to learn that); the bound never refuses a prompt that fits, see Tokenizer.max_token_bytes.
        self.context_length = loop.context_length
        self.max_prompt_bytes = self.context_length * tokenizer.max_token_bytes
        self.metrics = TargetMetrics(loop.state, open_streams=lambda: self._open)

    def _request(self, call: wire.GenerateCall, request_id: str) -> Request:
        self._check_prompt_size(call.prompt)
        if isinstance(call.prompt, str):
            text = call.prompt
            if call.chat:
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": call.prompt}])
            prompt_ids = self.tokenizer.encode(text)
        else:
            prompt_ids = list(call.prompt)
        if not prompt_ids:
            raise InvalidRequest("the prompt encodes to no tokens")
        return Request(request_id, prompt_ids, call.sampling, call.speculative)

    def _check_prompt_size(self, prompt: str | tuple[int, ...]) -> None:
        if isinstance(prompt, str):
            size = len(prompt.encode("utf-8", "surrogatepass"))
            if size > self.max_prompt_bytes:
                raise InvalidRequest(f"the prompt's {size} bytes are more than {self.context_length} tokens "
                                     f"(the context length) can spell ({self.max_prompt_bytes} bytes at most)")
        elif len(prompt) > self.context_length:
            raise InvalidRequest(f"the prompt's {len(prompt)} tokens exceed the context length {self.context_length}")

    @rpc_errors
    def Generate(self, request, context):
        ended = ["cancelled"]  # unless the stream ends otherwise: the client went away mid-stream
        try:
            yield from self._admitted(request, context, ended)
        except Exception as exc:
            ended[0] = exc.grpc_code.lower() if isinstance(exc, SpecsplitError) else "internal"
            raise
        finally:
            self.metrics.requests.labels(ended[0]).inc()

    def _admitted(self, request, context, ended: list[str]):
        """The stream, within --max-streams; `ended[0]` says how it ended."""
        if not self._streams.acquire(blocking=False):
            raise CapacityExceeded(f"the target is serving its limit of {self.max_streams} streams "
                                   "(--max-streams); retry later")
        with self._open_lock:
            self._open += 1
        try:
            yield from self._generate(request, context, ended)
        finally:
            with self._open_lock:
                self._open -= 1
            self._streams.release()

    @property
    def busy(self) -> bool:
        """Whether a Generate stream is still open (its last chunk may not have been sent yet)."""
        with self._open_lock:
            return self._open > 0

    def _generate(self, request, context, ended: list[str]):
        """The stream's chunks; `ended[0]` becomes the finish reason before the last chunk is sent (a client
        that leaves after the last chunk has its request counted as finished), and stays "cancelled" when
        the client went away first. The request id (the caller's, or a new one) is sent first, in the
        initial metadata."""
        call = wire.generate_from_proto(request)
        request_id = logs.request_id(context.invocation_metadata(), call.request_id)
        logs.set_fields(request_id=request_id)  # on this call's log lines (shared.logs)
        context.send_initial_metadata(((logs.REQUEST_ID_HEADER, request_id),))
        req = self._request(call, request_id)
        events = self.loop.submit(req)
        context.add_callback(lambda: self.loop.cancel(req.request_id))
        log.info("generating: %d prompt tokens, at most %d new, speculative %s", len(req.prompt_ids),
                 req.params.max_tokens, req.speculative)
        after = _NOTHING  # the end of the stream (None: cancelled; an exception) met while gathering steps
        while True:
            event = events.get() if after is _NOTHING else after
            if event is None:  # cancelled: the client is gone
                log.info("cancelled by the client")
                return
            if isinstance(event, Exception):
                raise event
            # Steps that came while the last chunk was sent go out as one chunk: a stream behind the engine
            # (many streams, a busy host) catches up in fewer messages instead of falling further behind
            tokens, text = list(event.token_ids), [event.text_delta]
            while event.finish_reason is None:
                try:
                    later = events.get_nowait()
                except queue.Empty:
                    break
                if later is None or isinstance(later, Exception):
                    after = later
                    break
                event = later
                tokens += event.token_ids
                text.append(event.text_delta)
            final = event.finish_reason is not None
            chunk = wire.GenerateChunk(tuple(tokens), "".join(text), event.finish_reason,
                                       _stats(event) if final else None)
            if final:
                ended[0] = event.finish_reason.value
                s = event.stats
                log.info("finished (%s): %d tokens in %d steps, tau %.2f, %d of %d drafts accepted",
                         event.finish_reason.value, s.generated, s.steps, s.tau, s.accepted, s.drafted)
            yield wire.chunk_to_proto(chunk)
            if final:
                return

    @rpc_errors
    def Describe(self, request, context):
        return wire.target_description_to_proto(wire.TargetDescription(
            model_name=self.model_name,
            vocab_size=self.loop.vocab_size,
            max_context=self.context_length,
            drafter_kind=self.loop.state().drafter_kind,
        ))


def serve(servicer: TargetServicer, listen: list[str], *, max_message_bytes: int = DEFAULT_MESSAGE_BYTES,
          security: ServerSecurity = ServerSecurity(), metrics: MetricsAddress | None = None) -> Served:
    """Serve on every address (host:port or unix:PATH) with grpc.health.v1 and reflection, and the
    servicer's metrics at `metrics` (None: not over HTTP); the caller drains or stops it.
    Threads: one per stream the servicer admits, and spares for Describe and health checks. Requests
    past `max_message_bytes` are refused with RESOURCE_EXHAUSTED before they are parsed."""
    register = lambda server: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)  # noqa: E731
    return start_server(register, listen, SERVICE_NAME, max_workers=servicer.max_streams + SPARE_THREADS,
                        busy=lambda: servicer.busy, max_message_bytes=max_message_bytes, security=security,
                        metrics=servicer.metrics, metrics_address=metrics)
