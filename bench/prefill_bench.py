"""Time to first token: prompts prefilled through captured forwards (`EngineConfig.graphed_prefill`) beside
eager ones, measured in one run, target only and with the drafter, prompts arriving one at a time and
all together.

    python bench/prefill_bench.py --device cuda --dtype bfloat16 --json-out prefill.json

Each engine serves the benchmark's chat prompts (the same as split_bench's) with one new token each:
`alone` admits them one after another (each prompt's own prefill), `together N` N of them at once
(the prompts over and over; packed prefill forwards: the time until the last of them has its first
token), and `long` one prompt of --long-tokens tokens (the chat prompts' tokens over and over: through
the long captured forwards, 512-token chunks). The time is the host's, from admission.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from specsplit.local import LocalSetup, load_parts
from specsplit.shared.sampling import SamplingParams
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.sequence import Request
from split_bench import PROMPTS


def first_tokens(engine: Engine, prompts: list[list[int]], together: bool, repeats: int) -> float:
    """Mean ms to first token over `repeats` rounds of the prompts."""
    spent, count = 0.0, 0
    for r in range(repeats):
        reqs = [Request(f"p{r}-{i}", p, SamplingParams(max_tokens=1, ignore_eos=True)) for i, p in enumerate(prompts)]
        for group in ([reqs] if together else [[q] for q in reqs]):
            if engine.graphs is not None:
                torch.cuda.synchronize()
            started = time.perf_counter()
            engine.generate(group)  # (one token each: the prefill's)
            spent += (time.perf_counter() - started) * len(group)  # each request waited the whole group
            count += len(group)
    return 1e3 * spent / count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--drafter", default="dflash")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--long-tokens", type=int, default=1500, help="the long prompt's length (0: none)")
    ap.add_argument("--together", type=int, nargs="+", default=[8, 64], help="prompts admitted at once")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats: at least 1")
    if args.long_tokens < 0:
        ap.error("--long-tokens: at least 0")
    if min(args.together) < 1:
        ap.error("--together: at least 1 prompt")
    setup = LocalSetup(drafter=args.drafter, device=args.device, dtype=args.dtype, seed=0)
    model, tokenizer, drafter = load_parts(setup)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    lengths = sorted(map(len, prompts))
    print(f"{len(prompts)} prompts of {lengths[0]}-{lengths[-1]} tokens (long: {args.long_tokens}); ms to first "
          f"token (host), mean over {args.repeats} rounds", flush=True)
    results = {"prompt_tokens": lengths}
    print(f"{'drafter':>8} {'arrival':>12} {'eager':>8} {'graphed':>8} {'ratio':>6}", flush=True)
    for name, proposer in (("none", None), (args.drafter, drafter)):
        most = max(args.together)
        engines = {graphed: Engine(model, proposer, EngineConfig(max_batch=most, graphed_prefill=graphed))
                   for graphed in (0, EngineConfig.graphed_prefill)}
        long = list(itertools.islice(itertools.cycle([t for p in prompts for t in p]), args.long_tokens))
        runs = [("alone", prompts, False)] + [(f"together {n}", list(itertools.islice(itertools.cycle(prompts), n)), True)
                                              for n in args.together] + ([("long", [long], False)] if long else [])
        for arrival, group, together in runs:
            for engine in engines.values():  # warm-up: every shape in use, captured or compiled
                first_tokens(engine, group, together, 1)
            ms = {g: first_tokens(e, group, together, args.repeats) for g, e in engines.items()}
            eager, graphed = ms[0], ms[EngineConfig.graphed_prefill]
            results[f"{name}_{arrival.replace(' ', '_')}"] = {
                "eager_ms": eager, "graphed_ms": graphed, "eager_over_graphed": eager / graphed,
                "graphed_prefills": engines[EngineConfig.graphed_prefill].counters.graphed_prefills}
            print(f"{name:>8} {arrival:>12} {eager:>8.2f} {graphed:>8.2f} {eager / graphed:>6.2f}", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
