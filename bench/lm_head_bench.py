"""The LM head's GEMM at a step's row counts: how cuBLAS's pick for each way of writing it compares.

    python bench/lm_head_bench.py [--rows 1 8 16 64 120 128 136 256] [--geometry smollm2|qwen3-8b] [--out DIR]

A profile of the eight-stream in-process step (twenty-sixth session) put the verify's LM head, 128 rows of
SmolLM2's 576-wide hidden times its 49,152-row embedding, at 97 µs (one kernel, `nvjet_..._384x16_...`),
where the drafter's ~120-row head took 19 µs: a GEMM of 7.2 GFLOP and 57 MB of weights should take ~15.
Each way of writing logits = h @ W.T (float32 out) is replayed in a CUDA graph over cold copies of the
weight (cycled, more bytes than L2 holds, as in a real step where thirty layers come between two heads),
its µs per call printed per row count, and its result checked against F.linear(h, W).float(). Beside
torch's ways, kernels/skinny_linear.py's (at most 16 rows); `--geometry qwen3-8b` times Qwen3-8B's head
(151,936 x 4,096) instead.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from served import save
from specsplit.kernels.skinny_linear import MAX_ROWS, linear_triton

# (vocab, hidden, copies of the weight cycled): 6 x 57 MB or 2 x 1.2 GB, more than the H200's L2 either way,
# so each call reads its weight from HBM
GEOMETRIES = {"smollm2": (49_152, 576, 6), "qwen3-8b": (151_936, 4096, 2)}


def ways(weights: list[torch.Tensor], transposed: list[torch.Tensor]) -> dict:
    def mm_out_fp32(x, i):
        return torch.mm(x, weights[i].t(), out_dtype=torch.float32)

    return {
        "F.linear(h, W).float()": lambda x, i: F.linear(x, weights[i]).float(),
        "mm(h, W.T, out_dtype=fp32)": mm_out_fp32,
        "mm(h, Wt) with Wt = W.T contiguous, .float()": lambda x, i: torch.mm(x, transposed[i]).float(),
        "mm(W, h.T).T, .float()": lambda x, i: torch.mm(weights[i], x.t()).t().float(),
        "F.linear(h padded to 16k rows, W).float()": lambda x, i: F.linear(
            F.pad(x, (0, 0, 0, -x.shape[0] % 16)), weights[i])[:x.shape[0]].float(),
        "skinny linear (Triton), fp32 out": lambda x, i: linear_triton(x, weights[i], out_dtype=torch.float32),
    }


def time_way(fn, x: torch.Tensor, reps: int, copies: int) -> float:
    """µs per call, replayed in a graph that calls it `reps` times per weight copy."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):
            fn(x, i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for i in range(copies):
                fn(x, i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (reps * copies))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64, 120, 128, 136, 256])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--geometry", choices=list(GEOMETRIES), default="smollm2")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    vocab, hidden, copies = GEOMETRIES[args.geometry]
    torch.manual_seed(0)
    weights = [torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    transposed = [w.t().contiguous() for w in weights]
    table: dict[str, dict[int, float | str]] = {}
    for rows in args.rows:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, weights[0]).float()
        for name, fn in ways(weights, transposed).items():
            if "skinny" in name and rows > MAX_ROWS:
                table.setdefault(name, {})[rows] = "-"
                continue
            try:
                got = fn(x, 0)
                err = (got - ref).abs().max().item()
                same = torch.equal(got.argmax(-1), ref.argmax(-1))
                table.setdefault(name, {})[rows] = f"{time_way(fn, x, args.reps, copies):.1f}" + ("" if err < 0.02 else f" (err {err:.3f})") \
                    + ("" if same else " (argmax differs)")
            except (RuntimeError, TypeError, AssertionError) as exc:  # a way this torch does not have
                table.setdefault(name, {})[rows] = f"n/a: {str(exc).splitlines()[0][:40]}"
    head = f"{'µs per call, rows ->':<46}" + "".join(f"{r:>12}" for r in args.rows)
    lines = [head] + [f"{name:<46}" + "".join(f"{str(v[r]):>12}" for r in args.rows) for name, v in table.items()]
    print("\n".join(lines))
    save(args.out, f"lm_head_bench-{args.geometry}.json", table)


if __name__ == "__main__":
    main()
