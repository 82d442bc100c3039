"""Probe, on the GPU host, what chained steps over the split would stand on (run it through `device`):

    python tools/bells_probe.py

Chaining the target's and the drafter's steps across two processes needs each GPU stream to wait for
the other process's writes without a host in between, and the waiter must be able to give up on a
hostile or dead peer. Three questions, each printed with its answer:

1. A stream waits (`cuStreamWaitValue32`) on a 32-bit word in memory shared through CUDA IPC, queued
   before the peer's write (`cuStreamWriteValue32`, itself queued behind a long GPU sleep): does the
   wait hold until the write lands, then release?
2. A wait on a word the peer never writes: does it block, and does the waiter's own write of the word
   from another stream release it (what a watchdog would do)?
3. A stream waiting on a peer's interprocess CUDA event, the peer SIGKILLed while its recorded work
   is still running: does the waiter's stream ever finish?
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

import torch
import torch.multiprocessing as mp


def _value_ops():
    """cuStreamWaitValue32 / cuStreamWriteValue32 from the driver (torch does not expose them)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    wait, write = cuda.cuStreamWaitValue32_v2, cuda.cuStreamWriteValue32_v2
    for fn in (wait, write):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    return wait, write


def _finished(event: torch.cuda.Event, limit: float = 20.0) -> tuple[float, bool]:
    started = time.time()
    while not event.query() and time.time() - started < limit:
        time.sleep(1e-4)
    return round(time.time() - started, 3), event.query()


def _peer(words_queue, answers) -> None:
    wait, write = _value_ops()
    words = words_queue.get()  # int32 [4] of the parent's, opened through CUDA IPC
    stream, out = torch.cuda.Stream(), torch.zeros(1, device="cuda")
    with torch.cuda.stream(stream):
        torch.cuda._sleep(10**9)  # the parent's wait is queued long before this write lands
    answers.put(write(stream.cuda_stream, words.data_ptr(), 1, 0))
    # 2: wait on a word nobody writes, then release it from another stream of ours
    status = wait(stream.cuda_stream, words.data_ptr() + 4, 5, 0)
    with torch.cuda.stream(stream):
        out.fill_(2)
    done = torch.cuda.Event()
    done.record(stream)
    time.sleep(0.3)
    blocked = not done.query()
    released = write(torch.cuda.Stream().cuda_stream, words.data_ptr() + 4, 5, 0)
    answers.put({"wait status": status, "blocked": blocked, "release status": released,
                 "finished after release (s, done)": _finished(done), "work after the wait ran": out.item() == 2})
    # 3: an interprocess event recorded behind 20 s of GPU work, for the parent to wait on
    event = torch.cuda.Event(interprocess=True)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20 * 10**9)
    event.record(stream)
    answers.put(event.ipc_handle())
    time.sleep(60)


def main() -> None:
    context = mp.get_context("spawn")
    words_queue, answers = context.Queue(), context.Queue()
    wait, _ = _value_ops()
    words, out = torch.zeros(4, dtype=torch.int32, device="cuda"), torch.zeros(1, device="cuda")
    peer = context.Process(target=_peer, args=(words_queue, answers))
    peer.start()
    words_queue.put(words)
    print("peer's write queued, status", answers.get(timeout=60), flush=True)
    stream = torch.cuda.Stream()
    status = wait(stream.cuda_stream, words.data_ptr(), 1, 0)
    with torch.cuda.stream(stream):
        out.fill_(1)
    done = torch.cuda.Event()
    done.record(stream)
    print("1. wait on an IPC word the peer writes after a GPU sleep: status", status,
          "(s, done)", _finished(done), flush=True)
    print("2. wait on a word never written, released by the waiter:", answers.get(timeout=60), flush=True)
    handle = answers.get(timeout=60)
    event = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), handle)
    stream.wait_event(event)
    with torch.cuda.stream(stream):
        out.fill_(3)
    done.record(stream)
    time.sleep(0.5)
    print("3. waiting on the peer's IPC event while its work runs, done:", done.query(), flush=True)
    os.kill(peer.pid, signal.SIGKILL)
    peer.join()
    print("3. peer SIGKILLed: the waiter's stream (s, done)", _finished(done, 30), flush=True)


if __name__ == "__main__":
    main()
