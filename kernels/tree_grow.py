"""Best-first draft trees in one launch: a chained tree step's trees (`shared.tree`) built on the device.

`shared.tree.grow_trees` builds B trees with torch ops level by level: some eight kernels a level, well over
a hundred for a block of 15 rows. Captured in a chained step's graph, each is a few microseconds of a GPU
doing almost nothing: on the H100 a tree step took 1.70 ms where a chain step took 1.07 (the forty-third
session, `bench/split_bench.py --also-trees 15`, one stream). Here one program a tree runs
`shared.tree.best_first` itself: N pops of the best path on a frontier held in registers (a popped path
offers its next sibling and its first child), each node's visibility word (`tree_words`: its parent's, and
its own row's bit) kept as it is made. Ties may pick other nodes of equal score than `best_first` does.
`grow_verify_inputs` also writes the verify's tokens and rotary positions, and sanitises the drafter's scores and
ids as it reads them: seven torch kernels fewer around a chained tree step's verify.

Measured and dropped (fifty-second session, H100, `gpu_round.sh tree-grow-preload`, two rounds alternating): a
block's candidates read into registers once, before the pops, instead of three global reads a pop in series. Its
GPU tests passed, but a tree step at one stream took 0.999 / 1.000 ms with it against 0.998 / 0.999 without, the
kernel itself 17.7 µs against 16.9 to 17.1 (picking an element out of a register tile costs a reduction over it).
"""

from __future__ import annotations

import torch

from specsplit.shared.errors import InvalidRequest
from specsplit.shared.tree import TreeBatch, grow_trees, holds_nodes, tree_words

from ._triton import HAVE_TRITON, dependent_launch, gdc_enter, tl, triton


def grow_tree_words_reference(logp: torch.Tensor, ids: torch.Tensor, budget: int) -> tuple[TreeBatch, torch.Tensor]:
    """B trees of `budget` nodes from each block's candidates, logp and ids [B, R, K] (each row's best first),
    and their rows' visibility words [B, budget + 1]: `grow_trees` and `tree_words`."""
    trees = grow_trees(logp, ids, budget)
    return trees, tree_words(trees.parents)


def grow_tree_words(logp: torch.Tensor, ids: torch.Tensor, budget: int) -> tuple[TreeBatch, torch.Tensor]:
    """The Triton kernel on CUDA, the torch reference elsewhere. The scores are a drafter's (a peer's bytes): a NaN
    ranks last, as -inf does, and none exceeds 0 (a log-probability; +inf is 0), so no node outscores its parent:
    whatever the scores, the trees are well formed (their acceptance is the target's)."""
    check_tree_shape(logp, ids, budget)
    if HAVE_TRITON and logp.is_cuda:
        return grow_tree_words_triton(logp, ids, budget)  # (it sanitises the scores as it reads them)
    return grow_tree_words_reference(sanitised(logp), ids, budget)


def sanitised(logp: torch.Tensor) -> torch.Tensor:
    """A drafter's scores as the trees take them: float32, NaN ranks last (-inf), none above 0 (+inf is 0)."""
    return torch.nan_to_num(logp.float(), nan=float("-inf"), posinf=0.0).clamp(max=0.0)


def grow_verify_inputs_reference(logp: torch.Tensor, ids: torch.Tensor, budget: int, vocab: int, anchors: torch.Tensor,
                                 positions: torch.Tensor) -> tuple[TreeBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chained tree step's trees and its verify's inputs: the trees of `budget` nodes from candidates logp and ids
    [B, R, K] (a drafter's: ids clamped into the target's `vocab`, scores as `grow_tree_words` takes them), their
    words, then the verify's tokens [B, budget + 1] (each root's anchor [B], then the nodes') and the rotary
    positions of those rows (the root's position [B], then its own plus each node's depth)."""
    trees, words = grow_tree_words_reference(sanitised(logp), ids.clamp(0, vocab - 1), budget)
    tokens = torch.cat([anchors[:, None], trees.tokens], dim=1)
    rotary = positions[:, None] + torch.cat([torch.zeros_like(trees.depths[:, :1]), trees.depths], dim=1)
    return trees, words, tokens, rotary


def grow_verify_inputs(logp: torch.Tensor, ids: torch.Tensor, budget: int, vocab: int, anchors: torch.Tensor,
                       positions: torch.Tensor) -> tuple[TreeBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch on CUDA (the scores' and ids' sanitising included), the torch reference elsewhere."""
    check_tree_shape(logp, ids, budget)
    if vocab < 1 or anchors.shape != positions.shape or anchors.shape != logp.shape[:1]:
        raise InvalidRequest(f"a vocabulary and one anchor and position a tree, got {vocab}, "
                             f"{tuple(anchors.shape)} and {tuple(positions.shape)} for {logp.shape[0]} trees")
    if HAVE_TRITON and logp.is_cuda:
        return _grow_triton(logp, ids, budget, vocab, anchors, positions)
    return grow_verify_inputs_reference(logp, ids, budget, vocab, anchors, positions)


def check_tree_shape(logp: torch.Tensor, ids: torch.Tensor, budget: int) -> None:
    """Candidates [B, R, K] alike, and a budget of 1..63 nodes that R rows of K candidates have as many rank
    paths for (else a tree would run out of nodes to take)."""
    if logp.dim() != 3 or logp.shape != ids.shape or min(logp.shape) < 1 or not 1 <= budget < 64:
        raise InvalidRequest(f"trees of 1..63 nodes from [B, R, K] candidates, got {tuple(logp.shape)}, "
                             f"{tuple(ids.shape)} and {budget}")
    _, rows, width = logp.shape
    if not holds_nodes(rows, width, budget):
        raise InvalidRequest(f"{rows} rows of {width} candidates hold fewer rank paths than {budget} nodes")


@triton.jit
def _score(ptr, mask):
    """A drafter's score as `grow_tree_words` takes it: NaN ranks last (-inf), none above 0 (+inf is 0)."""
    x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    return tl.minimum(tl.where(x != x, float("-inf"), x), 0.0)


@triton.jit
def _best_first_kernel(logp_ptr, ids_ptr, tokens_ptr, parents_ptr, depths_ptr, words_ptr, R, K, vocab,
                       anchors_ptr, positions_ptr, verify_tokens_ptr, rotary_ptr,
                       N: tl.constexpr, NP: tl.constexpr, F: tl.constexpr, ROOTS: tl.constexpr,
                       USE_GDC: tl.constexpr):
    """Program b pops tree b's N best paths. The frontier's slot 0 starts with row 0's best; pop i puts the
    popped path's sibling in its slot and its child in slot i + 1 (each while its row has one). A slot's score
    is its base (its parent's score) plus its own log-probability: no subtraction, so -inf scores stay -inf.
    With ROOTS, ids are clamped into 0..vocab-1 and the verify's tokens and rotary positions written too."""
    gdc_enter(USE_GDC)
    b = tl.program_id(0).to(tl.int64)
    base_ptr = logp_ptr + b * R * K
    slots = tl.arange(0, F)
    first = _score(base_ptr, True)
    score = tl.where(slots == 0, first, float("-inf"))
    base = tl.zeros([F], dtype=tl.float32)
    row = tl.zeros([F], dtype=tl.int32)
    rank = tl.zeros([F], dtype=tl.int32)
    parent = tl.full([F], -1, dtype=tl.int32)
    nodes = tl.arange(0, NP)
    depth_of = tl.zeros([NP], dtype=tl.int32)
    word_of = tl.zeros([NP], dtype=tl.int64)
    live = slots == 0  # slots holding a path not taken yet (a -inf path is one: best_first keeps it too)
    for i in range(N):
        top = tl.max(tl.where(live, score, float("-inf")), 0)
        best = tl.min(tl.where(live & (score == top), slots, F), 0)  # the first live slot of the best score
        pick = slots == best
        s = tl.sum(tl.where(pick, score, 0.0), 0)
        at_base = tl.sum(tl.where(pick, base, 0.0), 0)
        r = tl.sum(tl.where(pick, row, 0), 0)
        k = tl.sum(tl.where(pick, rank, 0), 0)
        p = tl.sum(tl.where(pick, parent, 0), 0)
        at_p = nodes == p  # (none for a child of the root)
        depth = tl.sum(tl.where(at_p, depth_of, 0), 0) + 1
        word = tl.sum(tl.where(at_p, word_of, 0), 0) | 1 | (tl.full([], 1, tl.int64) << (i + 1))
        here = nodes == i
        depth_of = tl.where(here, depth, depth_of)
        word_of = tl.where(here, word, word_of)
        out = b * N + i
        token = tl.load(ids_ptr + b * R * K + r * K + k).to(tl.int64)
        if ROOTS:
            token = tl.minimum(tl.maximum(token, 0), vocab - 1)
            tl.store(verify_tokens_ptr + b * (N + 1) + 1 + i, token)
            tl.store(rotary_ptr + b * (N + 1) + 1 + i, tl.load(positions_ptr + b) + depth.to(tl.int64))
        tl.store(tokens_ptr + out, token)
        tl.store(parents_ptr + out, p.to(tl.int64))
        tl.store(depths_ptr + out, depth.to(tl.int64))
        # the sibling into the popped slot: the same base, the next rank's log-probability
        sibling = k + 1 < K
        sib = at_base + _score(base_ptr + r * K + k + 1, sibling)
        score = tl.where(pick, sib, score)
        live = tl.where(pick, sibling, live)
        rank = tl.where(pick, k + 1, rank)
        # the child into slot i + 1: this path's score, the next row's best
        child = r + 1 < R
        kid = s + _score(base_ptr + (r + 1) * K, child)
        put = slots == i + 1
        score = tl.where(put, kid, score)
        live = live | (put & child)
        base = tl.where(put, s, base)
        row = tl.where(put, r + 1, row)
        rank = tl.where(put, 0, rank)
        parent = tl.where(put, i, parent)
    words = words_ptr + b * (N + 1)
    tl.store(words, tl.full([], 1, tl.int64))  # the root sees itself
    tl.store(words + 1 + nodes, word_of, mask=nodes < N)
    if ROOTS:
        tl.store(verify_tokens_ptr + b * (N + 1), tl.load(anchors_ptr + b).to(tl.int64))
        tl.store(rotary_ptr + b * (N + 1), tl.load(positions_ptr + b).to(tl.int64))


def grow_tree_words_triton(logp: torch.Tensor, ids: torch.Tensor, budget: int) -> tuple[TreeBatch, torch.Tensor]:
    """`grow_tree_words` in one launch: logp [B, R, K] (float; NaN ranks last, none above 0), ids int [B, R, K],
    budget 1..63."""
    trees, words, _, _ = _grow_triton(logp, ids, budget, 0, None, None)
    return trees, words


def _grow_triton(logp: torch.Tensor, ids: torch.Tensor, budget: int, vocab: int, anchors: torch.Tensor | None,
                 positions: torch.Tensor | None) -> tuple[TreeBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's launch: with anchors and positions (int64 [B]), `grow_verify_inputs`'s outputs too."""
    check_tree_shape(logp, ids, budget)
    logp, ids = logp.contiguous(), ids.contiguous()
    batch, rows, width = logp.shape
    device = logp.device
    out = [torch.empty((batch, budget), dtype=torch.int64, device=device) for _ in range(3)]
    words = torch.empty((batch, budget + 1), dtype=torch.int64, device=device)
    roots = anchors is not None
    verify_tokens, rotary = (torch.empty((batch, budget + 1), dtype=torch.int64, device=device) if roots else words
                             for _ in range(2))
    _best_first_kernel[(batch,)](logp, ids, *out, words, rows, width, vocab,
                                 anchors.contiguous() if roots else words, positions.contiguous() if roots else words,
                                 verify_tokens, rotary, N=budget, NP=triton.next_power_of_2(budget),
                                 F=triton.next_power_of_2(budget + 1), ROOTS=roots, num_warps=1,
                                 **dependent_launch(device, "tree_grow"))
    return TreeBatch(*out), words, verify_tokens, rotary
