"""A Python client of the target service's Generate, blocking (`Client`) and asyncio (`AsyncClient`).

Both stream chunks as the server accepts tokens, take a deadline per call, and retry a call the
server answered UNAVAILABLE **only while no response has arrived**: once a chunk was received, a
retry would generate (and stream) that output a second time, so the error is raised instead.
Every failed call raises `ServiceError`, which carries the gRPC status code.

Only torch-free modules are imported: an app needs grpcio and protobuf, not torch (tests/test_client.py
runs it with torch and numpy unimportable).

    with Client("127.0.0.1:50051") as client:
        for chunk in client.stream("The capital of France is", SamplingParams(max_tokens=32)):
            print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import grpc

from specsplit.protos.v1 import target_pb2, target_pb2_grpc
from specsplit.shared import generation
from specsplit.shared.errors import InvalidRequest, SpecsplitError
from specsplit.shared.generation import GenerateChunk, GenerationStats, TargetDescription
from specsplit.shared.sampling_params import SamplingParams
from specsplit.shared.security import CHANNEL_OPTIONS, ClientTLS, auth_metadata, grpc_target, is_unix, open_channel

__all__ = ["AsyncClient", "Client", "ClientTLS", "GenerateChunk", "Generation", "GenerationStats", "Retry",
           "SamplingParams", "ServiceError", "Stream", "TargetDescription"]
log = logging.getLogger(__name__)
Prompt = str | Sequence[int]


class ServiceError(SpecsplitError):
    """A call failed: `code` is its gRPC status code, `details` the server's (or gRPC's) message."""

    def __init__(self, code: grpc.StatusCode, details: str, attempts: int = 1) -> None:
        self.code = code
        self.details = details
        self.attempts = attempts  # calls made, retries included
        self.grpc_code = code.name
        tried = f" (after {attempts} attempts)" if attempts > 1 else ""
        super().__init__(f"{code.name}: {details}{tried}")

    def __reduce__(self):  # pickled whole: a client's error crosses process pools (Exception's pickles args only)
        return type(self), (self.code, self.details, self.attempts)


@dataclass(frozen=True)
class Retry:
    """When a call the server answered UNAVAILABLE before any response is made again.

    `attempts` counts calls in all (1: never retry). The k-th retry waits a random share, between half
    and all, of min(initial_backoff · multiplier^(k-1), max_backoff) seconds; a retry that the call's
    deadline leaves no time for is not made. Other status codes are never retried.
    """

    attempts: int = 5
    initial_backoff: float = 0.25
    max_backoff: float = 4.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise InvalidRequest(f"Retry.attempts must be an integer >= 1, got {self.attempts!r}")
        if not (_finite(self.initial_backoff) and _finite(self.max_backoff)
                and 0 < self.initial_backoff <= self.max_backoff):
            raise InvalidRequest(f"Retry backoffs must satisfy 0 < initial_backoff <= max_backoff, got "
                                 f"{self.initial_backoff!r} and {self.max_backoff!r}")
        if not _finite(self.multiplier) or self.multiplier < 1:
            raise InvalidRequest(f"Retry.multiplier must be a number >= 1, got {self.multiplier!r}")

    def backoff(self, retry: int) -> float:
        """Seconds before retry number `retry` (1 = the first retry)."""
        return min(self.initial_backoff * self.multiplier ** (retry - 1), self.max_backoff) * random.uniform(0.5, 1.0)

    def channel_options(self) -> list[tuple[str, int]]:
        """The channel reconnects on the same schedule, so a retry finds a server that came up meanwhile."""
        initial, most = int(self.initial_backoff * 1000), int(self.max_backoff * 1000)
        return [("grpc.initial_reconnect_backoff_ms", initial), ("grpc.min_reconnect_backoff_ms", initial),
                ("grpc.max_reconnect_backoff_ms", most)]


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Generation:
    """A whole generation: every chunk's tokens and text, why it ended and its counters."""

    token_ids: list[int]
    text: str
    finish_reason: str  # length | stop | eos | cancelled
    stats: GenerationStats

    @classmethod
    def from_chunks(cls, chunks: list[GenerateChunk]) -> Generation:
        last = chunks[-1] if chunks else None
        if last is None or last.stats is None or last.finish_reason is None:
            raise ServiceError(grpc.StatusCode.INTERNAL, "the stream ended without its final chunk")
        return cls([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), last.finish_reason,
                   last.stats)


class _Attempts:
    """One call's retry bookkeeping: its deadline, the calls made, whether a response arrived."""

    def __init__(self, retry: Retry, timeout: float | None) -> None:
        self.retry = retry
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.made = 0
        self.received = False

    def next_timeout(self) -> float | None:
        """The next call's gRPC timeout: what is left of the deadline."""
        self.made += 1
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, f"the call's {self.timeout} s deadline passed",
                               self.made - 1)
        return left

    def pause_after(self, err: grpc.RpcError) -> float:
        """Seconds to wait before calling again; raises ServiceError when `err` is final."""
        code, details = err.code(), err.details() or err.code().name
        final = ServiceError(code, details, self.made)
        if code is not grpc.StatusCode.UNAVAILABLE or self.received or self.made >= self.retry.attempts:
            raise final from None
        pause = self.retry.backoff(self.made)
        if self.deadline is not None and time.monotonic() + pause >= self.deadline:
            raise final from None
        log.info("Generate: %s (%s); retry %d of %d in %.2f s", code.name, details, self.made,
                 self.retry.attempts - 1, pause)
        return pause

    def cancelled(self) -> ServiceError:
        return ServiceError(grpc.StatusCode.CANCELLED, "cancelled by the caller", self.made)


def _request(prompt: Prompt, sampling: SamplingParams | None, chat: bool, speculative: bool,
             request_id: str) -> target_pb2.GenerateRequest:
    """Checked here, before any call: a bad argument raises InvalidRequest at once."""
    if not isinstance(prompt, str):
        if not isinstance(prompt, Sequence) or not all(_is_token_id(t) for t in prompt):
            raise InvalidRequest("a prompt is text or a sequence of token ids (integers in [0, 2^31))")
        prompt = tuple(prompt)
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise InvalidRequest(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if not (isinstance(chat, bool) and isinstance(speculative, bool) and isinstance(request_id, str)):
        raise InvalidRequest("chat and speculative must be booleans, request_id a string")
    call = generation.GenerateCall(prompt, sampling or SamplingParams(), chat, speculative, request_id)
    return generation.generate_to_proto(call)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31  # an int32 on the wire


def _check_timeout(timeout: float | None) -> float | None:
    if timeout is not None and not (_finite(timeout) and timeout > 0):
        raise InvalidRequest(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
    return timeout


class _Settings:
    """What both clients share: the address, the token's metadata, TLS, the default deadline, retry."""

    def __init__(self, address: str, token: str | None, tls: ClientTLS | None, timeout: float | None,
                 retry: Retry) -> None:
        if not isinstance(retry, Retry):
            raise InvalidRequest(f"retry must be a Retry, got {type(retry).__name__}")
        self.address = address
        self.target = grpc_target(address)
        self.metadata = auth_metadata(token)
        self.tls = None if is_unix(self.target) else tls
        self.timeout = _check_timeout(timeout)
        self.retry = retry
        self.options = CHANNEL_OPTIONS + retry.channel_options()


_DEFAULT = object()  # "the client's timeout", told apart from an explicit None (no deadline)


class Client:
    """A blocking client of one target service; thread-safe, one channel for all its calls.

    `token`: sent as `authorization: Bearer <token>` (see shared.security.load_token for reading one
    from a file or $SPECSPLIT_AUTH_TOKEN). `tls`: TLS on a TCP address (never on unix:PATH).
    `timeout`: each call's deadline in seconds, retries included (None: no deadline).
    """

    def __init__(self, address: str, *, token: str | None = None, tls: ClientTLS | None = None,
                 timeout: float | None = None, retry: Retry = Retry()) -> None:
        self._settings = _Settings(address, token, tls, timeout, retry)
        self._channel = open_channel(self._settings.target, self._settings.options, self._settings.tls)
        self._stub = target_pb2_grpc.TargetServiceStub(self._channel)

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None, *, chat: bool = False,
               speculative: bool = True, request_id: str = "", timeout: float | None = _DEFAULT) -> Stream:
        """Chunks as the server accepts tokens. Close the stream (or leave its `with` block, or call
        `cancel()` from any thread) to cancel the call: the server then frees the sequence."""
        request = _request(prompt, sampling, chat, speculative, request_id)
        timeout = self._settings.timeout if timeout is _DEFAULT else _check_timeout(timeout)
        return Stream(self._stub, request, self._settings, _Attempts(self._settings.retry, timeout))

    def generate(self, prompt: Prompt, sampling: SamplingParams | None = None, **kwargs) -> Generation:
        """The whole generation at once; takes `stream`'s arguments."""
        with self.stream(prompt, sampling, **kwargs) as chunks:
            return Generation.from_chunks(list(chunks))

    def describe(self, timeout: float | None = _DEFAULT) -> TargetDescription:
        """The served model, its vocabulary and context length, and whether a drafter is attached."""
        timeout = self._settings.timeout if timeout is _DEFAULT else _check_timeout(timeout)
        try:
            reply = self._stub.Describe(target_pb2.DescribeTargetRequest(), timeout=timeout,
                                        metadata=self._settings.metadata)
        except grpc.RpcError as err:
            raise ServiceError(err.code(), err.details() or err.code().name) from None
        return generation.target_description_from_proto(reply)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Stream(Iterator[GenerateChunk]):
    """One Generate call's chunks; an iterator that cancels its call when closed (a stream dropped
    unfinished is cancelled by gRPC when it is garbage-collected)."""

    def __init__(self, stub, request: target_pb2.GenerateRequest, settings: _Settings, attempts: _Attempts) -> None:
        self._stub, self._request, self._settings, self._attempts = stub, request, settings, attempts
        self._call = None
        self._done = False
        self._cancelled = threading.Event()
        self._lock = threading.Lock()  # cancel() may come from another thread while __next__ starts a call

    def __next__(self) -> GenerateChunk:
        while not self._done:
            call = self._call or self._start()
            try:
                reply = next(call)
            except StopIteration:
                self._done = True
                break
            except grpc.RpcError as err:
                self._call = None
                if self._cancelled.is_set():
                    raise self._finish(self._attempts.cancelled()) from None
                self._pause(err)
                continue
            self._attempts.received = True
            return generation.chunk_from_proto(reply)
        raise StopIteration

    def _start(self):
        with self._lock:
            if self._cancelled.is_set():
                raise self._finish(self._attempts.cancelled())
            try:
                timeout = self._attempts.next_timeout()
            except ServiceError as final:
                raise self._finish(final) from None
            self._call = self._stub.Generate(self._request, timeout=timeout, metadata=self._settings.metadata)
            return self._call

    def _pause(self, err: grpc.RpcError) -> None:
        try:
            pause = self._attempts.pause_after(err)
        except ServiceError as final:
            raise self._finish(final) from None
        if self._cancelled.wait(pause):  # cancel() ends a backoff at once
            raise self._finish(self._attempts.cancelled())

    def _finish(self, err: ServiceError) -> ServiceError:
        self._done = True
        return err

    def cancel(self) -> None:
        """Cancel the call (from any thread); a later `next()` raises ServiceError(CANCELLED)."""
        with self._lock:
            self._cancelled.set()
            if self._call is not None:
                self._call.cancel()

    def close(self) -> None:
        """Cancel the call if it is still running; iteration then simply ends."""
        if not self._done:
            self.cancel()
        self._done = True

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """The asyncio twin of `Client` (grpc.aio); create and use it inside one running event loop.

    Cancelling the task that iterates a stream (or awaits `generate`) cancels the call, and the
    server frees the sequence; so does `aclose()` on the stream (`async with contextlib.aclosing(...)`).
    """

    def __init__(self, address: str, *, token: str | None = None, tls: ClientTLS | None = None,
                 timeout: float | None = None, retry: Retry = Retry()) -> None:
        self._settings = s = _Settings(address, token, tls, timeout, retry)
        if s.tls is None:
            self._channel = grpc.aio.insecure_channel(s.target, options=s.options)
        else:
            self._channel = grpc.aio.secure_channel(s.target, s.tls.credentials(), options=s.options)
        self._stub = target_pb2_grpc.TargetServiceStub(self._channel)

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None, *, chat: bool = False,
               speculative: bool = True, request_id: str = "",
               timeout: float | None = _DEFAULT) -> AsyncIterator[GenerateChunk]:
        """Chunks as the server accepts tokens (an async generator: `async for`, `aclose()`)."""
        request = _request(prompt, sampling, chat, speculative, request_id)
        timeout = self._settings.timeout if timeout is _DEFAULT else _check_timeout(timeout)
        return self._chunks(request, _Attempts(self._settings.retry, timeout))

    async def _chunks(self, request: target_pb2.GenerateRequest, attempts: _Attempts) -> AsyncIterator[GenerateChunk]:
        while True:
            call = self._stub.Generate(request, timeout=attempts.next_timeout(), metadata=self._settings.metadata)
            try:
                async for reply in call:
                    attempts.received = True
                    yield generation.chunk_from_proto(reply)
                return
            except grpc.RpcError as err:
                pause = attempts.pause_after(err)
            finally:
                call.cancel()  # a no-op once the call ended; cancels it when the task is cancelled or we close
            await asyncio.sleep(pause)

    async def generate(self, prompt: Prompt, sampling: SamplingParams | None = None, **kwargs) -> Generation:
        """The whole generation at once; takes `stream`'s arguments."""
        chunks = self.stream(prompt, sampling, **kwargs)
        try:
            return Generation.from_chunks([chunk async for chunk in chunks])
        finally:
            await chunks.aclose()

    async def describe(self, timeout: float | None = _DEFAULT) -> TargetDescription:
        timeout = self._settings.timeout if timeout is _DEFAULT else _check_timeout(timeout)
        try:
            reply = await self._stub.Describe(target_pb2.DescribeTargetRequest(), timeout=timeout,
                                              metadata=self._settings.metadata)
        except grpc.RpcError as err:
            raise ServiceError(err.code(), err.details() or err.code().name) from None
        return generation.target_description_from_proto(reply)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
