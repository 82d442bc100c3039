"""Where the training-data generator's decode step goes, as `train-drafter` runs it: one
`target_service.dense.DenseDecoder` keeping the drafter's feature rows as it decodes (no second pass),
at --gen-batch rows (2,048). On the H200 it makes ~110k tokens/s, 18.6 ms a step, where the step's
GEMMs alone (2 x 135 M x 2,048 FLOP) would take ~1-2 ms. Fresh data per session is what the drafter's τ
follows (issue 10), so this step is worth knowing.

    python bench/dense_profile.py [--batch 2048] [--prompt 96] [--steps 24] [--capture 1,4,8,...] [--out DIR]

Prefills --batch random prompts of --prompt tokens, decodes --steps graph-replayed steps (capturing the
drafter's feature rows as training does), and prints ms per step, tokens/s and the top GPU kernels of a
profiled stretch, grouped by name. Writes dense-bBATCH.txt under --out (or $OUT) when given.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specsplit.local import target_dir
from specsplit.target_service.dense import DenseDecoder, left_pad
from specsplit.target_service.model import CaptureSpec, load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--prompt", type=int, default=96, help="prompt tokens of every row")
    ap.add_argument("--new", type=int, default=256, help="columns left for generation (the decoder's width)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--capture", default="1,4,8,11,14,17,20,24,27", help="target layers whose rows are kept")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_target(target_dir("default"), dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), generator=gen).tolist()
    ids, positions, valid = left_pad(prompts, device)
    decoder = DenseDecoder(model, args.batch, args.prompt + args.new)
    layers = tuple(int(i) for i in args.capture.split(",")) if args.capture else ()
    decoder.set_capture(CaptureSpec(layers), final=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    logits = decoder.prefill(ids, positions, valid)
    column, pos = args.prompt, positions[:, -1] + 1

    def steps(count: int) -> None:
        nonlocal logits, column, pos
        for _ in range(count):
            token = logits.argmax(-1)
            logits = decoder.step(token, pos, column)
            column, pos = column + 1, pos + 1

    steps(4)  # captures the first key bucket's graph
    sync()
    started = time.perf_counter()
    steps(args.steps)
    sync()
    per_step = (time.perf_counter() - started) / args.steps
    lines = [f"gen step: batch {args.batch}, columns {args.prompt}..{column}, capturing {list(layers)}: "
             f"{1e3 * per_step:.2f} ms/step, {args.batch / per_step:,.0f} tokens/s"]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        steps(min(args.steps, 8))
        sync()
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    lines.append(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60))
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"dense-b{args.batch}.txt"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
