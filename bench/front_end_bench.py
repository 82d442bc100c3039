"""What the target service's front end (Generate's gRPC threads) costs a step, with the engine in a thread of
the front end's process (under one GIL) and in a process of its own (`target serve --engine-process`), side by
side, with a stand-in engine in place of the model: no GPU, no weights.

    python bench/front_end_bench.py [--streams 1 2 4 8 16] [--sleep-ms 0.4] [--hold-ms 0.3] [--tokens 160]

The stand-in engine's step sleeps --sleep-ms (the GIL let go, as while a GPU runs the step) and then holds the
GIL --hold-ms (the host's Python of a step), and gives every running request one token. It runs behind the
real `TargetServicer`, with `EngineLoop` or `EngineProcess`, in a server process; the clients are threads of
this one, each sending three requests one after another. Prints, per stream count, tokens/s and the served step
against the stand-in's own (measured here: a sleep takes longer than asked), and the two engines' ratio."""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from specsplit.client import Client
from specsplit.shared.sampling import SamplingParams
from specsplit.shared.serving import wait_healthy

REQUESTS = 3  # a client's requests, one after another


class StandInEngine:
    """What `EngineLoop` / `EngineProcess` need of an engine; a step sleeps, then holds the GIL, then gives every
    running request one token."""

    def __init__(self, sleep_s: float, hold_s: float) -> None:
        from specsplit.target_service.counters import EngineCounters

        self.sleep_s, self.hold_s = sleep_s, hold_s
        self.model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=4096, vocab_size=49152))
        self.running: dict[str, tuple] = {}
        self.waiting: list = []
        self.counters = EngineCounters()
        self.proposer = self.tuner = None
        self.drafter_ok = False
        self.prefilling = 0

    def validate(self, request) -> None:
        pass

    def add(self, request) -> None:
        from specsplit.target_service.sequence import RequestStats

        self.running[request.request_id] = (request, RequestStats(prompt_tokens=len(request.prompt_ids)))

    def abort(self, request_id: str) -> None:
        self.running.pop(request_id, None)

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    def step(self) -> list:
        from specsplit.target_service.sequence import FinishReason, StepEvent

        time.sleep(self.sleep_s)
        until = time.perf_counter() + self.hold_s
        while time.perf_counter() < until:
            pass
        events = []
        for request_id, (request, stats) in list(self.running.items()):
            stats.steps += 1
            stats.generated += 1
            done = stats.generated >= request.params.max_tokens
            events.append(StepEvent(request_id, [7], "x", FinishReason.LENGTH if done else None, stats))
            if done:
                del self.running[request_id]
        return events


def serve(address: str, sleep_s: float, hold_s: float, engine_process: bool) -> None:
    """The stand-in engine behind the real servicer, in a thread of this process (EngineLoop) or a process of
    its own (EngineProcess), until killed."""
    from specsplit.local import target_dir
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.engine_process import EngineProcess
    from specsplit.target_service.loop import EngineLoop
    from specsplit.target_service.server import TargetServicer, serve as serve_target

    build = functools.partial(StandInEngine, sleep_s, hold_s)
    loop = EngineProcess(build) if engine_process else EngineLoop(build())
    servicer = TargetServicer(loop, Tokenizer.from_dir(target_dir("default")), "stand-in")
    served = serve_target(servicer, [address])  # noqa: F841 - kept alive until the process is killed
    while True:
        time.sleep(3600)


def stand_in_step(sleep_s: float, hold_s: float, steps: int = 500) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        time.sleep(sleep_s)
        until = time.perf_counter() + hold_s
        while time.perf_counter() < until:
            pass
    return (time.perf_counter() - start) / steps


def run(args: argparse.Namespace, engine_process: bool, step: float) -> dict[int, float]:
    """{streams: served step in seconds} with the engine as `engine_process` says."""
    with tempfile.TemporaryDirectory() as tmp:
        address = f"unix:{Path(tmp) / 'target.sock'}"
        server = subprocess.Popen([sys.executable, __file__, "--serve", address, "--sleep-ms", str(args.sleep_ms),
                                   "--hold-ms", str(args.hold_ms), *(["--engine-process"] if engine_process else [])],
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_healthy(address, timeout=120)
            params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)

            def client(_: int) -> int:
                with Client(address) as c:
                    return sum(len(c.generate([1, 2, 3], params).token_ids) for _ in range(REQUESTS))

            served = {}
            for n in args.streams:
                with ThreadPoolExecutor(n) as threads:
                    list(threads.map(client, range(n)))  # warm-up
                    start = time.perf_counter()
                    tokens = sum(threads.map(client, range(n)))
                    seconds = time.perf_counter() - start
                served[n] = n * seconds / tokens  # one token a stream a step
                where = "its own process" if engine_process else "a thread"
                print(f"engine in {where}, streams {n}: {tokens / seconds:.0f} tok/s, served step "
                      f"{served[n] * 1e3:.3f} ms ({served[n] / step:.2f}x the stand-in's)", flush=True)
            return served
        finally:
            server.kill()
            server.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--sleep-ms", type=float, default=0.4)
    ap.add_argument("--hold-ms", type=float, default=0.3)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # (the server process's own call)
    ap.add_argument("--engine-process", action="store_true", help=argparse.SUPPRESS)  # (... and its engine)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.sleep_ms / 1e3, args.hold_ms / 1e3, args.engine_process)
        return
    if min(args.streams) < 1 or args.sleep_ms < 0 or args.hold_ms < 0 or args.tokens < 1:
        ap.error("--streams and --tokens must be positive, --sleep-ms and --hold-ms >= 0")
    step = stand_in_step(args.sleep_ms / 1e3, args.hold_ms / 1e3)
    print(f"stand-in step {step * 1e3:.3f} ms (sleep {args.sleep_ms} ms asked, GIL held {args.hold_ms} ms)")
    threaded = run(args, False, step)
    own = run(args, True, step)
    print("streams | engine in a thread | in its own process | own / thread (served step)")
    for n in args.streams:
        print(f"{n:7d} | {threaded[n] * 1e3:15.3f} ms | {own[n] * 1e3:15.3f} ms | {own[n] / threaded[n]:.2f}x")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"stand_in_step_ms": step * 1e3, "sleep_ms": args.sleep_ms,
                                             "hold_ms": args.hold_ms, "tokens": args.tokens,
                                             "served_step_ms": {"thread": {n: v * 1e3 for n, v in threaded.items()},
                                                                "own_process": {n: v * 1e3 for n, v in own.items()}}},
                                            indent=2))


if __name__ == "__main__":
    main()
