"""Where a speculative step's time goes: wall time vs GPU busy time per engine step, and the top GPU
kernels and host ops, for the in-process engine (target graphs + drafter graphs).

    python bench/profile_step.py --drafter dflash --batch 1 --steps 30 --out DIR

GPU busy < wall means the step waits on the host (launches, Python, synchronisations).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specsplit.local import LocalSetup, make_drafter, target_dir
from specsplit.shared.sampling import SamplingParams
from specsplit.shared.tokenizer import Tokenizer
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.model import load_target
from specsplit.target_service.sequence import Request

PROMPT = "Explain how a hash map works, with an example in Python."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="dflash", help="dflash, mtp or none")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--stacks", action="store_true",
                    help="also list host->device and device->host copies and syncs by the Python line that made them")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    setup = LocalSetup(drafter=args.drafter, device="cuda", dtype="bfloat16", seed=0)
    folder = target_dir("default")
    model = load_target(folder, dtype=torch.bfloat16, device="cuda")
    tokenizer = Tokenizer.from_dir(folder)
    drafter = None if args.drafter == "none" else make_drafter(args.drafter, model, setup)
    engine = Engine(model, drafter, EngineConfig(max_batch=args.batch))
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))
    params = SamplingParams(max_tokens=4 * args.steps + 64, ignore_eos=True)
    for i in range(args.batch):
        engine.add(Request(f"r{i}", prompt, params))
    for _ in range(10):  # prefill, captures of the buckets in use
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=args.stacks) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / args.steps
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / args.steps  # ms
    lines = [f"drafter {args.drafter}, batch {args.batch}: wall {wall * 1e3:.3f} ms/step, GPU busy {busy:.3f} ms/step, "
             f"{len(kernels) / args.steps:.0f} kernels/step",
             prof.key_averages().table(sort_by="device_time_total", row_limit=15),
             prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)]
    if args.stacks:
        lines.append(copy_sites(prof, args.steps))
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"profile-{args.drafter}-b{args.batch}.txt"), "w") as f:
            f.write(text)


COPY_OPS = ("aten::copy_", "aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::tolist")


def copy_sites(prof, steps: int) -> str:
    """Per step: copies and host reads grouped by the innermost line of our code on their stack."""
    sites: dict[str, list[float]] = {}
    for e in prof.events():
        if e.name not in COPY_OPS or not e.stack:
            continue
        ours = [f for f in e.stack if "specsplit" in f or "/target_service/" in f or "/drafter_service/" in f
                or "/shared/" in f]
        key = f"{e.name} @ {ours[0] if ours else e.stack[0]}"
        entry = sites.setdefault(key, [0, 0.0])
        entry[0] += 1
        entry[1] += e.cpu_time_total
    rows = sorted(sites.items(), key=lambda kv: -kv[1][1])
    out = ["copies and host reads per step, by call site (count/step, host us/step):"]
    out += [f"{n / steps:6.1f} {us / steps:9.1f}  {site}" for site, (n, us) in rows[:40]]
    return "\n".join(out)


if __name__ == "__main__":
    main()
