"""Where the training data generator's time goes: `target_service.dense.generate` at a wide batch.

    python bench/dense_profile.py --batch 2048 --prompt-len 192 --new 32 --out DIR

Prints prefill time, decode time per step (tokens/s), the feature capture's time, and the top GPU
kernels and host ops of a profiled stretch of decode steps.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specsplit.local import target_dir
from specsplit.target_service.dense import capture_features, generate
from specsplit.target_service.model import CaptureSpec, load_target


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=192)
    ap.add_argument("--new", type=int, default=32, help="decode steps timed")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model = load_target(target_dir("default"), dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (args.batch, args.prompt_len), generator=gen, device="cuda").tolist()
    generate(model, prompts[:8], 4)  # warm-up
    _, one = timed(lambda: generate(model, prompts, 1))
    out, many = timed(lambda: generate(model, prompts, args.new + 1, temperature=0.7, generator=gen))
    step = (many - one) / args.new
    _, cap = timed(lambda: capture_features(model, out.tokens, out.lengths, CaptureSpec(layer_ids=(1, 27))))
    lines = [f"batch {args.batch}, prompt {args.prompt_len}: prefill+1 {one * 1e3:.1f} ms; decode {step * 1e3:.2f} ms/step "
             f"= {args.batch / step:,.0f} tok/s; capture of {out.tokens.shape[1]} columns {cap * 1e3:.1f} ms"]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate(model, prompts, 9, temperature=0.7, generator=gen)
        torch.cuda.synchronize()
    lines += [prof.key_averages().table(sort_by="device_time_total", row_limit=20),
              prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)]
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"dense-b{args.batch}.txt"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
