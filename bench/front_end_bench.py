"""What the target service's front end (Generate's gRPC threads and the engine loop, under one GIL) costs a step,
with a stand-in engine in place of the model: no GPU, no weights.

    python bench/front_end_bench.py [--streams 1 2 4 8 16] [--sleep-ms 0.4] [--hold-ms 0.3] [--tokens 160]

The stand-in engine's step sleeps --sleep-ms (the GIL let go, as while a GPU runs the step) and then holds the
GIL --hold-ms (the host's Python of a step), and gives every running request one token. It runs behind the
real `TargetServicer` and `EngineLoop` in a process of its own; the clients are threads of this one, each
sending three requests one after another. Prints, per stream count, tokens/s and the served step against the
stand-in's own (measured here: a sleep takes longer than asked).
"""

from __future__ import annotations

import argparse
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


def serve(address: str, sleep_s: float, hold_s: float) -> None:
    """The stand-in engine behind the real servicer and loop, until killed."""
    from specsplit.local import target_dir
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.loop import EngineLoop
    from specsplit.target_service.sequence import FinishReason, RequestStats, StepEvent
    from specsplit.target_service.server import TargetServicer, serve as serve_target

    class StandInEngine:
        def __init__(self) -> None:
            self.model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=4096))
            self.running: dict[str, tuple] = {}

        def validate(self, request) -> None:
            pass

        def add(self, request) -> None:
            self.running[request.request_id] = (request, RequestStats(prompt_tokens=len(request.prompt_ids)))

        def abort(self, request_id: str) -> None:
            self.running.pop(request_id, None)

        @property
        def has_work(self) -> bool:
            return bool(self.running)

        def step(self) -> list[StepEvent]:
            time.sleep(sleep_s)
            until = time.perf_counter() + hold_s
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

    servicer = TargetServicer(EngineLoop(StandInEngine()), Tokenizer.from_dir(target_dir("default")), "stand-in")
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--sleep-ms", type=float, default=0.4)
    ap.add_argument("--hold-ms", type=float, default=0.3)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # (the server process's own call)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.sleep_ms / 1e3, args.hold_ms / 1e3)
        return
    if min(args.streams) < 1 or args.sleep_ms < 0 or args.hold_ms < 0 or args.tokens < 1:
        ap.error("--streams and --tokens must be positive, --sleep-ms and --hold-ms >= 0")
    with tempfile.TemporaryDirectory() as tmp:
        address = f"unix:{Path(tmp) / 'target.sock'}"
        server = subprocess.Popen([sys.executable, __file__, "--serve", address, "--sleep-ms", str(args.sleep_ms),
                                   "--hold-ms", str(args.hold_ms)], env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_healthy(address, timeout=120)
            step = stand_in_step(args.sleep_ms / 1e3, args.hold_ms / 1e3)
            params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)

            def client(_: int) -> int:
                with Client(address) as c:
                    return sum(len(c.generate([1, 2, 3], params).token_ids) for _ in range(REQUESTS))

            print(f"stand-in step {step * 1e3:.3f} ms (sleep {args.sleep_ms} ms asked, GIL held {args.hold_ms} ms)")
            for n in args.streams:
                with ThreadPoolExecutor(n) as threads:
                    list(threads.map(client, range(n)))  # warm-up
                    start = time.perf_counter()
                    tokens = sum(threads.map(client, range(n)))
                    seconds = time.perf_counter() - start
                served = n * seconds / tokens  # one token a stream a step
                print(f"streams {n}: {tokens / seconds:.0f} tok/s, served step {served * 1e3:.3f} ms "
                      f"({served / step:.2f}x the stand-in's, +{(served - step) / n * 1e6:.0f} us a stream)", flush=True)
        finally:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
