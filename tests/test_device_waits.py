"""The target's stream waits on a drafter's done values (shared.device_waits), on a stand-in device:
waits the drafter satisfies are left alone, one it never satisfies is released by us at its deadline
(and the drafter reported failed), and dropping the connection releases every wait still pending.
(The real stream operations, across two processes: tests/test_split_gpu.py.)"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from specsplit.shared.stream_ops import next_value
from specsplit.shared import device_waits
from specsplit.shared.device_waits import DeviceWaits


def _reached(memory: dict, address: int, value: int) -> bool:
    return (memory.get(address, 0) - value) % 2**32 < 2**31  # CU_STREAM_WAIT_VALUE_GEQ's wrap-aware >=


class _Device:
    """Streams, events and the two stream operations over a dict of int32 words (address -> value)."""

    def __init__(self) -> None:
        self.memory: dict[int, int] = {}
        self.host: dict[int, torch.Tensor] = {}  # addresses of host-page flags: their CPU views hold the value
        self.writes: list[tuple[str, int, int]] = []  # (stream, address, value)
        self.main = SimpleNamespace(name="main", last_wait=None)
        self.late: int | None = None  # a value the drafter writes right after our first release
        device = self

        class Event:
            def __init__(self) -> None:
                self.waits_for = None

            def record(self, stream) -> None:
                self.waits_for = stream.last_wait

            def query(self) -> bool:
                if self.waits_for is None:
                    return True
                address, value = self.waits_for
                if address in device.host:
                    return _reached({address: int(device.host[address].item()) & 0xFFFFFFFF}, address, value)
                return _reached(device.memory, address, value)

        self.torch = SimpleNamespace(cuda=SimpleNamespace(
            Stream=lambda _device: SimpleNamespace(name="side", last_wait=None),
            Event=Event, current_stream=lambda _device: self.main))

    def wait(self, stream, address: int, value: int) -> None:
        stream.last_wait = (address, value)

    def write(self, stream, address: int, value: int) -> None:
        self.writes.append((stream.name, address, value))
        self.memory[address] = value
        if stream.name == "side" and self.late is not None:  # the drafter's older value lands after ours
            self.memory[address], self.late = self.late, None


@pytest.fixture
def device(monkeypatch):
    fake = _Device()
    monkeypatch.setattr(device_waits, "torch", fake.torch)
    return fake


def _flag() -> torch.Tensor:
    return torch.zeros(1, 1, dtype=torch.int32)


def test_a_wait_the_drafter_satisfies_in_time_is_left_alone(device):
    waits = DeviceWaits(device, torch.device("cpu"))
    flag = _flag()
    try:
        waits.wait(flag, 1, time.perf_counter() + 0.2)
        assert waits.pending == 1
        device.write(SimpleNamespace(name="drafter"), flag.data_ptr(), 1)  # the drafter's stream, in time
        assert waits.pending == 0  # (seen done when asked, not only by the watchdog)
        time.sleep(0.4)
        assert waits.failure is None and waits.released == 0 and waits.pending == 0  # (seen done at its deadline)
        waits.wait(flag, 2, time.perf_counter() + 5)
        assert waits.pending == 1 and waits.armed == 2
    finally:
        device.write(SimpleNamespace(name="drafter"), flag.data_ptr(), 2)
        waits.close()
    assert [w for w in device.writes if w[0] == "side"] == []


def test_a_wait_the_drafter_never_satisfies_is_released_at_its_deadline_and_reported(device):
    waits = DeviceWaits(device, torch.device("cpu"))
    flag = _flag()
    try:
        started = time.perf_counter()
        waits.wait(flag, 5, started + 0.1)
        waits.wait(flag, 6, started + 0.15)  # (behind it on the stream: released with it)
        deadline = time.monotonic() + 10
        while waits.failure is None:
            assert time.monotonic() < deadline, "the watchdog never released the wait"
            time.sleep(0.01)
        assert time.perf_counter() - started >= 0.1
        assert "done value" in waits.failure and waits.released == 1 and waits.pending == 0
        assert device.writes == [("side", flag.data_ptr(), 6)]  # our side stream, the last value waited for
    finally:
        waits.close()


def test_a_released_wait_is_written_again_until_the_stream_is_past_it(device):
    """The drafter writes an older value over our release (a wait behind it would block again): the
    watchdog writes the value again until the waits' events are done."""
    waits = DeviceWaits(device, torch.device("cpu"))
    flag = _flag()
    device.late = 4
    try:
        deadline = time.perf_counter() + 0.2  # (one deadline: both are released by one write)
        waits.wait(flag, 5, deadline)
        waits.wait(flag, 6, deadline)
        deadline = time.monotonic() + 10
        while waits.pending:
            assert time.monotonic() < deadline, "the released waits were never seen past"
            time.sleep(0.01)
        assert device.writes[:2] == [("side", flag.data_ptr(), 6)] * 2 and device.memory[flag.data_ptr()] == 6
        assert waits.released == 1 and waits.failure is not None
    finally:
        waits.close()


def test_dropping_the_drafter_releases_every_pending_wait_once_per_buffer(device):
    waits = DeviceWaits(device, torch.device("cpu"))
    one, other, satisfied = _flag(), _flag(), _flag()
    try:
        far = time.perf_counter() + 60
        waits.wait(satisfied, 1, far)
        device.write(SimpleNamespace(name="drafter"), satisfied.data_ptr(), 1)
        waits.wait(one, 3, far)
        waits.wait(one, 4, far)
        waits.wait(other, 9, far)
        waits.release()
        assert sorted(device.writes[1:]) == sorted([("side", one.data_ptr(), 4), ("side", other.data_ptr(), 9)])
        assert waits.released == 2 and waits.failure is None
        deadline = time.monotonic() + 10
        while waits.pending:  # (the watchdog forgets them once their events are done)
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        waits.close()


def test_waits_done_in_time_do_not_wake_the_watchdog_before_their_deadlines(device):
    """A wait armed every step, each done long before its deadline: the watchdog looks at the earliest
    deadline or every IDLE_LOOK seconds, not at every wait (it took the GIL at every step)."""
    waits = DeviceWaits(device, torch.device("cpu"))
    flag = _flag()
    try:
        waits.wait(flag, 1, time.perf_counter() + 30)  # (starts the watchdog)
        time.sleep(0.05)  # (asleep until that deadline)
        looks = waits.looks
        for value in range(1, 201):
            device.write(SimpleNamespace(name="drafter"), flag.data_ptr(), value)
            waits.wait(flag, value + 1, time.perf_counter() + 30)
        time.sleep(0.05)
        assert waits.looks == looks and waits.pending == 1 and waits.failure is None
    finally:
        device.write(SimpleNamespace(name="drafter"), flag.data_ptr(), 201)
        waits.close()


def test_a_wait_due_before_the_watchdogs_next_look_wakes_it(device):
    """A deadline before the watchdog's next look (asleep until a far one, or idle) still releases at
    that deadline."""
    waits = DeviceWaits(device, torch.device("cpu"))
    far, near = _flag(), _flag()
    try:
        waits.wait(far, 1, time.perf_counter() + 30)
        device.write(SimpleNamespace(name="drafter"), far.data_ptr(), 1)
        time.sleep(0.05)  # (the watchdog asleep until the far deadline)
        started = time.perf_counter()
        waits.wait(near, 7, started + 0.1)
        deadline = time.monotonic() + 0.8  # (well before the far deadline and the idle look)
        while waits.failure is None:
            assert time.monotonic() < deadline, "the near deadline did not wake the watchdog"
            time.sleep(0.01)
        assert time.perf_counter() - started >= 0.1 and device.writes[1:] == [("side", near.data_ptr(), 7)]
    finally:
        waits.close()


def test_done_values_wrap_past_zero_and_the_wait_compares_across_the_wrap():
    assert next_value(0) == 1 and next_value(7) == 8 and next_value(2**32 - 1) == 1
    memory = {0: 2**32 - 1}
    assert _reached(memory, 0, 2**32 - 2) and not _reached(memory, 0, 1)
    memory[0] = 1  # written after the wrap: it satisfies the last values before it
    assert _reached(memory, 0, 2**32 - 1) and _reached(memory, 0, 1) and not _reached(memory, 0, 2)


def test_drain_returns_once_every_wait_is_seen_done_or_at_its_timeout(device):
    """`drain` (the drafter's host, before work that may load a kernel module): False while a wait is
    pending past the timeout, True once the peer's write is seen, at once with nothing pending."""
    waits = DeviceWaits(device, torch.device("cpu"), peer="target", what="a chained step's written value")
    flag = _flag()
    try:
        assert waits.drain(0.0)
        waits.wait(flag, 3, time.perf_counter() + 30)
        started = time.perf_counter()
        assert not waits.drain(0.05) and time.perf_counter() - started >= 0.05 and waits.pending == 1
        device.write(SimpleNamespace(name="target"), flag.data_ptr(), 3)
        assert waits.drain(1.0) and waits.pending == 0 and waits.failure is None
    finally:
        waits.close()
