"""Probe: can a Triton GEMM beat cuBLAS on the step's skinny projections? (A measurement, not a kernel
we ship: one lands in kernels/, with its reference and tests, only if this shows it winning.)

    python bench/gemm_probe.py [--out FILE]

A speculative step at one stream spends ~46 % of its GPU time in ~145 cuBLAS GEMMs of 8-16 rows, at
~3.8 µs each, where reading the weights once takes ~0.5 µs: latency, not bandwidth (bench/profile_step.py).
For each of SmolLM2's projections and M rows, y = x @ W.T in bf16 (fp32 accumulate) is timed inside a
CUDA graph of --calls back-to-back calls (as the engine runs them): torch's F.linear against the
best of a small grid of Triton tile shapes. Also checks each Triton result against F.linear.
Prints a table; writes JSON to --out or $OUT/gemm_probe.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_bench import time_us  # noqa: E402  (bench/ is not a package)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# (name, K in, N out) of SmolLM2-135M's layers (hidden 576, 9/3 heads of 64, FFN 1536) and its head
SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576), ("lm_head", 576, 49152)]


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                    other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def skinny(x, w, block_m, block_n, block_k, warps, stages):
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _skinny_kernel[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), BLOCK_M=block_m,
                         BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), f"torch {torch.__version__} triton {triton.__version__}; µs per call")
    results = []
    for (name, k, n), m in itertools.product(SHAPES, args.rows):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5
        expected = F.linear(x, w)
        torch_us = time_us(lambda: F.linear(x, w), args.calls, args.replays, graph=True)
        best = None
        block_ms = [16] if m <= 16 else [16, 64]
        for bm, bn, bk, warps, stages in itertools.product(block_ms, (16, 32, 64), (64, 128, 256), (2, 4), (2, 4)):
            try:
                got = skinny(x, w, bm, bn, bk, warps, stages)
            except Exception as e:  # a tile that does not fit the SM's shared memory: skip it
                print(f"  skip {name} {bm}x{bn}x{bk} w{warps} s{stages}: {type(e).__name__}", file=sys.stderr)
                continue
            err = (got.float() - expected.float()).abs().max().item()
            if err > 0.05:
                raise SystemExit(f"{name} M={m} tile {bm}x{bn}x{bk}: max error {err}")
            us = time_us(lambda: skinny(x, w, bm, bn, bk, warps, stages), args.calls, args.replays, graph=True)
            if best is None or us < best[0]:
                best = (us, dict(block_m=bm, block_n=bn, block_k=bk, warps=warps, stages=stages))
        row = dict(shape=name, M=m, K=k, N=n, torch_us=torch_us, triton_us=best[0], tile=best[1],
                   weight_floor_us=n * k * 2 / 4.27e6)
        results.append(row)
        print(f"{name:>8} M={m:>4} K={k:>5} N={n:>6}: torch {torch_us:7.2f}  best triton {best[0]:7.2f} "
              f"({torch_us / best[0]:.2f}x) {best[1]}", flush=True)
    total_torch = sum(r["torch_us"] for r in results if r["M"] == 16 and r["shape"] != "lm_head")
    total_triton = sum(r["triton_us"] for r in results if r["M"] == 16 and r["shape"] != "lm_head")
    print(f"one layer at M=16 (qkv+o+gate_up+down): torch {total_torch:.1f} µs, best triton {total_triton:.1f} µs")
    out = args.out or (os.path.join(os.environ["OUT"], "gemm_probe.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
        print("wrote", out)


if __name__ == "__main__":
    main()
