"""What does the split cost per step when both streams order each other on the device, on one GPU or two?

The services' chained step, reduced to its skeleton: a "target" graph writes rows into a buffer of its own
GPU memory, then its stream writes a flag; the "drafter" (another process) has its stream wait for that
flag, replay a graph that reads the rows through CUDA IPC, and write a flag back, which the target's
stream waits for before its next step. Both hosts queue every step up front, so what is measured is the
GPU side alone: work, context switches, flag latency, and the rows read across NVLink when the drafter
has a GPU of its own (its IPC mapping opened in its own device's context, peer access enabled lazily).

    python tools/cross_gpu_probe.py [--drafter-gpu 1] [--work 120] [--steps 400]

Prints ms a step for both graphs in one process (the in-process floor) and through the two processes,
and whether the drafter read the rows the target wrote. On one GPU (the default) the two processes'
contexts time-slice: DEVICE.md measured +0.2 ms a step with IPC events between them; `--drafter-gpu 1`
(the 2-GPU kind) is what a drafter on a GPU of its own would gain. Needs cupy (CUDA IPC) and libcuda's
stream memory operations; every wait is released from the host if a step is not done in time, so the
probe ends instead of hanging.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch
import torch.multiprocessing as mp
from stream_wait_probe import Driver  # (tools/, beside this file: the services' own stream operations)

ROWS, COLS = 16, 5184  # one step's feature rows at one stream (k + 1 rows of 9 target layers x 576)
DEADLINE_S = 20.0
RELEASE = 0x3FFFFFFF


def work_graph(work: int, seed: int, before=None, after=None) -> torch.cuda.CUDAGraph:
    """`work` small bf16 matmuls (a step's GPU time), with `before()` / `after()` captured around them."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(576, 576, device="cuda", dtype=torch.bfloat16, generator=gen) / 24
    x = torch.randn(16, 576, device="cuda", dtype=torch.bfloat16, generator=gen)

    def body():
        if before is not None:
            before()
        y = x
        for _ in range(work):
            y = torch.tanh(y @ w)
        if after is not None:
            after(y)

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def in_process(work: int, steps: int) -> float:
    """Both graphs on one stream of one process: ms a step."""
    rows = torch.zeros(ROWS, COLS, device="cuda", dtype=torch.bfloat16)
    local = torch.empty_like(rows)
    target = work_graph(work, 0, after=lambda y: rows.copy_(y[:, :1].expand(ROWS, COLS)))
    drafter = work_graph(work // 4, 1, before=lambda: local.copy_(rows))
    for _ in range(20):
        target.replay()
        drafter.replay()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        target.replay()
        drafter.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps * 1e3


def drafter_main(pipe, gpu: int, work: int, steps: int, handle: bytes) -> None:
    """The drafter: its GPU's stream waits for the target's flag 0 >= i, replays (reading the target's rows
    through IPC, adding what it read to a sum), writes flag 1 = i. Sends that sum back."""
    try:
        import cupy as cp

        torch.cuda.set_device(gpu)
        ops = Driver()
        with cp.cuda.Device(gpu):  # mapped into this device's context: its kernels read the target's GPU
            pointer = cp.cuda.runtime.ipcOpenMemHandle(handle, cp.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
        flags = pointer  # int32 flags[4] (0: the target's, 1: ours, 2: a scratch word), then the rows
        nbytes = ROWS * COLS * 2
        memory = cp.cuda.UnownedMemory(pointer, 16 + nbytes, None, gpu)
        raw = cp.ndarray((16 + nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(memory, 0))
        rows = torch.as_tensor(raw[16:], device=f"cuda:{gpu}").view(torch.bfloat16).view(ROWS, COLS)
        local = torch.empty(ROWS, COLS, device=f"cuda:{gpu}", dtype=torch.bfloat16)
        read = torch.zeros(1, device=f"cuda:{gpu}")
        graph = work_graph(work // 4, 1, before=lambda: (local.copy_(rows), read.add_(local[0, :1].float())))
        stream = torch.cuda.Stream()
        # Do the stream operations take this peer-mapped memory at all? A wait already met and a write of
        # the scratch word, before the target queues anything behind us
        ops.wait(stream, flags, 0)
        ops.write(stream, flags + 8, 1)
        checked = torch.cuda.Event()
        checked.record(stream)
        deadline = time.perf_counter() + DEADLINE_S
        while not checked.query():
            if time.perf_counter() > deadline:
                raise RuntimeError("a wait already met and a write on the mapped flags did not finish")
            time.sleep(1e-4)
        read.zero_()
        torch.cuda.synchronize()
        pipe.send("ready")
        if not pipe.poll(120) or pipe.recv() != "go":
            raise RuntimeError("no go from the target within 120 s")
        with torch.cuda.stream(stream):
            for i in range(1, steps + 1):
                ops.wait(stream, flags, i)
                graph.replay()
                ops.write(stream, flags + 4, i)
        done = torch.cuda.Event()
        done.record(stream)
        deadline = time.perf_counter() + 2 * DEADLINE_S
        while not done.query():
            if time.perf_counter() > deadline:
                pipe.send("drafter stuck")
                os._exit(3)
            time.sleep(1e-4)
        pipe.send(("done", float(read.item())))
        os._exit(0)
    except Exception as exc:  # noqa: BLE001 - a probe reports what failed
        pipe.send(f"drafter failed: {type(exc).__name__}: {exc}")
        os._exit(2)


def split(work: int, steps: int, drafter_gpu: int) -> tuple[str, bool]:
    """Two processes, the drafter on `drafter_gpu`: (what was measured, whether every wait was met)."""
    import cupy as cp

    ops = Driver()
    nbytes = ROWS * COLS * 2
    with cp.cuda.Device(0):
        memory = cp.cuda.memory.Memory(16 + nbytes)  # one plain cudaMalloc: the IPC handle names exactly it
        cp.cuda.runtime.memset(memory.ptr, 0, 16 + nbytes)
        handle = bytes(cp.cuda.runtime.ipcGetMemHandle(memory.ptr))
    raw = cp.ndarray((16 + nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(memory, 0))
    rows = torch.as_tensor(raw[16:], device="cuda:0").view(torch.bfloat16).view(ROWS, COLS)
    flags = memory.ptr
    # Each step's rows hold its number (mod 200: exact in bf16), and both sides add up what they wrote and
    # read: a read out of order, or of stale rows, makes the sums differ
    counter, wrote = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")

    def write_rows(_y) -> None:
        counter.add_(1)
        rows.copy_(torch.remainder(counter, 200).to(torch.bfloat16).expand(ROWS, COLS))
        wrote.add_(rows[0, :1].float())

    target = work_graph(work, 0, after=write_rows)
    counter.zero_()
    wrote.zero_()
    torch.cuda.synchronize()
    stream, side = torch.cuda.Stream(), torch.cuda.Stream()

    def let_go() -> None:  # both sides' waits (stream operations on a side stream: no kernel)
        ops.write(side, flags, RELEASE)
        ops.write(side, flags + 4, RELEASE)

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=drafter_main, args=(theirs, drafter_gpu, work, steps, handle), daemon=True)
    proc.start()
    theirs.close()
    watchdog = None
    try:
        if not ours.poll(180):
            return "the drafter did not start within 180 s", True
        said = ours.recv()
        if said != "ready":
            return str(said), True
        ours.send("go")
        # Queued in chunks, the clock read between them; should queueing itself block (the stream's queue
        # full behind a wait the drafter never meets), a timer thread lets the waits go
        watchdog = threading.Timer(2 * DEADLINE_S, let_go)
        watchdog.daemon = True
        watchdog.start()
        started = time.perf_counter()
        with torch.cuda.stream(stream):
            for i in range(1, steps + 1):
                if i > 1:
                    ops.wait(stream, flags + 4, i - 1)  # the drafter read the last rows: ours to write again
                target.replay()
                ops.write(stream, flags, i)
                if i % 50 == 0 and (time.perf_counter() - started > DEADLINE_S or ours.poll()):
                    let_go()
                    return f"STUCK after {i} steps queued: {ours.recv() if ours.poll() else 'no word'}", False
            ops.wait(stream, flags + 4, steps)
        queued = time.perf_counter() - started
        done = torch.cuda.Event()
        done.record(stream)
        while not done.query():
            if time.perf_counter() - started > DEADLINE_S:
                let_go()
                return f"STUCK: {steps} steps not done in {DEADLINE_S:.0f} s (released from the host)", False
            time.sleep(1e-4)
        elapsed = time.perf_counter() - started
        if not ours.poll(DEADLINE_S):
            return "the drafter did not report", True
        said = ours.recv()
        if not (isinstance(said, tuple) and said[0] == "done"):
            return str(said), True
        want = float(wrote.item())
        return (f"{elapsed / steps * 1e3:.3f} ms a step (the host queued them in {queued * 1e3:.0f} ms); the "
                f"drafter read {'every step as written' if said[1] == want else f'WRONG: sum {said[1]:.0f}, want {want:.0f}'}"
                ), True
    finally:
        if watchdog is not None:
            watchdog.cancel()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter-gpu", type=int, nargs="+", default=[0],
                    help="the drafter's GPU(s), one run each (the target is on GPU 0)")
    ap.add_argument("--work", type=int, default=120, help="matmuls in the target's graph (the drafter's: a quarter)")
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cross_gpu_probe: needs a CUDA GPU")
    if any(not 0 <= g < torch.cuda.device_count() for g in args.drafter_gpu):
        sys.exit(f"cross_gpu_probe: this machine has {torch.cuda.device_count()} GPU(s)")
    torch.cuda.set_device(0)
    floor = in_process(args.work, args.steps)
    print(f"in one process, both graphs on GPU 0: {floor:.3f} ms a step", flush=True)
    for gpu in args.drafter_gpu:
        if gpu != 0:
            print(f"  peer access GPU {gpu} -> 0: {torch.cuda.can_device_access_peer(gpu, 0)}", flush=True)
        said, settled = split(args.work, args.steps, gpu)
        print(f"two processes, the drafter on GPU {gpu}, ordered by stream flags: {said}", flush=True)
        if not settled:  # (a stream may still wait: nothing more here can be trusted to return)
            os._exit(4)
        print(f"  (in one process: {in_process(args.work, args.steps):.3f} ms a step, measured again)", flush=True)


if __name__ == "__main__":
    main()
