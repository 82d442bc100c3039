"""Service logs: text or JSON lines, carrying the request, sequence and client ids of the call they belong to.

A field reaches a record from `extra=` (`log.info(..., extra=fields(seq_id=3))`) or from the current
log scope, a context variable: gRPC runs every call in a `contextvars.Context` of its own, so what a
handler adds there (`set_fields(request_id=...)`) is on every line the call logs, the status mapping's
included, and on no other call's (tests/test_logs.py holds grpc to that).
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import sys
import uuid
from contextvars import ContextVar

from specsplit.shared.errors import InvalidRequest

FORMATS = ("text", "json")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FIELDS = ("request_id", "seq_id", "client_id")  # what a line may carry beyond its message
REQUEST_ID_HEADER = "x-request-id"
# A caller's request id lands in logs and response headers: bounded, and nothing that could break a line.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:+/=-]{1,128}")
_scope: ContextVar[dict] = ContextVar("specsplit_log_fields", default={})


def set_fields(**values) -> None:
    """Add fields to the current scope (a call's scope ends with the call)."""
    _scope.set({**_scope.get(), **values})


def fields(**values) -> dict:
    """`extra=` for one line: `log.warning("...", extra=fields(seq_id=3))`."""
    return {name: value for name, value in values.items() if value is not None}


def _fields_of(record: logging.LogRecord) -> dict:
    scoped = _scope.get()
    found = {name: getattr(record, name, scoped.get(name)) for name in FIELDS}
    return {name: value for name, value in found.items() if value is not None}


def request_id(metadata, given: str = "") -> str:
    """The id of a request: the caller's (the `x-request-id` metadata and/or the request's own field,
    which must agree), or a new one. A malformed id is refused, never rewritten: the caller is looking
    for it in our logs."""
    header = next((value for key, value in metadata or () if key == REQUEST_ID_HEADER), "")
    header = header.decode(errors="replace") if isinstance(header, bytes) else header
    if header and given and header != given:
        raise InvalidRequest(f"the {REQUEST_ID_HEADER} metadata ({header!r}) and the request's request_id "
                             f"({given!r}) differ; give one, or the same in both")
    chosen = header or given
    if not chosen:
        return uuid.uuid4().hex
    if not _REQUEST_ID.fullmatch(chosen):
        raise InvalidRequest(f"a request id must be 1 to 128 letters, digits or . _ : + / = - (got "
                             f"{chosen[:40]!r}{'...' if len(chosen) > 40 else ''})")
    return chosen


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, the ids known, exception."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
                    .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **_fields_of(record),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """The plain line, with the ids known appended as `[request_id=... seq_id=...]`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(name)s %(levelname)s %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)
        known = _fields_of(record)
        return text + (" [" + " ".join(f"{k}={v}" for k, v in known.items()) + "]" if known else "")


def configure(log_format: str = "text", level: str = "INFO") -> None:
    """Every log line of this process to stderr, in `log_format`; replaces handlers set before."""
    if log_format not in FORMATS:
        raise InvalidRequest(f"log format {log_format!r}: expected one of {', '.join(FORMATS)}")
    if level not in LEVELS:
        raise InvalidRequest(f"log level {level!r}: expected one of {', '.join(LEVELS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def current() -> tuple[str, str]:
    """This process's log format and level as `configure` takes them (for a process it starts to log alike)."""
    root = logging.getLogger()
    json_lines = any(isinstance(h.formatter, JsonFormatter) for h in root.handlers)
    level = logging.getLevelName(root.level)
    return ("json" if json_lines else "text", level if level in LEVELS else "WARNING")
