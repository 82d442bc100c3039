"""Where a served run makes the host wait for the device: torch's CUDA sync debug mode over every engine step.

    python bench/sync_sites.py --requests 80 --batch 8 16 [--out DIR]

Held-out prompts through `--batch` slots, admitted as others end (what a server sees), in-process DFlash
and target-only, each run once to warm up and once under `torch.cuda.set_sync_debug_mode("warn")`: each
operation that synchronizes (a copy from pageable memory, a read-back, a stream synchronize) warns, and
the warning is counted by the innermost lines of our code that made it. A chained step's own read of the
step before is expected (one a step); anything else in a step drains the device's queue: the device then
idles while the host goes on. (Event.synchronize is not a sync to this mode: the engine's own waits on
its events are not listed.)
"""

from __future__ import annotations

import argparse
import os
import traceback
import warnings
from collections import Counter

import torch

from served import default_model, dflash, heldout, save
from specsplit.shared.sampling import SamplingParams
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.sequence import Request

OURS = ("_service/", "/shared/", "specsplit/", "/kernels/")


def site() -> str:
    """Our innermost three frames, innermost last."""
    frames = [f for f in traceback.extract_stack()[:-2] if any(part in f.filename for part in OURS)]
    return " <- ".join(f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
                       for f in reversed(frames[-3:])) or "?"


def served(engine: Engine, prompts: list[list[int]], tag: str) -> int:
    for i, ids in enumerate(prompts):
        engine.add(Request(f"{tag}{i}", ids, SamplingParams(max_tokens=128)))
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    return steps


def sites_of(engine: Engine, prompts: list[list[int]]) -> tuple[int, Counter]:
    served(engine, prompts, "w")
    counts: Counter = Counter()
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message).split("\n")[0][:60]
        counts[f"{text} | {site()}"] += 1

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                steps = served(engine, prompts, "s")
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = original
    return steps, counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    setup, model, tokenizer = default_model()
    prompts = heldout(tokenizer, args.requests)
    drafter = dflash(model, setup)
    report = {}
    for batch in args.batch:
        for name, proposer in (("in-process", drafter), ("target-only", None)):
            engine = Engine(model, proposer, EngineConfig(max_batch=batch), eos_ids=tokenizer.eos_token_ids)
            steps, counts = sites_of(engine, prompts)
            print(f"{name}, {len(prompts)} prompts through {batch} slots: {steps} engine steps, "
                  f"{sum(counts.values())} synchronizing operations", flush=True)
            for where, n in counts.most_common(25):
                print(f"  {n / steps:6.2f}/step  {where}", flush=True)
            report[f"{name}_b{batch}"] = {"steps": steps, "sites": dict(counts)}
    save(args.out, "sync_sites.json", report)


if __name__ == "__main__":
    main()
