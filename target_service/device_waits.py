"""The target's stream waiting on a drafter's done values, each wait watched against a deadline.

With `RemoteProposer(device_waits=True)` a chained propose's answer no longer makes the target's host poll
the drafter's event before it queues the verify that reads the drafts: the target's stream waits on the
device for the value the drafter's stream writes into our DONE buffer after them
(`shared.stream_ops`, BUFFER_ROLE_DONE), so our host queues the verify while the drafter still drafts.

A drafter that never writes (hung, killed, hostile) would leave that stream waiting for good, and with it
every later read of the stream. So every wait is armed with the step's deadline, and a watchdog thread
releases a wait still pending at its deadline by writing the value itself from a side stream (a stream
memory operation: no kernel, so no module to load while the context waits), then reports the drafter
failed (`failure`; the client drops it). The verify then reads whatever the drafts buffer holds:
verification is exact, so wrong drafts cost speed, never a token. `release` lets every wait go at once
(the connection is being dropped).

Waits on one stream end in order, so the oldest pending one is the only one to watch; `wait` forgets the
ones whose events show them done.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from specsplit.shared.stream_ops import StreamOps

log = logging.getLogger(__name__)


@dataclass
class _Armed:
    done: torch.Tensor  # the DONE buffer's element 0 (kept alive here while a stream may wait on it)
    value: int
    event: torch.cuda.Event  # recorded on the waiting stream right after the wait
    deadline: float  # time.perf_counter() by which the drafter must have written `value`


class DeviceWaits:
    """Stream waits on done values, each released by us at its deadline if the drafter has not written it."""

    def __init__(self, ops: StreamOps, device: torch.device) -> None:
        self._ops = ops
        self._device = device
        self._side = torch.cuda.Stream(device)  # releases go here (the waiting stream is blocked)
        self._armed: deque[_Armed] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False
        self.failure: str | None = None  # why a wait was released at its deadline (read and cleared by the client)
        self.armed = 0  # waits queued ...
        self.released = 0  # ... and those we released ourselves (deadline or dropped connection)

    def wait(self, done: torch.Tensor, value: int, deadline: float) -> None:
        """Queue on the current stream a wait until `done`'s element 0 is >= value (wrap-aware), watched
        until `deadline` (perf_counter)."""
        stream = torch.cuda.current_stream(self._device)
        self._ops.wait(stream, done.data_ptr(), value)
        event = torch.cuda.Event()
        event.record(stream)
        with self._lock:
            while self._armed and self._armed[0].event.query():
                self._armed.popleft()
            self._armed.append(_Armed(done, value, event, deadline))
            self.armed += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="specsplit-device-waits", daemon=True)
                self._thread.start()
            if len(self._armed) == 1:  # the watchdog idles without a deadline: wake it (otherwise it wakes at
                self._wake.notify()  # the oldest's deadline, and none after it can be done before it)

    @property
    def pending(self) -> int:
        """Waits not seen done yet (some may be done on the device by now)."""
        with self._lock:
            return len(self._armed)

    def release(self) -> None:
        """Let every pending wait go now (the drafter is being dropped; what it writes later lands in a
        buffer nobody waits on)."""
        with self._lock:
            self._release_locked()

    def close(self) -> None:
        """Release every wait and stop the watchdog."""
        with self._lock:
            self._release_locked()
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _release_locked(self) -> None:
        armed, self._armed = list(self._armed), deque()
        highest: dict[int, _Armed] = {}  # per DONE buffer, the last value waited for releases all before it
        for entry in armed:
            if not entry.event.query():
                highest[entry.done.data_ptr()] = entry
        for entry in highest.values():
            self._ops.write(self._side, entry.done.data_ptr(), entry.value)
            self.released += 1

    def _watch(self) -> None:
        with self._lock:
            while not self._closed:
                if not self._armed:
                    self._wake.wait()
                    continue
                oldest = self._armed[0]
                if oldest.event.query():
                    self._armed.popleft()
                    continue
                left = oldest.deadline - time.perf_counter()
                if left > 0:
                    self._wake.wait(timeout=left)
                    continue
                self.failure = (f"the drafter did not write a chained step's done value within its deadline "
                                f"(value {oldest.value}); the target's stream was released")
                log.warning("%s", self.failure)
                self._release_locked()
