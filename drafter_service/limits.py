"""What one drafter service lets its callers hold: nothing proves a caller is a target, so every cap is explicit.

A connection is one client id (the `x-specsplit-client` metadata). The worst a stranger can make the
drafter hold is bounded: (max_targets + max_sessions) connections, each within the per-connection caps;
and a stranger's idle streams cannot keep a target out for longer than `reclaim_stream_seconds`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specsplit.shared.errors import InvalidRequest
from specsplit.shared.proposer import DrafterSpec

MIB = 1 << 20
# The smallest default message cap: room for a target's prompt rows sent inline in a few calls.
MIN_MESSAGE_BYTES = 16 * MIB


@dataclass(frozen=True)
class DrafterLimits:
    max_targets: int = 8  # connections with an open Step stream (each holds a server thread)
    # At --max-targets, a stream that carried no work (sequence steps, proposals, buffers, unary calls)
    # for this long gives its slot to a newcomer: without auth, streams opened under made-up names and
    # left idle would otherwise lock every real target out. The one it evicts, if a target, re-attaches.
    reclaim_stream_seconds: float = 10.0
    # Connections without a Step stream: a target holds one only while it attaches (register, then
    # open its stream). Past this many, the least recently used is freed for the newcomer.
    max_sessions: int = 8
    idle_seconds: float = 30.0  # a connection without a Step stream and no call for this long is freed
    max_sequences: int = 256  # per connection: live sequences plus carried KVs
    # Per connection: context rows its sequences may hold, each reserving min(budget, spec.window) at
    # alloc (the default covers a 16-sequence engine at the full 4096-row DFlash window).
    max_rows: int = 65536
    max_buffer_mib: float = 4096.0  # per connection: bytes of registered buffers
    max_buffers: int = 16  # per connection: registered buffers (each holds a file descriptor open)
    # Largest message received; None: twice a Step of spec.max_batch sequences with inline float32 rows,
    # and at least MIN_MESSAGE_BYTES (see `message_bytes`).
    max_message_mib: float | None = None
    # How long a call may wait for the target's GPU writes into its CUDA buffers (their IPC event) to be
    # done, polled from the host outside the drafter lock: a target that never finishes them ends its
    # own Step stream (DEADLINE_EXCEEDED), and no one else waits.
    writes_wait_seconds: float = 10.0

    def __post_init__(self) -> None:
        counts = {"--max-targets": self.max_targets, "--max-sessions": self.max_sessions,
                  "--max-sequences": self.max_sequences, "--max-rows": self.max_rows, "max_buffers": self.max_buffers}
        for flag, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequest(f"{flag} must be a positive integer, got {value!r}")
        sizes = {"--session-idle-seconds": self.idle_seconds, "--reclaim-stream-seconds": self.reclaim_stream_seconds,
                 "--max-buffer-mib": self.max_buffer_mib, "--writes-wait-seconds": self.writes_wait_seconds,
                 "--max-message-mib": 1.0 if self.max_message_mib is None else self.max_message_mib}
        for flag, value in sizes.items():
            if not value > 0:
                raise InvalidRequest(f"{flag} must be positive, got {value!r}")
        if not math.isfinite(self.writes_wait_seconds):
            raise InvalidRequest(f"--writes-wait-seconds must be finite, got {self.writes_wait_seconds!r}")

    @property
    def buffer_bytes(self) -> int:
        return int(self.max_buffer_mib * MIB)

    def message_bytes(self, spec: DrafterSpec) -> int:
        """The receive cap: given, or derived from what the drafter's largest legitimate Step carries."""
        if self.max_message_mib is not None:
            return int(self.max_message_mib * MIB)
        step_rows = spec.max_batch * (spec.max_drafts + 1)
        return max(MIN_MESSAGE_BYTES, 2 * step_rows * spec.feature_dim * 4)

    def rows_reserved(self, spec: DrafterSpec, budget_tokens: int) -> int:
        """Context rows a sequence of this budget may come to hold (a DFlash window slides past spec.window)."""
        return min(budget_tokens, spec.window) if spec.window > 0 else budget_tokens
