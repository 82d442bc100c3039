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
import sys
import time
from multiprocessing import shared_memory

import numpy as np
import torch
import torch.multiprocessing as mp

WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ (unsigned, wrap-aware)


class Driver:
    """The two stream memory operations, from the driver library."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self.wait_fn = self._symbol(lib, "cuStreamWaitValue32")
        self.write_fn = self._symbol(lib, "cuStreamWriteValue32")

    @staticmethod
    def _symbol(lib, name: str):
        for candidate in (name + "_v2", name):  # _v2: CUDA 11.7+, usable without the v1 opt-in
            fn = getattr(lib, candidate, None)
            if fn is not None:
                fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
                fn.restype = ctypes.c_int
                return fn
        raise RuntimeError(f"libcuda has no {name}")

    def wait(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        self._check(self.wait_fn(stream.cuda_stream, address, value, WAIT_GEQ), "wait")

    def write(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        self._check(self.write_fn(stream.cuda_stream, address, value, 0), "write")

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"cuStream{what.capitalize()}Value32 returned CUresult {code}")


def host_flags(name: str | None):
    """Two uint32 flags in POSIX shared memory, registered with CUDA (mapped): (shm, array, address)."""
    shm = shared_memory.SharedMemory(name=name, create=name is None, size=4096)
    flags = np.ndarray((2,), dtype=np.uint32, buffer=shm.buf)
    if name is None:
        flags[:] = 0
    address = flags.ctypes.data
    code = torch.cuda.cudart().cudaHostRegister(address, 4096, 0x1 | 0x2)  # portable | mapped
    if int(code) != 0:
        raise RuntimeError(f"cudaHostRegister returned {code}")
    return shm, flags, address  # with unified addressing the host address is the device one


def drop_host_flags(shm, flags: np.ndarray, unlink: bool) -> None:
    torch.cuda.cudart().cudaHostUnregister(flags.ctypes.data)
    del flags  # (the array holds shm's buffer: it must go before close)
    try:
        shm.close()
    except BufferError:  # another view still held: the process's exit unmaps it
        pass
    if unlink:
        shm.unlink()


def peer(pipe, where: str, rounds: int, shm_name: str | None, device_flags: torch.Tensor | None) -> None:
    """The other process: for i in 1..rounds, wait flag 0 >= i, then write flag 1 = i."""
    try:
        torch.cuda.init()
        driver = Driver()
        stream = torch.cuda.Stream()
        if where == "host":
            shm, flags, address = host_flags(shm_name)
            a, b = address, address + 4
        else:
            a, b = device_flags.data_ptr(), device_flags.data_ptr() + 4
        pipe.send("ready")
        pipe.recv()  # go
        for i in range(1, rounds + 1):
            driver.wait(stream, a, i)
            driver.write(stream, b, i)
        stream.synchronize()
        pipe.send("done")
        if where == "host":
            drop_host_flags(shm, flags, unlink=False)
    except Exception as exc:  # noqa: BLE001 - a probe reports what failed
        pipe.send(f"peer failed: {type(exc).__name__}: {exc}")


def ping_pong(where: str, rounds: int, driver: Driver) -> str:
    stream = torch.cuda.Stream()
    shm, flags, device_flags = None, None, None
    if where == "host":
        shm, flags, address = host_flags(None)
        a, b = address, address + 4
        name = shm.name
    else:
        device_flags = torch.zeros(2, dtype=torch.int32, device="cuda")
        a, b = device_flags.data_ptr(), device_flags.data_ptr() + 4
        name = None
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=peer, args=(theirs, where, rounds, name, device_flags))
    proc.start()
    try:
        said = ours.recv()
        if said != "ready":
            return said
        ours.send("go")
        started = time.perf_counter()
        for i in range(1, rounds + 1):
            driver.write(stream, a, i)
            driver.wait(stream, b, i)
        queued = time.perf_counter() - started
        done = torch.cuda.Event()
        done.record(stream)
        while not done.query():
            if time.perf_counter() - started > 10:  # stuck: release both sides' waits from the host
                if flags is not None:
                    flags[:] = 0xFFFFFFF0
                else:
                    with torch.cuda.stream(torch.cuda.Stream()):
                        device_flags.fill_(0x7FFFFFF0)
                done.synchronize()
                return f"STUCK: {rounds} round trips not done in 10 s (released from the host)"
        elapsed = time.perf_counter() - started
        said = ours.recv()
        if said != "done":
            return said
        return (f"{rounds} round trips in {elapsed * 1e3:.1f} ms: {elapsed / rounds * 1e6:.1f} us each "
                f"(the host queued all of ours in {queued * 1e3:.1f} ms)")
    finally:
        proc.join(timeout=30)
        if shm is not None:
            drop_host_flags(shm, flags, unlink=True)


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
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    return f"{rounds} round trips in {elapsed * 1e3:.1f} ms: {elapsed / rounds * 1e6:.1f} us each"


def release(where: str, driver: Driver) -> str:
    stream = torch.cuda.Stream()
    shm = None
    if where == "host":
        shm, flags, address = host_flags(None)
    else:
        device_flags = torch.zeros(2, dtype=torch.int32, device="cuda")
        address = device_flags.data_ptr()
    try:
        done = torch.cuda.Event()
        driver.wait(stream, address, 7)
        marker = torch.zeros(1, device="cuda")
        with torch.cuda.stream(stream):
            marker.add_(1)
        done.record(stream)
        time.sleep(0.05)
        if done.query():
            return "the wait did not hold: its stream ran on before the value was written"
        started = time.perf_counter()
        if where == "host":
            flags[0] = 7  # a plain store: no CUDA call
        else:
            other = torch.cuda.Stream()
            with torch.cuda.stream(other):
                device_flags[0].fill_(7)
        while not done.query():
            if time.perf_counter() - started > 5:
                return "NOT released within 5 s of its host's write"
        return f"held 50 ms, released {(time.perf_counter() - started) * 1e6:.0f} us after its host's write, " \
               f"its kernel ran: {marker.item() == 1.0}"
    finally:
        if shm is not None:
            drop_host_flags(shm, flags, unlink=True)


def capture(driver: Driver) -> str:
    flags = torch.zeros(2, dtype=torch.int32, device="cuda")
    a, b = flags.data_ptr(), flags.data_ptr() + 4
    x = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        driver.wait(torch.cuda.current_stream(), a, 1)
        x.add_(1)
        driver.write(torch.cuda.current_stream(), b, 5)
    flags[0] = 1
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    return f"captured and replayed: flag written {int(flags[1])} (want 5), the kernel between ran {x.item():.0f} time(s)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("stream_wait_probe: needs a CUDA GPU")
    driver = Driver()
    print("one process, two streams:", one_process(args.rounds, driver), flush=True)
    for where in ("device", "host"):
        for name, run in (("ping-pong", lambda: ping_pong(where, args.rounds, driver)),
                          ("release", lambda: release(where, driver))):
            try:
                said = run()
            except Exception as exc:  # noqa: BLE001 - a probe reports what failed and goes on
                said = f"failed: {type(exc).__name__}: {exc}"
            print(f"flags in {where} memory, {name}: {said}", flush=True)
    try:
        said = capture(driver)
    except Exception as exc:  # noqa: BLE001
        said = f"failed: {type(exc).__name__}: {exc}"
    print(f"graph capture: {said}", flush=True)


if __name__ == "__main__":
    main()
