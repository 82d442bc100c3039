"""Domain errors; the servers map each to one gRPC status code (see `grpc_status`)."""

from __future__ import annotations


class SpecsplitError(Exception):
    """Base of every error this project raises on purpose."""

    grpc_code = "INTERNAL"


class CheckpointError(SpecsplitError):
    """A checkpoint folder, tensor or config is missing, mis-shaped or inconsistent."""

    grpc_code = "FAILED_PRECONDITION"


class InvalidRequest(SpecsplitError, ValueError):
    """An argument is malformed: out-of-range id, wrong shape or dtype, bad sampling parameter."""

    grpc_code = "INVALID_ARGUMENT"


class UnknownSequence(SpecsplitError, KeyError):
    """No state is held under this sequence id (never allocated, or already freed)."""

    grpc_code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its argument; we want the plain message
        return str(self.args[0]) if self.args else "unknown sequence"


class StateConflict(SpecsplitError):
    """The request is well formed but contradicts held state: position gap, stale generation."""

    grpc_code = "FAILED_PRECONDITION"


class AlreadyExists(SpecsplitError):
    """A sequence id or buffer id is already in use."""

    grpc_code = "ALREADY_EXISTS"


class CapacityExceeded(SpecsplitError):
    """The request needs more rows, blocks or batch slots than were reserved."""

    grpc_code = "RESOURCE_EXHAUSTED"


class DrafterUnavailable(SpecsplitError):
    """The drafter could not be reached or failed; the target decodes without speculation."""

    grpc_code = "UNAVAILABLE"


class Unauthenticated(SpecsplitError):
    """The call carried no valid auth token (shared.security)."""

    grpc_code = "UNAUTHENTICATED"


class WritesPending(SpecsplitError):
    """A peer's GPU writes into a shared buffer (its CUDA IPC event) were not done within the wait allowed."""

    grpc_code = "DEADLINE_EXCEEDED"
