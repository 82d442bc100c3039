"""Probe: can a Triton GEMM beat cuBLAS on the step's skinny projections? (A measurement, not a kernel
we ship: one lands in kernels/, with its reference and tests, only if this shows it winning.)

    python bench/gemm_probe.py [--out FILE] [--shapes qkv o ...] [--rows 1 16] [--quick] [--cold-copies N]

A speculative step at one stream spends ~46 % of its GPU time in ~145 cuBLAS GEMMs of 8-16 rows, at
~3.8 µs each, where reading the weights once takes ~0.5 µs: latency, not bandwidth (bench/profile_step.py).
For each of SmolLM2's projections and M rows, y = x @ W.T in bf16 (fp32 accumulate) is timed inside a
CUDA graph of --calls back-to-back calls (as the engine runs them): torch's F.linear against the
best of a small grid of Triton tile shapes. Also checks each Triton result against F.linear.
Reusing one W keeps it in the H200's L2 (~50-60 MB), but in a real step each projection's weights
come from HBM (30 layers are 270 MB): --cold-copies N also times torch and the best tile cycling
through N copies of W (at most 2 GiB), one per call: with N x |W| well past L2, W is read cold.
Prints a table; writes JSON to --out or $OUT/gemm_probe.json.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_bench import time_us, write_json  # noqa: E402  (bench/ is not a package)

from specsplit.kernels import skinny_linear  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# (name, K in, N out) of SmolLM2-135M's layers (hidden 576, 9/3 heads of 64, FFN 1536) and its head
SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576), ("lm_head", 576, 49152)]
# ... and of Qwen3-8B's (hidden 4096, 32/8 heads of 128, FFN 12288, vocab 151936): weights of 32-1,188 MiB, read
# from HBM whatever the copies (`--geometry qwen3-8b`; where a step's GEMMs are bandwidth-bound, not latency-bound)
SHAPES_8B = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 24576), ("down", 12288, 4096),
             ("lm_head", 4096, 151936)]


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


def rotating(fn_of_w: Callable[[torch.Tensor], object], copies: list[torch.Tensor]) -> Callable[[], object]:
    """A zero-arg call using the next copy of W each time: a graph captured over it bakes in a walk
    through the copies, one weight pointer per captured call."""
    i = 0

    def call() -> object:
        nonlocal i
        out = fn_of_w(copies[i % len(copies)])
        i += 1
        return out
    return call


def layer_sum(results: list[dict], m: int, key: str) -> float:
    return sum(r[key] for r in results if r["M"] == m and r["shape"] != "lm_head")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--geometry", choices=["smollm2", "qwen3-8b"], default="smollm2")
    parser.add_argument("--shapes", nargs="+", choices=[s[0] for s in SHAPES], default=[s[0] for s in SHAPES])
    parser.add_argument("--blas-lt", action="store_true",
                        help="also time F.linear with torch's preferred BLAS library set to cuBLASLt")
    parser.add_argument("--quick", action="store_true", help="a smaller tile grid: less compile time")
    parser.add_argument("--cold-copies", type=int, default=0,
                        help="also time with N copies of W, one per call, so W comes from HBM (0: off)")
    parser.add_argument("--tune-cold", action="store_true",
                        help="with --cold-copies: time every tile cold (BLOCK_K up to 512, 3-6 stages) and take "
                             "the best cold tile, printing the five best")
    parser.add_argument("--row-tiles", action="store_true",
                        help="past 16 rows, a GEMM's grid of tiles (32-128 rows by 32-128 columns, 4 or 8 warps) "
                             "instead of the few-rows kernel's (kernels/skinny_linear.py's row tiles, 29th session)")
    args = parser.parse_args()
    if args.tune_cold and args.cold_copies <= 0:
        parser.error("--tune-cold needs --cold-copies")
    shapes = [s for s in (SHAPES_8B if args.geometry == "qwen3-8b" else SHAPES) if s[0] in args.shapes]
    if args.tune_cold:
        block_ns, block_ks, warp_counts, stage_counts = (16, 32), (128, 256, 512), (2, 4), (3, 4, 6)
    elif args.quick:
        block_ns, block_ks, warp_counts, stage_counts = (16, 32), (64, 256), (2, 4), (4,)
    else:
        block_ns, block_ks, warp_counts, stage_counts = (16, 32, 64), (64, 128, 256), (2, 4), (2, 4)
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), f"torch {torch.__version__} triton {triton.__version__}; µs per call")
    results = []
    for (name, k, n), m in itertools.product(shapes, args.rows):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5
        expected = F.linear(x, w)
        torch_us = time_us(lambda: F.linear(x, w), args.calls, args.replays, graph=True)
        lt_us = None
        if args.blas_lt:
            default_library = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                lt_us = time_us(lambda: F.linear(x, w), args.calls, args.replays, graph=True)
            finally:
                torch.backends.cuda.preferred_blas_library(default_library)
        best = None
        cold_copies = []
        if args.tune_cold:
            count = max(1, min(args.cold_copies, 2 ** 31 // (n * k * 2)))
            cold_copies = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5 for _ in range(count)]
        tiles_cold = []
        block_ms = [16] if m <= 16 else [16, 64]
        grid = itertools.product(block_ms, block_ns, block_ks, warp_counts, stage_counts)
        # (the few-rows kernel's tile, and what it runs past 16 rows since the twenty-ninth session)
        shipped = [(16, 16, 256, 2, 4), tuple(skinny_linear.WIDE_TILE)]
        if args.row_tiles and m > 16:
            grid = itertools.chain(itertools.product((32, 64, 128), (32, 64, 128), (64, 128), (4, 8), (3,)), shipped)
        timed = []
        for bm, bn, bk, warps, stages in grid:
            try:
                got = skinny(x, w, bm, bn, bk, warps, stages)
            except Exception as e:  # a tile that does not fit the SM's shared memory: skip it
                print(f"  skip {name} {bm}x{bn}x{bk} w{warps} s{stages}: {type(e).__name__}", file=sys.stderr)
                continue
            err = (got.float() - expected.float()).abs().max().item()
            if err > 0.05:
                raise SystemExit(f"{name} M={m} tile {bm}x{bn}x{bk}: max error {err}")
            tile = dict(block_m=bm, block_n=bn, block_k=bk, warps=warps, stages=stages)
            if cold_copies:  # the tile's time with W from HBM decides
                us = time_us(rotating(lambda w_: skinny(x, w_, **tile), cold_copies),
                             max(args.calls, len(cold_copies)), args.replays, graph=True)
                tiles_cold.append((us, tile))
            else:
                us = time_us(lambda: skinny(x, w, bm, bn, bk, warps, stages), args.calls, args.replays, graph=True)
            timed.append((us, (bm, bn, bk, warps, stages)))
            if best is None or us < best[0]:
                best = (us, tile)
        del cold_copies
        if args.row_tiles and m > 16:
            ranked = sorted(timed)
            for us, t in ranked[:5] + [r for r in ranked if r[1] in shipped]:
                print(f"  {name} M={m}: {us:7.2f} µs  {t}{'  (shipped)' if t in shipped else ''}")
        for us, t in sorted(tiles_cold, key=lambda c: c[0])[:5]:
            print(f"  cold {name} M={m}: {us:7.2f} µs  {t}")
        tile = best[1]
        best_label = "best triton cold" if args.tune_cold else "best triton"
        line = (f"{name:>8} M={m:>4} K={k:>5} N={n:>6}: torch {torch_us:7.2f}  {best_label} {best[0]:7.2f} "
                f"({torch_us / best[0]:.2f}x) {tile}  floor {n * k * 2 / 4.27e6:.2f}")
        if lt_us is not None:
            line += f"  cuBLASLt {lt_us:.2f}"
        torch_cold_us = triton_cold_us = None
        n_copies = 0
        if args.cold_copies > 0:
            n_copies = max(1, min(args.cold_copies, 2 ** 31 // (n * k * 2)))  # at most 2 GiB of copies
            copies = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5 for _ in range(n_copies)]
            cold_calls = max(args.calls, n_copies)  # the graph walks through every copy
            torch_cold_us = time_us(rotating(lambda w_: F.linear(x, w_), copies), cold_calls, args.replays,
                                    graph=True)
            triton_cold_us = time_us(rotating(lambda w_: skinny(x, w_, **tile), copies), cold_calls, args.replays,
                                     graph=True)
            del copies
            line += (f"  cold ({n_copies} x {n * k * 2 / 2**20:.1f} MiB): torch {torch_cold_us:.2f} "
                     f"triton {triton_cold_us:.2f} ({torch_cold_us / triton_cold_us:.2f}x)")
        row = dict(shape=name, M=m, K=k, N=n, torch_us=torch_us, cublaslt_us=lt_us, triton_us=best[0], tile=tile,
                   weight_floor_us=n * k * 2 / 4.27e6, cold_copies=n_copies, torch_cold_us=torch_cold_us,
                   triton_cold_us=triton_cold_us)
        results.append(row)
        print(line, flush=True)
    layer = "+".join(s[0] for s in shapes if s[0] != "lm_head")
    for m in (1, 16):
        if m not in args.rows or not layer:
            continue
        print(f"one layer at M={m} ({layer}): torch {layer_sum(results, m, 'torch_us'):.1f} µs, "
              f"best triton {layer_sum(results, m, 'triton_us'):.1f} µs")
        if args.cold_copies > 0:
            print(f"  cold: torch {layer_sum(results, m, 'torch_cold_us'):.1f} µs, "
                  f"best triton {layer_sum(results, m, 'triton_cold_us'):.1f} µs")
    write_json(results, args.out, "gemm_probe.json")


if __name__ == "__main__":
    main()
