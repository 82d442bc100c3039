"""Paged attention on the GPU: the Triton kernel (auto split, unsplit), the torch reference, and SDPA;
then the row max (the greedy pick) against torch's.

    python bench/kernels_bench.py [--out FILE] [--calls 20] [--replays 20]

Every sequence holds `context` keys (its Q queries' own included) in blocks of 16 scattered over a
pool. Times are µs per call, bf16: "graph" captures --calls back-to-back calls in one CUDA graph (how
the engine calls it) and times --replays replays with CUDA events; "eager" times the same calls
launched one by one. GB/s counts the K and V bytes each call must read. SDPA sees the same keys
contiguous, [B, Hkv, context, D], without a mask: a dense fused kernel's floor, not a like-for-like.
Writes the rows as JSON to --out, or to $OUT/kernels_bench.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Callable

import torch
import torch.nn.functional as F

from specsplit.kernels.paged_attention import default_splits, paged_attention_reference, paged_attention_triton
from specsplit.kernels.row_max import row_max_reference, row_max_triton
from specsplit.kernels.workspace import arrival_counters

GEOMETRIES = {"smollm2": (9, 3, 64), "qwen3_8b": (32, 8, 128)}  # (Hq, Hkv, D)
BLOCK_SIZE = 16


def paged_inputs(batch: int, q_len: int, context: int, q_heads: int, kv_heads: int, head_dim: int):
    blocks = -(-context // BLOCK_SIZE)
    shape = (batch * blocks, BLOCK_SIZE, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    tables = torch.randperm(batch * blocks, device="cuda").view(batch, blocks).int()
    positions = torch.arange(context - q_len, context, device="cuda").int().expand(batch, q_len).contiguous()
    q = torch.randn(batch, q_len, q_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    return q, k_cache, v_cache, tables, positions


def contiguous_kv(k_cache, v_cache, tables, context):
    """The same keys as [B, Hkv, context, D], for SDPA."""
    gather = lambda cache: cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    return gather(k_cache), gather(v_cache)


def time_us(call: Callable[[], object], calls: int, replays: int, graph: bool) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()  # compiles, warms the allocator
    torch.cuda.current_stream().wait_stream(stream)
    if graph:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            for _ in range(calls):
                call()
        run = cuda_graph.replay
    else:
        run = lambda: [call() for _ in range(calls)]
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def bench_case(geometry: str, batch: int, q_len: int, context: int, calls: int, replays: int) -> dict:
    q_heads, kv_heads, head_dim = GEOMETRIES[geometry]
    q, k_cache, v_cache, tables, positions = inputs = paged_inputs(batch, q_len, context, q_heads, kv_heads, head_dim)
    scale = head_dim ** -0.5
    k, v = contiguous_kv(k_cache, v_cache, tables, context)
    q_sdpa = q.transpose(1, 2)
    calls_by_name = {
        "triton": lambda: paged_attention_triton(*inputs, scale),
        "triton_1split": lambda: paged_attention_triton(*inputs, scale, num_splits=1),
        "reference": lambda: paged_attention_reference(*inputs, scale),
        "sdpa": lambda: F.scaled_dot_product_attention(q_sdpa, k, v, scale=scale, enable_gqa=True),
    }
    row = dict(geometry=geometry, B=batch, Q=q_len, context=context,
               splits=default_splits(batch * kv_heads, tables.shape[1] * BLOCK_SIZE, 64, q.device))
    for name, call in calls_by_name.items():
        row[f"{name}_graph_us"] = time_us(call, calls, replays, graph=True)
    row["triton_eager_us"] = time_us(calls_by_name["triton"], calls, replays, graph=False)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * k_cache.element_size()
    row["triton_gbps"] = kv_bytes / row["triton_graph_us"] / 1e3
    return row


COLUMNS = [("geometry", "{:>9}"), ("B", "{:>3}"), ("Q", "{:>3}"), ("context", "{:>7}"), ("splits", "{:>6}"),
           ("triton_graph_us", "{:>11.1f}"), ("triton_1split_graph_us", "{:>13.1f}"), ("triton_eager_us", "{:>11.1f}"),
           ("reference_graph_us", "{:>13.1f}"), ("sdpa_graph_us", "{:>9.1f}"), ("triton_gbps", "{:>8.0f}")]
HEADERS = ["geometry", "B", "Q", "context", "splits", "triton µs", "1-split µs", "eager µs", "reference µs",
           "sdpa µs", "GB/s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="JSON file (default: $OUT/kernels_bench.json when $OUT is set)")
    parser.add_argument("--calls", type=int, default=20, help="calls per graph / per timed eager run")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--q-len", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--context", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--geometry", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernels_bench needs a CUDA GPU")
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}; µs per call, bf16")
    widths = [len(fmt.format(0)) for _, fmt in COLUMNS]
    print(" ".join(h.rjust(w) for h, w in zip(HEADERS, widths)))
    rows = []
    for geometry in args.geometry:
        for context in args.context:
            for batch in args.batch:
                for q_len in args.q_len:
                    row = bench_case(geometry, batch, q_len, context, args.calls, args.replays)
                    rows.append(row)
                    print(" ".join(fmt.format(row[key]) for key, fmt in COLUMNS), flush=True)
    print("row max (µs per call in a graph, float32 rows): torch.max vs the Triton kernel")
    for vocab in (49152, 151936):
        for count in (1, 8, 16, 64, 128, 512):
            x = torch.randn(count, vocab, device="cuda")
            workspace = arrival_counters(count, "cuda")
            row = dict(kernel="row_max", rows=count, vocab=vocab,
                       torch_us=time_us(lambda: row_max_reference(x), args.calls, args.replays, graph=True),
                       triton_us=time_us(lambda: row_max_triton(x, workspace), args.calls, args.replays, graph=True))
            rows.append(row)
            print(f"  rows {count:>4} vocab {vocab:>6}: torch {row['torch_us']:7.1f}  triton {row['triton_us']:7.1f}"
                  f"  ({row['torch_us'] / row['triton_us']:.2f}x)", flush=True)
    write_json(rows, args.out, "kernels_bench.json")


def write_json(rows: list, out: str | None, name: str) -> None:
    """The rows as JSON to `out`, or to $OUT/name when $OUT is set (a device call's results folder)."""
    out = out or (os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
        print("wrote", out)


if __name__ == "__main__":
    main()
