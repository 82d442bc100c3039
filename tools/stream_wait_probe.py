"""Can two processes on one GPU order their streams through a 32-bit flag, without either host waiting?

The services' steps run in series through both hosts (the target reads its verify, sends the Step, the
drafter launches, answers, the target sees the drafter's event done and launches the next verify), so a
step through the services costs ~2.4x an in-process chained step. Ordering on the device instead, each
process's stream waiting for a value the other's stream writes (`cuStreamWaitValue32` /
`cuStreamWriteValue32`), would let both hosts queue steps ahead as the in-process chain does. Unlike a
stream waiting on the other process's CUDA event, a wait on a value can be released by its own host
(write the value itself): a drafter that never writes cannot hang the target, whose verify then runs
on whatever the drafts buffer holds (verification is exact: garbage drafts only lose speed).

Measured here, for a flag in device memory shared by CUDA IPC and for one in POSIX shared host memory
registered (mapped) in both processes:
  ping-pong : round trips per second between the two processes' streams, queued by both hosts up front
  release   : a stream waiting on a value nobody else writes, released by its own host's write
  capture   : a wait and a write captured in a CUDA graph, replayed
and, for comparison, the same ping-pong between two streams of one process.

    python tools/stream_wait_probe.py [--rounds 2000]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from multiprocessing import shared_memory
from typing import Callable

import numpy as np
import torch
import torch.multiprocessing as mp

RELEASE = 0x3FFFFFFF  # past every round's value and within that difference of each: a host's release
DEADLINE_S = 10.0  # the most any part waits for the device before releasing what waits and saying so
CHUNK = 100  # rounds queued between two looks at the clock (a stuck peer must not fill the queue unseen)


def _stream_ops():
    """shared/stream_ops.py loaded by its path: the probe runs on a machine where specsplit is not installed yet."""
    path = Path(__file__).resolve().parents[1] / "shared" / "stream_ops.py"
    spec = importlib.util.spec_from_file_location("_specsplit_stream_ops", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Driver(_stream_ops().StreamOps):
    """The two stream memory operations (the services' own), and the device address of registered host memory."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        super().__init__(lib)
        self.host_pointer_fn = getattr(lib, "cuMemHostGetDevicePointer_v2", None) or lib.cuMemHostGetDevicePointer
        self.host_pointer_fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        self.host_pointer_fn.restype = ctypes.c_int

    def device_pointer(self, host_address: int) -> int:
        out = ctypes.c_uint64(0)
        self._check(self.host_pointer_fn(ctypes.byref(out), host_address, 0), "cuMemHostGetDevicePointer")
        return out.value


def wait_done(event: torch.cuda.Event, seconds: float) -> bool:
    """Poll `event` for up to `seconds`; never a blocking synchronize (a wait that is never satisfied
    would block it for good)."""
    deadline = time.perf_counter() + seconds
    while not event.query():
        if time.perf_counter() > deadline:
            return False
        time.sleep(1e-4)
    return True


def host_flags(name: str | None, driver: Driver):
    """Two int32 flags in POSIX shared memory, registered with CUDA (mapped): (shm, array, device address)."""
    shm = shared_memory.SharedMemory(name=name, create=name is None, size=4096)
    flags = np.ndarray((2,), dtype=np.int32, buffer=shm.buf)
    if name is None:
        flags[:] = 0
    code = torch.cuda.cudart().cudaHostRegister(flags.ctypes.data, 4096, 0x1 | 0x2)  # portable | mapped
    if int(code) != 0:
        raise RuntimeError(f"cudaHostRegister returned {code}")
    return shm, flags, driver.device_pointer(flags.ctypes.data)


def drop_host_flags(shm, flags: np.ndarray, unlink: bool) -> None:
    """Unregister and unmap (the array does not keep the mapping: it must not be read after this)."""
    torch.cuda.cudart().cudaHostUnregister(flags.ctypes.data)
    shm.close()
    if unlink:
        unlink_quietly(shm)


def unlink_quietly(shm) -> None:
    try:  # (a child that attached may have had its resource tracker unlink it already)
        shm.unlink()
    except FileNotFoundError:
        pass


def peer(pipe, where: str, rounds: int, shm_name: str | None, device_flags: torch.Tensor | None) -> None:
    """The other process: for i in 1..rounds, wait flag 0 >= i, then write flag 1 = i."""
    try:
        torch.cuda.init()
        driver = Driver()
        stream = torch.cuda.Stream()
        shm = flags = None
        if where == "host":
            shm, flags, address = host_flags(shm_name, driver)
            a, b = address, address + 4
        else:
            a, b = device_flags.data_ptr(), device_flags.data_ptr() + 4
        pipe.send("ready")
        if not pipe.poll(60) or pipe.recv() != "go":
            raise RuntimeError("no go from the probe within 60 s")
        for i in range(1, rounds + 1):
            driver.wait(stream, a, i)
            driver.write(stream, b, i)
        done = torch.cuda.Event()
        done.record(stream)
        if not wait_done(done, 2 * DEADLINE_S):  # the probe releases our waits before this: a last resort
            pipe.send("peer stuck")
            os._exit(3)
        pipe.send("done")
        if shm is not None:
            drop_host_flags(shm, flags, unlink=False)
    except Exception as exc:  # noqa: BLE001 - a probe reports what failed
        pipe.send(f"peer failed: {type(exc).__name__}: {exc}")


def ping_pong(where: str, rounds: int, driver: Driver) -> str:
    """Round trips between this process's stream and the peer's, both queued up front."""
    stream = torch.cuda.Stream()
    shm, flags, device_flags = None, None, None
    if where == "host":
        shm, flags, address = host_flags(None, driver)
        a, b = address, address + 4
        name = shm.name
    else:
        device_flags = torch.zeros(2, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()  # zeroed before any stream waits on it
        a, b = device_flags.data_ptr(), device_flags.data_ptr() + 4
        name = None

    def let_go() -> None:  # both sides' waits, from this host
        if flags is not None:
            flags[:] = RELEASE
        else:
            with torch.cuda.stream(torch.cuda.Stream()):
                device_flags.fill_(RELEASE)

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=peer, args=(theirs, where, rounds, name, device_flags), daemon=True)
    proc.start()
    theirs.close()  # (so that a peer dying before it answers ends our wait for it)
    settled, watchdog, fired = True, None, []

    def stuck(what: str) -> SystemExit:
        """Release both sides' waits (best effort: the streams' own later writes may lower the flags
        again) and stop the probe: a stream left waiting would hang every later synchronize."""
        nonlocal settled
        let_go()
        settled = wait_done(_recorded(stream), DEADLINE_S)
        return SystemExit(f"STUCK: {what} (released from the host: {'done' if settled else 'still waiting'}); "
                          "the probe stops here")

    try:
        if not ours.poll(120):
            return "the peer did not start within 120 s"
        said = ours.recv()
        if said != "ready":
            return said
        ours.send("go")
        # Queued in chunks, the clock read between them; and should queueing itself block (a stream's queue
        # full behind a wait the peer never meets), a watchdog releases the waits from another thread.
        watchdog = threading.Timer(3 * DEADLINE_S, lambda: fired.append(True) or let_go())
        watchdog.daemon = True
        watchdog.start()
        started = time.perf_counter()
        for first in range(1, rounds + 1, CHUNK):
            for i in range(first, min(first + CHUNK, rounds + 1)):
                driver.write(stream, a, i)
                driver.wait(stream, b, i)
            if time.perf_counter() - started > DEADLINE_S:
                raise stuck(f"{min(first + CHUNK - 1, rounds)} rounds queued in {DEADLINE_S:.0f} s")
        watchdog.cancel()
        if fired:
            raise stuck("queueing blocked until the watchdog released the waits")
        queued = time.perf_counter() - started
        if not wait_done(_recorded(stream), DEADLINE_S):
            raise stuck(f"{rounds} round trips not done in {DEADLINE_S:.0f} s")
        elapsed = time.perf_counter() - started
        if not ours.poll(DEADLINE_S):
            return "the peer's waits were met but the peer did not say so"
        said = ours.recv()
        if said != "done":
            return said
        return (f"{rounds} round trips in {elapsed * 1e3:.1f} ms: {elapsed / rounds * 1e6:.1f} us each "
                f"(the host queued all of ours in {queued * 1e3:.1f} ms)")
    finally:
        if watchdog is not None:
            watchdog.cancel()
        proc.join(timeout=30 if settled else 1)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
        if shm is not None and settled:  # (never unmap memory a stream may still poll)
            drop_host_flags(shm, flags, unlink=True)
        elif shm is not None:
            unlink_quietly(shm)


def _recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def one_process(rounds: int, driver: Driver) -> str:
    flags = torch.zeros(2, dtype=torch.int32, device="cuda")
    a, b = flags.data_ptr(), flags.data_ptr() + 4
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for i in range(1, rounds + 1):  # queued in an order no stream can deadlock on
        driver.write(first, a, i)
        driver.wait(second, a, i)
        driver.write(second, b, i)
        driver.wait(first, b, i)
    if not wait_done(_recorded(first), DEADLINE_S):
        with torch.cuda.stream(torch.cuda.Stream()):
            flags.fill_(RELEASE)
        raise SystemExit(f"STUCK: not done in {DEADLINE_S:.0f} s (released from the host); the probe stops here")
    elapsed = time.perf_counter() - started
    if not wait_done(_recorded(second), DEADLINE_S):
        raise SystemExit("STUCK: the second stream did not finish; the probe stops here")
    return f"{rounds} round trips in {elapsed * 1e3:.1f} ms: {elapsed / rounds * 1e6:.1f} us each"


def step(what: str) -> None:
    """A progress line inside a part (a part that hangs says how far it got)."""
    print(f"  . {what}", flush=True)


def release(where: str, driver: Driver, how: str = "kernel") -> str:
    """A stream waiting on a value nobody else writes, released by its own host's write. A failure raises
    SystemExit: a stream may then wait for good, and the caller ends the process after saying so."""
    stream = torch.cuda.Stream()
    shm = flags = device_flags = None
    if where == "host":
        shm, flags, address = host_flags(None, driver)
    else:
        device_flags = torch.zeros(2, dtype=torch.int32, device="cuda")
        address = device_flags.data_ptr()
    marker = torch.zeros(1, device="cuda")
    seven = torch.full((1,), 7, dtype=torch.int32, pin_memory=True)
    writer = torch.cuda.Stream()  # (made before the wait is queued)
    # Every kernel launched while the wait holds runs once first. Under CUDA's lazy module loading (the
    # default) a kernel's first launch loads its module, which waits for the whole context, the held
    # stream included: the twentieth session's three release parts hung there, before "wait and kernel
    # queued" (a wait no one releases then deadlocks the host that would release it).
    marker.add_(1)
    marker.sub_(1)
    scratch = torch.zeros(2, dtype=torch.int32, device="cuda")
    with torch.cuda.stream(writer):
        scratch[0].fill_(7)
        scratch[:1].copy_(seven, non_blocking=True)
    torch.cuda.synchronize()  # the flags (and the marker) zeroed before the wait is queued
    step("flags zeroed")
    settled = False
    try:
        driver.wait(stream, address, 7)
        with torch.cuda.stream(stream):
            marker.add_(1)
        done = _recorded(stream)
        step("wait and kernel queued")
        time.sleep(0.05)
        if done.query():
            settled = True
            return "the wait did not hold: its stream ran on before the value was written"
        step("held 50 ms")
        started = time.perf_counter()
        if flags is not None:
            flags[0] = 7  # a plain store: no CUDA call
        elif how == "kernel":
            with torch.cuda.stream(writer):
                device_flags[0].fill_(7)
        else:  # a copy from pinned host memory on another stream: no kernel
            with torch.cuda.stream(writer):
                device_flags[:1].copy_(seven, non_blocking=True)
        step(f"host wrote the value ({how if flags is None else 'a plain store'})")
        settled = wait_done(done, 5.0)
        if not settled:
            raise SystemExit("NOT released within 5 s of its host's write: the probe stops here")
        return (f"held 50 ms, released {(time.perf_counter() - started) * 1e6:.0f} us after its host's write, "
                f"its kernel ran: {marker.item() == 1.0}")
    finally:
        if shm is not None and settled:  # (never unmap memory a stream may still poll)
            drop_host_flags(shm, flags, unlink=True)


def watchdog_during_load(driver: Driver, where: str = "device") -> str:
    """The target's device waits (shared.device_waits) at their worst: a stream waits on a value
    nobody writes, the main thread launches a kernel never launched before in this process (under lazy
    module loading its load waits for the whole context, the held stream included), and a watchdog
    thread releases the wait 200 ms later: with a stream write on a side stream for a flag in device
    memory (the twenty-third session: the release did not get through, the launch never returned), or,
    for a flag in registered host memory (`where` "host"), with a plain store, no CUDA call at all. Does
    the release get through while the main thread sits in the load, and does the load then finish?"""
    shm = host = None
    if where == "host":
        shm, host, address = host_flags(None, driver)
    else:
        flags = torch.zeros(2, dtype=torch.int32, device="cuda")
        address = flags.data_ptr()
    side, held = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.rand(64, device="cuda")
    torch.cuda.synchronize()
    step("flags zeroed")
    driver.wait(held, address, 7)
    done = _recorded(held)
    step("wait queued")
    times: dict[str, float] = {}

    def watchdog() -> None:
        try:
            if host is not None:  # no CUDA call in this thread: nothing a module load could hold up
                time.sleep(0.2)
                times["release"] = time.perf_counter()
                host[0] = 7
                return
            torch.cuda.set_device(0)  # (a new thread's current context: the GPU's)
            time.sleep(0.2)
            times["release"] = time.perf_counter()
            driver.write(side, address, 7)
        except Exception as exc:  # noqa: BLE001 - said below, not mistaken for the hang
            times["error"] = exc

    thread = threading.Thread(target=watchdog, daemon=True)
    started = time.perf_counter()
    thread.start()
    y = torch.erfinv(x)  # (a precompiled kernel nothing in this process has launched, not a JIT-compiled one)
    launched = time.perf_counter()
    step(f"the new kernel's launch returned after {(launched - started) * 1e3:.0f} ms")
    thread.join(timeout=DEADLINE_S)
    if "error" in times:
        raise SystemExit(f"the watchdog thread failed: {times['error']!r} (CUDA_MODULE_LOADING="
                         f"{os.environ.get('CUDA_MODULE_LOADING', 'unset: lazy')})")
    if not wait_done(done, 5.0):
        raise SystemExit("NOT released within 5 s of the watchdog's write: the probe stops here")
    released = time.perf_counter()
    if shm is not None:
        drop_host_flags(shm, host, unlink=True)
    return (f"the launch returned {(launched - started) * 1e3:.0f} ms after it began (the watchdog wrote at "
            f"{(times['release'] - started) * 1e3:.0f} ms), the wait was seen released at "
            f"{(released - started) * 1e3:.0f} ms; the kernel's result is right: "
            f"{torch.allclose(y.cpu(), torch.erfinv(x.cpu()), atol=1e-4)} (CUDA_MODULE_LOADING="
            f"{os.environ.get('CUDA_MODULE_LOADING', 'unset: lazy')})")


def capture(driver: Driver) -> str:
    """A wait and a write captured in a CUDA graph (the flags set before the replay)."""
    flags = torch.zeros(2, dtype=torch.int32, device="cuda")
    a, b = flags.data_ptr(), flags.data_ptr() + 4
    x = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        driver.wait(torch.cuda.current_stream(), a, 1)
        x.add_(1)
        driver.write(torch.cuda.current_stream(), b, 5)
    flags[0] = 1
    torch.cuda.synchronize()
    graph.replay()
    if not wait_done(_recorded(torch.cuda.current_stream()), DEADLINE_S):
        raise SystemExit("the replay did not finish in 10 s (its wait was not met): the probe stops here")
    return f"captured and replayed: flag written {int(flags[1])} (want 5), the kernel between ran {x.item():.0f} time(s)"


def parts(rounds: int, driver: Driver) -> dict[str, Callable[[], str]]:
    made = {"one process, two streams": lambda: one_process(rounds, driver)}
    for where in ("device", "host"):
        made[f"flags in {where} memory, ping-pong"] = lambda w=where: ping_pong(w, rounds, driver)
    made["flags in device memory, release by a kernel on another stream"] = lambda: release("device", driver, "kernel")
    made["flags in device memory, release by a host-to-device copy"] = lambda: release("device", driver, "copy")
    made["flags in host memory, release by a plain store"] = lambda: release("host", driver)
    made["graph capture"] = lambda: capture(driver)
    made["a watchdog thread's release while a new kernel loads"] = lambda: watchdog_during_load(driver)
    made["a watchdog thread's plain store into host memory while a new kernel loads"] = \
        lambda: watchdog_during_load(driver, "host")
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--part", type=int, default=None, help="run only this part (by number), in this process")
    ap.add_argument("--part-timeout", type=float, default=40.0, help="seconds each part's own process may take")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds: at least 1")
    if not torch.cuda.is_available():
        sys.exit("stream_wait_probe: needs a CUDA GPU")
    if args.part is None:
        # Each part in its own process: a stream left waiting (or a host call that blocks) ends that
        # part at its timeout, and the others still run. (The seventeenth session's H200 run hung in the
        # device-memory release, silently, and took the parts after it along.)
        names = list(parts(args.rounds, None))
        for number, name in enumerate(names):
            print(f"{name}:", flush=True)
            try:
                subprocess.run([sys.executable, __file__, "--rounds", str(args.rounds), "--part", str(number)],
                               timeout=args.part_timeout, check=False)
            except subprocess.TimeoutExpired:
                print(f"  STUCK: no answer within {args.part_timeout:.0f} s (its process was killed)", flush=True)
        return
    driver = Driver()
    table = parts(args.rounds, driver)
    if not 0 <= args.part < len(table):
        ap.error(f"--part: 0 to {len(table) - 1}")
    name, part = list(table.items())[args.part]
    try:
        said = part()
    except SystemExit as stop:  # a stream that may wait for good: say so and leave at once
        print(f"  {stop}", flush=True)
        os._exit(4)
    except Exception as exc:  # noqa: BLE001 - a probe reports what failed
        said = f"failed: {type(exc).__name__}: {exc}"
    print(f"  {said}", flush=True)
    os._exit(0)  # (never wait at exit on a stream that may still be waiting)


if __name__ == "__main__":
    main()
