"""The target's attention paths side by side: one padded call per layer vs a loop over sequences.

    python bench/attention_bench.py --device cuda --dtype bfloat16 --batch 1 8 32
    python bench/attention_bench.py --target DIR --random-weights ...   (only DIR/config.json is read)

For each batch size, B sequences with a history of --context tokens each verify --verify tokens in
one forward (the speculative step's shape). Both paths run on the same cache in one process; the
table gives ms per forward (median), the ratio, and the number of device kernels (CUDA) or aten ops
(CPU) one forward issues — the launch count that bounds a small model's step on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from launches import count_launches
from specsplit.shared.checkpoint import load_config
from specsplit.shared.layers import RotaryEmbedding
from specsplit.local import target_dir
from specsplit.target_service.model import ForwardBatch, TargetModel, load_target


def forward_batch(batch: int, context: int, verify: int, device: str) -> ForwardBatch:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 40000, (batch * verify,), generator=gen)
    positions = torch.arange(context, context + verify).repeat(batch)
    cu = torch.arange(0, batch * verify + 1, verify)
    return ForwardBatch(ids.to(device), positions.to(device), cu, list(range(batch)))


def timed(model, fb, cache, device: str, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        model(fb, cache)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--target", default="default", help="default or an HF-format folder")
    parser.add_argument("--random-weights", action="store_true",
                        help="random weights of the target's shape (timing only; needs just config.json)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--verify", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    dtype = getattr(torch, args.dtype)
    if args.random_weights:
        torch.manual_seed(0)
        config = load_config(target_dir(args.target))
        model = TargetModel(config).to(dtype=dtype, device=args.device).eval()
        model.model.rotary_emb = RotaryEmbedding(config.head_dim, config.rope).to(args.device)  # float32, as loaded
    else:
        model = load_target(target_dir(args.target), dtype=dtype, device=args.device)
    print(f"{args.target} on {args.device} ({args.dtype}): B sequences of {args.context} tokens verify "
          f"{args.verify} each")
    print(f"{'B':>4} {'batched ms':>11} {'per-seq ms':>11} {'speedup':>8} {'launches b/p':>14}")
    for batch in args.batch:
        cache = model.new_cache(num_blocks=batch * ((args.context + args.verify) // 16 + 2))
        for seq_id in range(batch):
            cache.allocate(seq_id)
        prefill = forward_batch(batch, 0, args.context, args.device)
        model(prefill, cache)
        fb = forward_batch(batch, args.context, args.verify, args.device)
        result = {}
        for path in ("batched", "per_sequence"):
            model.attention_path = path
            timed(model, fb, cache, args.device, 2)  # warm-up
            result[path] = (timed(model, fb, cache, args.device, args.repeats),
                            count_launches(lambda: model(fb, cache), args.device))
        model.attention_path = "batched"
        (b_ms, b_n), (p_ms, p_n) = result["batched"], result["per_sequence"]
        print(f"{batch:>4} {b_ms:>11.2f} {p_ms:>11.2f} {p_ms / b_ms:>7.2f}× {b_n!s:>6}/{p_n!s:<7}", flush=True)


if __name__ == "__main__":
    main()
