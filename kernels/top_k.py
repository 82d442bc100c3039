"""Each row's K largest values as log-probabilities, and their columns: a draft tree's candidates (`shared.tree`).

The drafter's rows are logits over the vocabulary; a tree wants each row's K best tokens and their
log-probabilities. `torch.log_softmax` then `torch.topk` is a softmax pass and a radix select of several kernels:
at sixteen streams (240 rows of 49,152) about 0.3 ms of a chained tree step of 2.2 (the forty-third session,
`bench/profile_step.py --batch 16 --draft-tree 15`, H100). Here one launch: programs of BLOCK columns each keep
their block's K best and its (max, sum of exp) partials; the last of a row's programs to finish
(`kernels.workspace`) merges them, the logsumexp and the K best of all, best first (the first column among equal
values). Rows must hold at least K columns, all finite.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, _switch, dependent_launch, gdc_enter, tl, triton
from .workspace import arrived_last

BLOCK = 2048  # columns a program reads
KERNEL = True  # False: the torch reference on CUDA too (`bench/profile_step.py --torch-kernels top_k`)
# The tree scores computed in the kernel's launch (on since the forty-ninth session, which ran it on an H100:
# `gpu_round.sh scored-top-k`); SPECSPLIT_TOP_K_SCORES=0: the kernel's log-probabilities scored by torch ops after
# it (`scored`), as before
SCORES_IN_LAUNCH = _switch("SPECSPLIT_TOP_K_SCORES", True)


def top_k_logp_reference(x: torch.Tensor, k: int,
                         scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities float32 [R, k], columns int64 [R, k]) of each row's k largest, x [R, V]; with `scores`
    [3, block rows] (x's rows in blocks of that many), their scores (`scored`) instead."""
    logp, index = torch.log_softmax(x.float(), dim=-1).topk(k, dim=-1)
    if scores is not None:
        logp = scored(logp.view(-1, scores.shape[1], k), scores).view(-1, k)
    return logp, index


def scored(logp: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Draft-tree scores (`drafter_service.tree_scores`) of candidates' log-probabilities logp [..., R, k], each row's
    best first: log σ(a + b·lp + c·lp₀), (a, b, c) = scores [3, >= R] at the row's place in its block and lp₀ the
    row's best."""
    a, b, c = scores[:, :logp.shape[-2], None]
    lp = logp.float()
    return F.logsigmoid(a + b * lp + c * lp[..., :1])


def top_k_logp(x: torch.Tensor, k: int, workspace: torch.Tensor | None = None,
               scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel for a CUDA x with a workspace (at least R counters), the torch reference otherwise. With
    `scores` [3, block rows] float32 (x's rows blocks of that many rows), each kept value is its score (`scored`),
    computed in the same launch."""
    if scores is not None and (scores.dim() != 2 or scores.shape[0] != 3 or x.shape[0] % scores.shape[1]):
        raise ValueError(f"scores [3, rows of a block] for x's rows in whole blocks, got {tuple(scores.shape)} for "
                         f"{x.shape[0]} rows")
    if KERNEL and HAVE_TRITON and x.is_cuda and workspace is not None and k <= min(x.shape[-1], 64):
        if scores is None or SCORES_IN_LAUNCH:
            return top_k_logp_triton(x, k, workspace, scores)
        logp, index = top_k_logp_triton(x, k, workspace)
        return scored(logp.view(-1, scores.shape[1], k), scores).view(-1, k), index
    return top_k_logp_reference(x, k, scores)


@triton.jit
def _top_k_kernel(x_ptr, stride_x, vocab, part_val_ptr, part_idx_ptr, part_max_ptr, part_sum_ptr, arrivals_ptr,
                  val_ptr, idx_ptr, scores_ptr, stride_scores, block_rows, K: tl.constexpr, KP: tl.constexpr,
                  SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr, BLOCK: tl.constexpr, SCORED: tl.constexpr,
                  USE_GDC: tl.constexpr):
    """Program (row, split) keeps columns split*BLOCK..'s K best and their (max, sum exp) partials; the row's last
    arrival merges (and, SCORED, writes each kept value's score: scores [3, block_rows] of row % block_rows)."""
    gdc_enter(USE_GDC)
    row, split = tl.program_id(0), tl.program_id(1)
    cols = split * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    top = tl.max(x, axis=0)
    tl.store(part_max_ptr + row * SPLITS + split, top)
    tl.store(part_sum_ptr + row * SPLITS + split, tl.sum(tl.exp(x - top), axis=0))
    at_part = (row * SPLITS + split) * KP
    for j in tl.static_range(K):
        best = tl.max(x, axis=0)
        at = tl.min(tl.where((x == best) & (cols < vocab), cols, vocab), axis=0)  # (vocab: none left)
        tl.store(part_val_ptr + at_part + j, best)
        tl.store(part_idx_ptr + at_part + j, at)
        x = tl.where(cols == at, float("-inf"), x)
    counter = arrivals_ptr + row
    if arrived_last(counter, SPLITS):
        splits = tl.arange(0, SPLITS_POW2)
        real = splits < SPLITS
        maxes = tl.load(part_max_ptr + row * SPLITS + splits, mask=real, other=float("-inf"), cache_modifier=".cg")
        sums = tl.load(part_sum_ptr + row * SPLITS + splits, mask=real, other=0.0, cache_modifier=".cg")
        peak = tl.max(maxes, axis=0)
        lse = peak + tl.log(tl.sum(sums * tl.exp(maxes - peak), axis=0))
        cand = tl.arange(0, SPLITS_POW2 * KP)
        kept = (cand // KP < SPLITS) & (cand % KP < K)
        idxs = tl.load(part_idx_ptr + row * SPLITS * KP + cand, mask=kept, other=vocab, cache_modifier=".cg")
        vals = tl.load(part_val_ptr + row * SPLITS * KP + cand, mask=kept, other=float("-inf"), cache_modifier=".cg")
        vals = tl.where(idxs < vocab, vals, float("-inf"))
        if SCORED:
            place = row % block_rows
            a = tl.load(scores_ptr + place)
            b = tl.load(scores_ptr + stride_scores + place)
            c = tl.load(scores_ptr + 2 * stride_scores + place)
            first = tl.max(vals, axis=0) - lse  # (the row's best log-probability)
        for j in tl.static_range(K):
            best = tl.max(vals, axis=0)
            at = tl.min(tl.where((vals == best) & (idxs < vocab), idxs, vocab), axis=0)
            value = best - lse
            if SCORED:  # log σ(z) = min(z, 0) - log(1 + exp(-|z|))
                z = a + b * value + c * first
                value = tl.minimum(z, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(z)))
            tl.store(val_ptr + row * K + j, value)
            tl.store(idx_ptr + row * K + j, at.to(tl.int64))
            vals = tl.where(idxs == at, float("-inf"), vals)
        tl.atomic_xchg(counter, 0)


def top_k_logp_triton(x: torch.Tensor, k: int, workspace: torch.Tensor,
                      scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`top_k_logp` in one launch: x [R, V] (float32/bfloat16/float16, rows contiguous), 1 <= k <= min(V, 64);
    scores float32 [3, block rows] with unit column stride, R a multiple of its block rows."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    rows, vocab = x.shape
    assert rows >= 1 and 1 <= k <= min(vocab, 64) and vocab < 2 ** 31
    assert workspace.dtype == torch.int32 and workspace.numel() >= rows and workspace.device == x.device
    splits, kp = triton.cdiv(vocab, BLOCK), triton.next_power_of_2(k)
    part_val = torch.empty(rows, splits, kp, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(rows, splits, kp, dtype=torch.int32, device=x.device)
    part_max = torch.empty(rows, splits, dtype=torch.float32, device=x.device)
    part_sum = torch.empty(rows, splits, dtype=torch.float32, device=x.device)
    values = torch.empty(rows, k, dtype=torch.float32, device=x.device)
    indices = torch.empty(rows, k, dtype=torch.int64, device=x.device)
    if scores is not None:
        assert scores.dtype == torch.float32 and scores.stride(1) == 1 and scores.shape[0] == 3
        assert rows % scores.shape[1] == 0 and scores.device == x.device
    _top_k_kernel[(rows, splits)](x, x.stride(0), vocab, part_val, part_idx, part_max, part_sum, workspace, values,
                                  indices, values if scores is None else scores,
                                  0 if scores is None else scores.stride(0),
                                  1 if scores is None else scores.shape[1], K=k, KP=kp, SPLITS=splits,
                                  SPLITS_POW2=triton.next_power_of_2(splits), BLOCK=BLOCK, SCORED=scores is not None,
                                  num_warps=4, **dependent_launch(x.device, "top_k"))
    return values, indices
