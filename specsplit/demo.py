"""`specsplit demo`: both services on the default model, a few prompts streamed through gRPC."""

from __future__ import annotations

import sys
import time

from specsplit.shared.sampling import SamplingParams
from specsplit.harness import ServiceSpec, spawn

PROMPTS = [
    "What is speculative decoding, in two sentences?",
    "Write a Python function that checks whether a number is prime.",
    "Give three tips for writing clear documentation.",
]


def run_demo(args) -> None:
    spec = ServiceSpec(target=args.target, drafter=args.drafter, device=args.device, dtype=args.dtype,
                       seed=args.seed)
    print(f"starting drafter ({spec.drafter}) and target ({spec.target}) on {spec.device} ...", flush=True)
    with spawn(spec) as services:
        print(f"drafter: {services.drafter_address}\ntarget:  {services.target_address}\n", flush=True)
        client = services.client()
        for prompt in PROMPTS:
            print(f"> {prompt}", flush=True)
            started = time.perf_counter()
            for chunk in client.stream(prompt, SamplingParams(max_tokens=96), chat=True):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            s = chunk.stats
            elapsed = time.perf_counter() - started
            print(f"\n[{s.generated_tokens} tokens in {elapsed:.2f} s, {s.steps} steps, drafted {s.drafted}, "
                  f"accepted {s.accepted}, tau {s.tau:.2f}, finish {chunk.finish_reason}]\n", flush=True)
        client.close()
    print("services stopped")
