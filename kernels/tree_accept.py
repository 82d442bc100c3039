"""A chained tree step's bookkeeping after its verify, in one launch: the accepted paths and what follows them.

After the target's verify of B draft trees, `Engine._tree_verify` needs each tree's accepted path
(`target_service.chain.accept_tree_paths`), the step's outcome row the host reads (the emitted tokens, then
the accepted count), the verify rows to commit to the drafter in path order, and the cache rows the
accepted nodes' k/v move from and to. As torch ops that is some forty tiny kernels in the step's graph, each a
few microseconds of a GPU doing almost nothing (the forty-seventh session's profile, H100, one stream: a tree
step ran 415 kernels in 1.20 ms where a chain step ran 345 in 1.05). Here one program a tree does all of it:
its nodes in registers, each node's ancestors read from its visibility word (`shared.tree.tree_words`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsplit.shared.tree import TreeBatch

from ._triton import HAVE_TRITON, dependent_launch, gdc_enter, tl, triton

KERNEL = True  # False: the torch reference on CUDA too (`bench/profile_step.py --torch-kernels tree_accept`)


@dataclass(frozen=True)
class TreeOutcome:
    """What a chained tree step keeps of B verified trees of N nodes, on the device."""

    accepted: torch.Tensor  # [B] int64: nodes accepted (the accepted path's depth)
    final: torch.Tensor  # [B] int64: the target's pick after the path (the next anchor)
    order: torch.Tensor  # [B, N + 1] int64: the verify rows to commit: the root's (0), then the path's by depth
    move_from: torch.Tensor  # [B, N] int64: the cache rows the path's k/v move from ...
    move_to: torch.Tensor  # [B, N] int64: ... and to (the positions their tokens take); scratch past the path


def accept_tree_step_reference(trees: TreeBatch, words: torch.Tensor, picks: torch.Tensor, positions: torch.Tensor,
                               tables: torch.Tensor, block_size: int, scratch: int,
                               outcome: torch.Tensor) -> TreeOutcome:
    """Torch ops: trees [B, N] and their `words` [B, N + 1], the verify's greedy picks [B, N + 1] (after the
    root, then after each node), each root's position [B], the sequences' block tables [B, W] (cache blocks of
    `block_size` rows), the cache's `scratch` row. Writes each tree's emitted tokens (`accept_tree_paths`) to
    outcome[:, :N + 1] and its accepted count to outcome[:, -1] (outcome [B, >= N + 2])."""
    from specsplit.target_service.chain import accept_tree_paths

    nodes = trees.tokens.shape[1]
    accepted, path, emitted = accept_tree_paths(trees, picks[:, :nodes + 1], words)
    outcome[:, :nodes + 1].copy_(emitted)
    outcome[:, -1].copy_(accepted)
    on_path = path >= 0
    src = torch.where(on_path, path, torch.arange(nodes, device=path.device)) + 1  # rows of the verify
    at = positions[:, None] + torch.arange(1, nodes + 1, device=path.device)

    def slots(p: torch.Tensor) -> torch.Tensor:
        return tables.gather(1, p // block_size).long() * block_size + p % block_size

    move_from = torch.where(on_path, slots(positions[:, None] + src), scratch)
    move_to = torch.where(on_path, slots(at), scratch)
    order = torch.cat([torch.zeros_like(src[:, :1]), src], dim=1)
    final = emitted.gather(1, accepted[:, None]).squeeze(1)
    return TreeOutcome(accepted, final, order, move_from, move_to)


def accept_tree_step(trees: TreeBatch, words: torch.Tensor, picks: torch.Tensor, positions: torch.Tensor,
                     tables: torch.Tensor, block_size: int, scratch: int, outcome: torch.Tensor) -> TreeOutcome:
    """The Triton kernel on CUDA, the torch reference elsewhere (the same arguments)."""
    if KERNEL and HAVE_TRITON and trees.tokens.is_cuda:
        return accept_tree_step_triton(trees, words, picks, positions, tables, block_size, scratch, outcome)
    return accept_tree_step_reference(trees, words, picks, positions, tables, block_size, scratch, outcome)


@triton.jit
def _accept_tree_kernel(tokens_ptr, parents_ptr, depths_ptr, words_ptr, picks_ptr, stride_picks, positions_ptr,
                        tables_ptr, stride_tables, table_width, block_size, scratch, outcome_ptr, stride_outcome,
                        outcome_width, accepted_ptr, final_ptr, order_ptr, move_from_ptr, move_to_ptr,
                        N: tl.constexpr, NP: tl.constexpr, USE_GDC: tl.constexpr):
    """Program b: tree b's N nodes along one axis (i) and the depths 1..N along another (d). A node is on an
    accepted path when it and each of its ancestors (its word's bits) hold the target's pick after its parent."""
    gdc_enter(USE_GDC)
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    real = i < N
    token = tl.load(tokens_ptr + b * N + i, mask=real, other=0)
    parent = tl.load(parents_ptr + b * N + i, mask=real, other=-1)
    depth = tl.load(depths_ptr + b * N + i, mask=real, other=0)
    word = tl.load(words_ptr + b * (N + 1) + 1 + i, mask=real, other=0)  # node i's: bit c + 1 for node c
    picks = picks_ptr + b * stride_picks
    after_parent = tl.load(picks + parent + 1, mask=real, other=-1)
    match = (token == after_parent) & real
    # [i, c]: node i sees node c (c itself or an ancestor)
    bit = tl.where(real, i + 1, 0)  # node c's bit (a padding lane's shift kept below 64: no undefined shift)
    sees = ((word[:, None] >> bit[None, :]) & 1) == 1
    sees = sees & real[:, None] & real[None, :]
    missed = tl.sum((sees & ~match[None, :]).to(tl.int32), 1)
    ok = (missed == 0) & real
    reach = tl.where(ok, depth, 0)
    count = tl.max(reach, 0)
    last = tl.min(tl.where(ok & (reach == count), i, NP), 0)  # the deepest accepted (the first, were two)
    last_word = tl.sum(tl.where(i == last, word, 0), 0)
    on_path = (((last_word >> bit) & 1) == 1) & real & (count > 0)
    # by depth: d = 0..N-1 holds the path's node at depth d + 1, if the path reaches it
    d = tl.arange(0, NP)
    at_depth = on_path[None, :] & (depth[None, :] == (d[:, None] + 1))  # [d, i]
    held = tl.sum(at_depth.to(tl.int32), 1) > 0
    node = tl.sum(tl.where(at_depth, i[None, :], 0), 1)
    path_token = tl.sum(tl.where(at_depth, token[None, :], 0), 1)
    first_token = tl.sum(tl.where(i == 0, token, 0), 0)  # (past the path: what gathering node -1 clamped reads)
    final = tl.load(picks + tl.where(count > 0, last + 1, 0))
    emitted = tl.where(held, path_token, first_token)
    emitted = tl.where(d == count, final, emitted)
    out = outcome_ptr + b * stride_outcome
    tl.store(out + d, emitted, mask=d < N)
    tl.store(out + N, final)
    tl.store(out + outcome_width - 1, count.to(tl.int64))
    tl.store(accepted_ptr + b, count.to(tl.int64))
    tl.store(final_ptr + b, final)
    src = tl.where(held, node, d) + 1
    tl.store(order_ptr + b * (N + 1), tl.zeros([], dtype=tl.int64))
    tl.store(order_ptr + b * (N + 1) + 1 + d, src.to(tl.int64), mask=d < N)
    root = tl.load(positions_ptr + b)
    table = tables_ptr + b * stride_tables
    # (a source lies at or past its destination: one past the table moves nothing, scratch to scratch)
    movable = held & (d < N) & ((root + src) // block_size < table_width)
    for side in tl.static_range(2):
        at = root + (src if side == 0 else d + 1)
        entry = tl.load(table + at // block_size, mask=movable, other=0).to(tl.int64)
        row = tl.where(movable, entry * block_size + at % block_size, scratch)
        tl.store((move_from_ptr if side == 0 else move_to_ptr) + b * N + d, row, mask=d < N)


def accept_tree_step_triton(trees: TreeBatch, words: torch.Tensor, picks: torch.Tensor, positions: torch.Tensor,
                            tables: torch.Tensor, block_size: int, scratch: int, outcome: torch.Tensor) -> TreeOutcome:
    """`accept_tree_step` in one launch: int64 trees, words and positions (contiguous), picks [B, >= N + 1] and
    outcome [B, >= N + 2] int64 with unit column stride, int32 or int64 tables [B, W] likewise. The caller
    reserves the blocks its trees reach; a path row whose source would lie past its table (where the reference
    would fail) moves scratch to scratch instead, so no other sequence's rows are ever read or written."""
    batch, nodes = trees.tokens.shape
    assert 1 <= nodes < 64 and words.shape == (batch, nodes + 1) and picks.shape[0] == batch
    assert picks.shape[1] >= nodes + 1 and outcome.shape[0] == batch and outcome.shape[1] >= nodes + 2
    assert tables.shape[0] == batch and positions.shape == (batch,)
    assert picks.stride(1) == 1 and outcome.stride(1) == 1 and tables.stride(1) == 1
    assert all(t.dtype == torch.int64 and t.is_contiguous()
               for t in (trees.tokens, trees.parents, trees.depths, words, positions))
    assert picks.dtype == outcome.dtype == torch.int64 and tables.dtype in (torch.int32, torch.int64)
    device = trees.tokens.device
    accepted, final = (torch.empty(batch, dtype=torch.int64, device=device) for _ in range(2))
    order = torch.empty((batch, nodes + 1), dtype=torch.int64, device=device)
    move_from, move_to = (torch.empty((batch, nodes), dtype=torch.int64, device=device) for _ in range(2))
    _accept_tree_kernel[(batch,)](trees.tokens, trees.parents, trees.depths, words, picks, picks.stride(0), positions,
                                  tables, tables.stride(0), tables.shape[1], block_size, scratch, outcome,
                                  outcome.stride(0), outcome.shape[1], accepted, final, order, move_from, move_to,
                                  N=nodes, NP=triton.next_power_of_2(nodes + 1), num_warps=2,
                                  **dependent_launch(device, "tree_accept"))
    return TreeOutcome(accepted, final, order, move_from, move_to)
