"""Drafter-side commits side by side: every sequence's committed rows in one forward vs one per sequence.

    python bench/commit_bench.py --device cuda --dtype bfloat16 --batch 1 8 32

B sequences each commit --accepted + 1 rows (what one verify step sends); the table gives ms per
step (median) and the aten ops (CPU) or device kernels (CUDA) one step issues, for the shipped
DFlash drafter of the default target.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from launches import count_launches
from specsplit.local import LocalSetup, make_drafter, target_dir
from specsplit.target_service.model import load_target


def one_step(drafter, batch: int, rows: torch.Tensor, position: int, batched: bool) -> None:
    block = drafter.batched_appends() if batched else contextlib.nullcontext()
    with block:
        for seq in range(batch):
            drafter.stash(seq, rows)
            drafter.commit(seq, rows.shape[0], position, [7] * rows.shape[0])
            drafter.trim(seq, rows.shape[0] - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--accepted", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    setup = LocalSetup(drafter="dflash", device=args.device, dtype=args.dtype)
    drafter = make_drafter("dflash", load_target(target_dir("default"), dtype=setup.torch_dtype,
                                                 device=args.device), setup)
    cuda = args.device.startswith("cuda")
    rows = torch.randn(args.accepted + 1, drafter.spec.feature_dim, dtype=setup.torch_dtype, device=args.device)
    print(f"shipped DFlash drafter on {args.device} ({args.dtype}): B sequences commit {args.accepted + 1} rows each")
    print(f"{'B':>4} {'batched ms':>11} {'per-seq ms':>11} {'speedup':>8} {'ops b/p':>12}")
    for batch in args.batch:
        for seq in range(batch):
            drafter.alloc(seq, 1 << 20)
        position, result = 0, {}
        for batched in (True, False):
            samples = []
            for _ in range(args.repeats + 2):
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                one_step(drafter, batch, rows, position, batched)
                if cuda:
                    torch.cuda.synchronize()
                samples.append(time.perf_counter() - start)
                position += rows.shape[0]
            ops = count_launches(lambda: one_step(drafter, batch, rows, position, batched), args.device)
            position += rows.shape[0]
            result[batched] = (statistics.median(samples[2:]) * 1e3, ops)
        for seq in range(batch):
            drafter.free(seq)
        (b_ms, b_ops), (p_ms, p_ops) = result[True], result[False]
        print(f"{batch:>4} {b_ms:>11.2f} {p_ms:>11.2f} {p_ms / b_ms:>7.2f}× {b_ops!s:>5}/{p_ops!s:<6}", flush=True)


if __name__ == "__main__":
    main()
