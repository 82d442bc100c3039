"""Against what a user would pick instead: HF transformers `generate` (eager, and its static cache +
torch.compile fast path) vs specsplit's target-only engine, same weights, same prompts, one run.

    python bench/hf_bench.py --max-tokens 128 --batch 1 8 --out DIR
    python bench/hf_bench.py --no-hf ...   (ours only: decoding one step ahead vs step by step)

Greedy, bf16 on CUDA, `ignore_eos` on our side and `min_new_tokens` on HF's so both generate exactly
--max-tokens tokens per prompt. Ours runs twice, with the device one step ahead of the host (the
default) and step by step (`EngineConfig(decode_ahead=False)`); both must emit the same tokens.
Prints tokens/s; writes hf_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from specsplit.local import target_dir
from specsplit.shared.sampling import SamplingParams
from specsplit.shared.tokenizer import Tokenizer
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.model import load_target
from specsplit.target_service.sequence import Request

PROMPTS = ["Explain how a hash map works.", "Write a Python function to reverse a linked list.",
           "List five facts about the Moon.", "What is the difference between TCP and UDP?",
           "Describe the water cycle for a child.", "Write a haiku about autumn.",
           "How do I sort a dictionary by value in Python?", "Summarise the plot of Hamlet in three sentences."]


def timed(fn) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def ours(model, prompts: list[list[int]], max_tokens: int, ahead: bool) -> tuple[float, list[list[int]]]:
    """Tokens/s of the target-only engine, and the tokens it emitted."""
    engine = Engine(model, None, EngineConfig(max_batch=len(prompts), decode_ahead=ahead))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    emitted = []

    def go():
        events = engine.generate([Request(f"r{i}", p, params) for i, p in enumerate(prompts)])
        emitted[:] = [[t for e in events[f"r{i}"] for t in e.token_ids] for i in range(len(prompts))]

    go()  # warm-up
    return len(prompts) * max_tokens / timed(go), emitted


def hf(folder, prompts: list[list[int]], max_tokens: int, compiled: bool) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    width = max(len(p) for p in prompts)
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device="cuda")  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
    if compiled:
        # HF's own fast path: with a static cache, generate compiles the decoding forward itself
        # (torch.compile, fullgraph, "reduce-overhead" = CUDA graphs). Compiling model.forward by hand on
        # top of that breaks: the graphs' outputs are overwritten by the cache's in-place updates.
        kwargs["cache_implementation"] = "static"

    def go():
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, **kwargs)

    go()  # warm-up (and compilation)
    if compiled:
        go()
        if getattr(model, "_compiled_call", None) is None:
            raise RuntimeError("transformers did not compile the static-cache decode; this is not its fast path")
    return len(prompts) * max_tokens / timed(go)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--no-compile", action="store_true", help="skip HF's torch.compile path")
    ap.add_argument("--no-hf", action="store_true", help="ours only (decoding ahead vs step by step)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs ours only, as a smoke test (no graphs, "
                    "so nothing decodes ahead there)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    folder = target_dir("default")
    tokenizer = Tokenizer.from_dir(folder)
    encoded = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    rows = []
    model = load_target(folder, dtype=torch.bfloat16 if args.device == "cuda" else torch.float32, device=args.device)
    args.no_hf |= args.device != "cuda"
    print(f"{'batch':>5} {'specsplit':>10} {'(ms/token)':>10} {'step by step':>12} {'ratio':>6} {'same':>5} "
          f"{'HF eager':>10} {'HF compiled':>12}   tokens/s")
    for batch in args.batch:
        prompts = (encoded * batch)[:batch]
        (fast, fast_tokens), (slow, slow_tokens) = (ours(model, prompts, args.max_tokens, ahead) for ahead in (True, False))
        row = {"batch": batch, "specsplit": fast, "ms_per_token_per_stream": 1e3 * batch / fast,
               "specsplit_step_by_step": slow, "ahead_over_step_by_step": fast / slow,
               "same_tokens": fast_tokens == slow_tokens}
        if not args.no_hf:
            row["hf_eager"] = hf(folder, prompts, args.max_tokens, compiled=False)
            if not args.no_compile:
                row["hf_static_compiled"] = hf(folder, prompts, args.max_tokens, compiled=True)
        rows.append(row)
        print(f"{batch:>5} {fast:>10.1f} {row['ms_per_token_per_stream']:>10.3f} {slow:>12.1f} "
              f"{row['ahead_over_step_by_step']:>6.2f} {str(row['same_tokens']):>5} "
              f"{row.get('hf_eager', float('nan')):>10.1f} {row.get('hf_static_compiled', float('nan')):>12.1f}",
              flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "hf_bench.json"), "w") as f:
            json.dump({"max_tokens": args.max_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
