"""The one place where exceptions become gRPC status codes, for every servicer of both services."""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

from specsplit.shared.errors import SpecsplitError

log = logging.getLogger(__name__)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, SpecsplitError):
        return grpc.StatusCode[exc.grpc_code], str(exc)
    log.exception("unexpected error in an RPC handler", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def _abort(context: grpc.ServicerContext, exc: BaseException):
    code, message = status_of(exc)
    context.abort(code, message)


def rpc_errors(handler):
    """Decorate a servicer method (unary or streaming) so domain errors reach the client as statuses."""
    if inspect.isgeneratorfunction(handler):
        @functools.wraps(handler)
        def streaming(self, request, context):
            try:
                yield from handler(self, request, context)
            except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
                _abort(context, exc)
        return streaming

    @functools.wraps(handler)
    def unary(self, request, context):
        try:
            return handler(self, request, context)
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
            _abort(context, exc)
    return unary
