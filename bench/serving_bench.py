"""What a server sees, side by side in one run: held-out prompts through B slots, requests admitted as others end.

    python bench/serving_bench.py --batch 1 8 16 [--requests 80] [--max-tokens 128] [--rounds 3] [--out DIR]

Per batch size: target-only and in-process DFlash engines (bf16, greedy, EOS ends a request), each with
`EngineConfig.overlap_prefill` on (the default) and off, every engine warmed up once with the whole run
(its CUDA graphs, the chained steps' captures) and then timed in alternating rounds. Prints tokens/s (the
median over rounds), the speculative speedup with each setting, overlap over not, and whether every
request's tokens were the same with and without it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace

import torch

from served import default_model, dflash, heldout, save
from specsplit.shared.sampling import SamplingParams
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.sequence import Request


def served(engine: Engine, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[float, list[list[int]]]:
    requests = [Request(f"{tag}{i}", ids, SamplingParams(max_tokens=max_tokens)) for i, ids in enumerate(prompts)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    events = engine.generate(requests)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = [[t for e in events[r.request_id] for t in e.token_ids] for r in requests]
    return sum(map(len, tokens)) / seconds, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    setup, model, tokenizer = default_model()
    prompts = heldout(tokenizer, args.requests)
    drafter = dflash(model, setup)
    results = {}
    for batch in args.batch:
        base = EngineConfig(max_batch=batch)
        engines = {(spec, overlap): Engine(model, drafter if spec == "dflash" else None,
                                           replace(base, overlap_prefill=overlap), eos_ids=tokenizer.eos_token_ids)
                   for spec in ("target only", "dflash") for overlap in (True, False)}
        outputs = {}
        for key, engine in engines.items():
            outputs[key] = served(engine, prompts, args.max_tokens, "w")[1]
        rates = {key: [] for key in engines}
        for r in range(args.rounds):
            for key, engine in engines.items():
                rate, tokens = served(engine, prompts, args.max_tokens, f"r{r}-")
                rates[key].append(rate)
                outputs[key] = tokens
        median = {key: statistics.median(v) for key, v in rates.items()}
        row = {f"{spec}, overlap {'on' if overlap else 'off'}": median[(spec, overlap)] for spec, overlap in engines}
        for spec in ("target only", "dflash"):
            row[f"{spec}: overlap on over off"] = statistics.median(
                a / b for a, b in zip(rates[(spec, True)], rates[(spec, False)]))
            row[f"{spec}: same tokens on and off"] = outputs[(spec, True)] == outputs[(spec, False)]
        for overlap in (True, False):
            row[f"speedup, overlap {'on' if overlap else 'off'}"] = statistics.median(
                a / b for a, b in zip(rates[("dflash", overlap)], rates[("target only", overlap)]))
        results[f"batch_{batch}"] = row
        print(f"batch {batch}, {len(prompts)} prompts, {args.max_tokens} tokens, medians of {args.rounds} rounds:", flush=True)
        for name, value in row.items():
            print(f"  {name}: {value:.3f}" if isinstance(value, float) else f"  {name}: {value}", flush=True)
    save(args.out, "serving_bench.json", results)


if __name__ == "__main__":
    main()
