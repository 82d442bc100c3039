"""Fused elementwise kernels (kernels/norm, rope, activation) against their torch references, timed as the
model calls them: inside a CUDA graph.

    python bench/fused_bench.py [--out fused_bench.json]     (CUDA only; the JSON also lands in $OUT if set)

Each cell captures --calls back-to-back calls in one graph and reports µs per call (CUDA events, median
over --replays replays), so the graph's own launch cost is spread as it is over a whole decode step.
Shapes are SmolLM2-135M's and Qwen3-8B's, bf16; "launches" counts the device kernels one call issues.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from launches import count_launches
from specsplit.kernels import activation, norm, rope

SHAPES = {  # hidden, q heads, kv heads, head dim, FFN
    "smollm2": dict(hidden=576, hq=9, hkv=3, dim=64, ffn=1536),
    "qwen3_8b": dict(hidden=4096, hq=32, hkv=8, dim=128, ffn=12288),
}
TOKENS = (1, 8, 64, 512)
EPS = 1e-6
NUM_BLOCKS, BLOCK_SIZE = 256, 16  # one layer's KV pool: 4096 slots


def cases(shape: dict, tokens: int):
    """{kernel: (reference, triton, args)} on fresh bf16 CUDA inputs shaped as the model makes them."""
    hidden, hq, hkv, dim, ffn = shape["hidden"], shape["hq"], shape["hkv"], shape["dim"], shape["ffn"]
    rand = lambda *size: torch.randn(*size, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    x, residual, weight = rand(tokens, hidden), rand(tokens, hidden), rand(hidden)
    q, k, v = rand(tokens, (hq + 2 * hkv) * dim).split([hq * dim, hkv * dim, hkv * dim], dim=1)
    cos, sin = rand(tokens, dim), rand(tokens, dim)
    cache = rand(NUM_BLOCKS, BLOCK_SIZE, hkv, dim)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device="cuda")[:tokens]
    rope_args = (q.view(tokens, hq, dim), k.view(tokens, hkv, dim), v.view(tokens, hkv, dim), cos, sin,
                 cache, cache.clone(), slots)
    return {
        "rms_norm": (norm.rms_norm_reference, norm.rms_norm_triton, (x, weight, EPS)),
        "add_rms_norm": (norm.add_rms_norm_reference, norm.add_rms_norm_triton, (x, residual, weight, EPS)),
        "rope_and_cache_write": (rope.rope_and_cache_write_reference, rope.rope_and_cache_write_triton, rope_args),
        "silu_mul": (activation.silu_mul_reference, activation.silu_mul_triton, (rand(tokens, 2 * ffn),)),
    }


def graph_us(fn, args, calls: int, replays: int) -> float:
    """µs per call of `fn(*args)`, `calls` of them captured back to back in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: triton compiles on first launch
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args)
    graph.replay()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="JSON results file (default: $OUT/fused_bench.json when $OUT is set)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "fused_bench times CUDA graphs: run it on a GPU host"
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, bf16, µs per call inside a CUDA graph of {args.calls} calls")
    print(f"{'kernel':<22} {'model':<9} {'T':>4} {'torch µs':>9} {'triton µs':>10} {'speedup':>8} {'launches':>9}")
    rows = []
    for model, shape in SHAPES.items():
        for tokens in TOKENS:
            for kernel, (reference, triton_fn, fn_args) in cases(shape, tokens).items():
                row = dict(kernel=kernel, model=model, tokens=tokens,
                           torch_us=graph_us(reference, fn_args, args.calls, args.replays),
                           triton_us=graph_us(triton_fn, fn_args, args.calls, args.replays),
                           torch_launches=count_launches(lambda: reference(*fn_args), "cuda"))
                rows.append(row)
                print(f"{kernel:<22} {model:<9} {tokens:>4} {row['torch_us']:>9.2f} {row['triton_us']:>10.2f} "
                      f"{row['torch_us'] / row['triton_us']:>7.2f}× {row['torch_launches']!s:>7}/1", flush=True)
    out = args.out or (os.path.join(os.environ["OUT"], "fused_bench.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, dtype="bfloat16",
                           calls_per_graph=args.calls, rows=rows), f, indent=1)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
