"""The LM head as one float32-out GEMM (`shared.layers.head_logits`) against the head it replaced (a 16-bit
GEMM, then a conversion), in whole steps, side by side in one process.

    python bench/head_step_bench.py --batch 1 8 16 [--steps 40] [--rounds 3]

Per batch size: a target-only engine and an in-process DFlash engine (chained, captured steps) with each
head, their steady-state ms per step (all sequences on one prompt, no admissions) in alternating rounds,
and the GPU's busy time per step from the profiler. The "rounded" engines are built, and run, with every
logits path patched back to F.linear(...).float().
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import served
from specsplit.drafter_service import dflash
from specsplit.shared.sampling import SamplingParams
from specsplit.target_service import dense, graphs, model as target_model
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.sequence import Request

PROMPT = "Explain how a hash map works, with an example in Python."
PATCHED = (target_model, graphs, dense, dflash)


def rounded_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight).float()


@contextlib.contextmanager
def head(kind: str):
    saved = [m.head_logits for m in PATCHED]
    if kind == "rounded":
        for m in PATCHED:
            m.head_logits = rounded_head
    try:
        yield
    finally:
        for m, fn in zip(PATCHED, saved):
            m.head_logits = fn


def steps_ms(engine: Engine, steps: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def busy_ms(engine: Engine, steps: int) -> float:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    setup, model, tokenizer = served.default_model()
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))
    budget = (24 + (args.rounds + 1) * args.steps) * 16  # every step at most 16 tokens
    results, lines = {}, []
    for batch in args.batch:
        engines = {}
        for kind in ("one GEMM", "rounded"):
            with head(kind):
                for spec in ("target only", "dflash"):
                    drafter = served.dflash(model, setup) if spec == "dflash" else None
                    blocks = batch * -(-(len(prompt) + budget + 32) // 16)
                    engine = Engine(model, drafter, EngineConfig(max_batch=batch, kv_blocks=blocks))
                    for i in range(batch):
                        engine.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=budget, ignore_eos=True)))
                    for _ in range(24):  # prefill, captures (a chained shape is captured after 8 runs)
                        engine.step()
                    engines[(kind, spec)] = engine
        times = {key: [] for key in engines}
        for _ in range(args.rounds):
            for key, engine in engines.items():
                with head(key[0]):
                    times[key].append(steps_ms(engine, args.steps))
        row = {}
        for key, engine in engines.items():
            with head(key[0]):
                row[f"{key[1]}, {key[0]}"] = {"ms_per_step": statistics.median(times[key]),
                                              "gpu_busy_ms_per_step": busy_ms(engine, args.steps)}
        for spec in ("target only", "dflash"):
            new, old = row[f"{spec}, one GEMM"], row[f"{spec}, rounded"]
            row[f"{spec}: rounded over one GEMM"] = old["ms_per_step"] / new["ms_per_step"]
            lines.append(f"batch {batch}, {spec}: one GEMM {new['ms_per_step']:.3f} ms/step (GPU "
                         f"{new['gpu_busy_ms_per_step']:.3f}), rounded {old['ms_per_step']:.3f} (GPU "
                         f"{old['gpu_busy_ms_per_step']:.3f}): {old['ms_per_step'] / new['ms_per_step']:.3f}x")
        results[f"batch_{batch}"] = row
        print(lines[-2], lines[-1], sep="\n", flush=True)
    served.save(args.out, "head_step_bench.json", results)


if __name__ == "__main__":
    main()
