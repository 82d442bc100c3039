"""A stream waiting on the device for a peer's values, each wait watched against a deadline.

Either side of the split may order its stream after the other's work this way, with no host waiting
(`shared.stream_ops`):
- the target's stream waits for the done value the drafter's stream writes into the target's DONE
  buffer after a chained step's drafts (`RemoteProposer(device_waits=True)`), so the target's host
  queues the verify while the drafter still drafts;
- the drafter's stream waits for the written value the target's stream writes into the DONE buffer's
  element 1 after its writes into the buffers a chained step reads (drafter `--device-waits`), so the
  drafter's host launches the step's graph while the target still verifies.

A peer that never writes (hung, killed, hostile) would leave that stream waiting for good, and with it
every later read of the stream. So every wait is armed with a deadline, and a watchdog thread releases
a wait still pending at its deadline by writing the value itself, then reports the peer failed
(`failure`). Into a flag of a host page (`shared.host_flags`) it writes with a store of its CPU, which a
waiting stream sees even while its context loads a kernel module; into device memory with a stream memory
operation from a side stream (no kernel, yet such a write does not get through a module's load). What
the released stream then reads may be half written: the target's verify is exact, so wrong drafts cost
speed, never a token. `release` lets every wait go at once (the connection is being
dropped).

Waits on one stream end in order; `wait` and the watchdog forget the ones whose events show them done. A
released wait stays watched, and its value is written again every RELEASE_AGAIN seconds until its event
is done: a peer may still write an older value over ours (a wait behind it would block again).

The watchdog looks only when a deadline may have come: at the earliest one, or every IDLE_LOOK seconds
with nothing armed. A wait is armed every step, each done long before its deadline (a second or more),
so `wait` wakes the watchdog only for a deadline before its next look. (Woken at every wait, the
watchdog took the GIL at every step, on both hosts, right after the wait was queued, as the launch
behind it let the GIL go; both sides' waits at eight streams went from 0.92x to 1.10x host polls.)

`wait` forgets the waits seen done before it queues its own, while none holds the stream: after it, the
wait just queued holds it, and with host pages' flags nothing was forgotten there. (So the waits remembered
grew by one a step; past the first one's deadline the watchdog looked every RELEASE_AGAIN seconds and read
the page once for each to confirm them written: ~80 reads of the page a step in the target's host profile,
fifty-fifth session.)
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from specsplit.shared.host_flags import Flag
from specsplit.shared.stream_ops import StreamOps
from specsplit.shared.transport import poll_until

log = logging.getLogger(__name__)


RELEASE_AGAIN = 0.01  # seconds between writes of a released wait's value, until the stream is past it
FAILED_WRITE_RETRY = 0.05  # seconds before the watchdog tries again after the driver refused a write
IDLE_LOOK = 1.0  # seconds between the watchdog's looks while no wait is armed
# seconds after a host page's release by our CPU's store before a stream write to it follows: a peer that
# punched a hole in the page (fallocate) has our CPU's view no longer be the memory our GPU reads
STORE_FALLBACK = 0.5


@dataclass(eq=False)  # (compared by identity)
class _Armed:
    done: Flag  # the flag waited on (it keeps its memory alive while a stream may wait on it)
    value: int
    event: torch.cuda.Event  # recorded on the waiting stream right after the wait
    deadline: float  # time.perf_counter() by which the peer must have written `value`
    released: bool = False  # we write its value ourselves (past its deadline, or the peer dropped)
    released_at: float = 0.0  # (perf_counter) when


class DeviceWaits:
    """Stream waits on a peer's values, each released by us at its deadline if the peer has not written it.
    `what` names the values in `failure` (e.g. "a chained step's done value")."""

    def __init__(self, ops: StreamOps, device: torch.device, *, peer: str = "drafter",
                 what: str = "a chained step's done value") -> None:
        self._ops = ops
        self._peer, self._what = peer, what
        self._device = device
        # (resolved here, on the caller's thread: the watchdog thread's current device is its own)
        self._index = (device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else None
        self._side = torch.cuda.Stream(device)  # releases go here (the waiting stream is blocked)
        self._armed: deque[_Armed] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._placed = False  # the watchdog thread has made our GPU its current device
        self._closed = False
        self.failure: str | None = None  # why waits were released at a deadline (read and cleared by the owner)
        self.armed = 0  # waits queued ...
        self.released = 0  # ... and those we released ourselves (deadline or dropped connection)
        self.looks = 0  # times the watchdog woke and looked
        self._next_look: float | None = None  # when the watchdog looks next unless woken (None: looking now)

    def wait(self, done: Flag | torch.Tensor, value: int, deadline: float) -> None:
        """Queue on the current stream a wait until the flag `done` (or a device tensor's element 0) is >=
        value (wrap-aware), watched until `deadline` (perf_counter)."""
        if self._closed:
            raise RuntimeError("DeviceWaits.wait after close")
        if not isinstance(done, Flag):
            done = Flag.of(done)
        with self._lock:  # the waits seen done forgotten while none holds the stream (see _forget_safely)
            self._forget_safely()
        stream = torch.cuda.current_stream(self._device)
        self._ops.wait(stream, done.address, value)
        event = torch.cuda.Event()
        event.record(stream)
        with self._lock:
            self._armed.append(_Armed(done, value, event, deadline))
            self.armed += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="specsplit-device-waits", daemon=True)
                self._thread.start()
            elif self._next_look is None or deadline < self._next_look:  # (else it looks before this deadline)
                self._wake.notify()

    def drain(self, timeout: float) -> bool:
        """Poll until every wait is seen done (True), or for `timeout` seconds (False): before our host
        queues work that may load a kernel module, which waits for the whole context, so a stream waiting
        here would hold it, and our watchdog's release could not get through (README, "Device waits")."""
        def done() -> bool:
            with self._lock:
                self._forget_safely()
                return not self._armed

        return poll_until(done, timeout)

    @property
    def pending(self) -> int:
        """Waits not done yet (their events queried now)."""
        with self._lock:
            self._forget_safely()
            return len(self._armed)

    def holds(self, memory: object) -> bool:
        """Whether a wait still watched is on a flag of `memory` (a flag's `keep`, e.g. a host page): the
        watchdog may still write there, so it must stay registered."""
        with self._lock:
            return any(entry.done.keep is memory for entry in self._armed) or \
                (self._thread is not None and self._thread.is_alive() and self._closed)

    def release(self) -> None:
        """Let every pending wait go now (the peer is being dropped; what it writes later lands in a
        buffer nobody waits on once these are past)."""
        with self._lock:
            self._release_safely()
            self._wake.notify()

    def close(self) -> None:
        """Release every wait and stop the watchdog (the connection is closing; no wait comes after)."""
        with self._lock:
            self._release_safely()
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def join(self, timeout: float = 60.0) -> None:
        """After `close` and a sync of the waiting stream: wait for the watchdog to end, so that no release of
        ours is still being written into the peer's buffer when it is unmapped."""
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                log.warning("device waits: the watchdog did not end within %.0f s of the stream's sync", timeout)

    def _release_safely(self) -> None:
        try:
            self._release_locked()
        except Exception as exc:  # noqa: BLE001 - marked released already: the watchdog writes them again
            log.warning("device waits: a release was refused (%s: %s); the watchdog tries again", type(exc).__name__, exc)

    # A wait on a host page's flag is released by a store of our CPU. While one is pending (its flag not
    # written, as our CPU reads the page) the watchdog makes no CUDA call: a CUDA call made while another
    # thread loads a kernel module may wait for that load, which waits for the stream the wait holds, and
    # the watchdog would never reach the deadline whose release lets them both go. A wait is forgotten only
    # once its event is seen done: what our CPU reads of a page is a hint, not proof (a peer that punched a
    # hole in the page parts our CPU's view from what our GPU reads).

    def _forget_done(self) -> None:
        while self._armed and self._armed[0].event.query():
            self._armed.popleft()

    def _forget_safely(self) -> None:
        """`_forget_done` unless a host page's wait is pending (a caller holding our lock, blocked in an
        event's query, would keep the watchdog from its release)."""
        if not self._host_held():
            self._place()
            self._forget_done()

    def _host_held(self) -> bool:
        """Whether a wait on a host page's flag is pending: its stream may be held, so no CUDA call now. (Newest
        first: the wait armed last is the one pending, most often, and then one read of the page answers.)"""
        return any(entry.done.host is not None and not entry.released and not _reached(entry.done, entry.value)
                   for entry in reversed(self._armed))

    def _earliest(self) -> float | None:
        deadlines = [entry.deadline for entry in self._armed if not entry.released]
        return min(deadlines) if deadlines else None

    def _release_locked(self, entries: "list[_Armed] | None" = None) -> None:
        """Mark `entries` (None: every pending wait) released and write, per flag, the last value waited for
        there (it releases every wait before it): host pages' first, by our CPU, before any CUDA call. Raises
        if the driver refuses a write (the caller retries)."""
        fresh = [entry for entry in (self._armed if entries is None else entries) if not entry.released]
        unwritten = {entry.done.address for entry in fresh if entry.done.host is not None
                     and not _reached(entry.done, entry.value)}
        now = time.perf_counter()
        for entry in fresh:
            entry.released, entry.released_at = True, now
        self._store_last_values()
        self._forget_safely()
        alive = {entry.done.address for entry in fresh if any(entry is armed for armed in self._armed)}
        self.released += len(unwritten | alive)
        self._write_last_values()

    def _last_released(self) -> list[_Armed]:
        last: dict[int, _Armed] = {}
        for entry in self._armed:
            if entry.released:
                last[entry.done.address] = entry
        return list(last.values())

    def _store_last_values(self) -> None:
        """Our CPU's stores of the released values into host pages' flags that do not hold them (a store over
        a later value the peer wrote since would hold a later wait again)."""
        for entry in self._last_released():
            if entry.done.host is not None and not _reached(entry.done, entry.value):
                entry.done.store(entry.value)

    def _write_last_values(self) -> None:
        """The stores, then (no host page's wait pending) the stream writes: of device memory's flags, and of
        a host page's flag whose store the stream has not seen within STORE_FALLBACK, unless a later wait on
        that flag is armed (the write would go under the value the peer wrote for it)."""
        self._store_last_values()
        if self._host_held():
            return
        late = time.perf_counter() - STORE_FALLBACK
        latest = {entry.done.address: entry for entry in self._armed}
        for entry in self._last_released():
            if entry.done.host is None or (entry.released_at < late and latest[entry.done.address] is entry):
                self._place()
                self._ops.write(self._side, entry.done.address, entry.value)

    def _place(self) -> None:
        """The watchdog thread's current device: ours, before its first CUDA call."""
        if self._index is not None and not self._placed and threading.current_thread() is self._thread:
            torch.cuda.set_device(self._index)
            self._placed = True

    def _sleep(self, seconds: float) -> None:
        """Wait for a notify or `seconds` (the lock held on entry and on return), telling `wait` when."""
        self._next_look = time.perf_counter() + seconds
        self._wake.wait(timeout=seconds)
        self._next_look = None  # (looking now: until the next sleep, any wait armed finds it awake)

    def _watch(self) -> None:
        with self._lock:
            while True:
                try:
                    self.looks += 1
                    self._store_last_values()  # (our CPU: a released host page's flag a late peer wrote under us)
                    self._forget_safely()
                    if self._closed and not self._armed:
                        return
                    if not self._armed:
                        self._sleep(IDLE_LOOK)
                        continue
                    earliest = self._earliest()
                    now = time.perf_counter()
                    if earliest is not None and earliest <= now and not self._closed:
                        due = [entry for entry in self._armed if not entry.released and entry.deadline <= now]
                        # A host page's flag our CPU reads written, its event not seen done: confirmed by an event
                        # query once no wait holds the stream (a short look later), released if it is not done
                        written = [entry for entry in due if entry.done.host is not None
                                   and _reached(entry.done, entry.value)]
                        if len(written) == len(due) and self._host_held():
                            self._sleep(RELEASE_AGAIN)
                            continue
                        self._release_locked(None if len(written) < len(due) else written)
                        self.failure = (f"the {self._peer} did not write {self._what} within its deadline"
                                        + ("" if len(written) < len(due) else " where our GPU reads it")
                                        + "; our stream waiting for it was released")
                        log.warning("%s", self.failure)
                        continue
                    if any(entry.released for entry in self._armed):
                        self._write_last_values()  # again, until the stream is past them
                        self._sleep(RELEASE_AGAIN if earliest is None else min(RELEASE_AGAIN, earliest - now))
                        continue
                    if self._closed:
                        return
                    self._sleep(earliest - now)
                except Exception as exc:  # noqa: BLE001 - the watchdog must outlive a refused write
                    log.warning("device waits: %s: %s; trying again", type(exc).__name__, exc)
                    self.failure = self.failure or f"a device wait could not be released ({exc})"
                    self._sleep(FAILED_WRITE_RETRY)


def _reached(flag: Flag, value: int) -> bool:
    """Whether a host page's flag holds `value` or a later one (CU_STREAM_WAIT_VALUE_GEQ's wrap-aware >=)."""
    return (int(flag.host.item()) - value) % 2**32 < 2**31
